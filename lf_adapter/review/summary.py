"""What a recipe will do on its hardware: plan, memory against the budget, host RAM, speed and wall time."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from .. import UserError
from ..data import ASSUMED_MEAN_SEQ_FRACTION, profile_dataset, row_lengths_from_meta
from ..hardware import HardwareProfile
from ..model_spec import ModelSpec
from ..plan import Plan
from ..planner import predict
from ..recipe.read import Recipe, dataset_entries, readable_count
from ..strategy import Offload
from ..throughput import speed_basis


@dataclass
class ReviewSummary:
    """What a recipe will do on its hardware; None where lfa cannot know (no model shape, no GPU, no dataset)."""

    hardware: str
    plan: str
    precision: str
    micro_batch: int
    grad_accum: int
    gpus: int
    effective_batch: int
    deepspeed: str
    gradient_checkpointing: bool
    tokens_per_step: int
    tokens_basis: str = ""  # where the mean row length comes from
    note: str | None = None
    model: str | None = None
    memory_gib: dict[str, float] | None = None
    reserved_gib: float | None = None
    budget_gib: float | None = None
    fits: bool | None = None
    host_gib: float | None = None
    host_ram_gib: float | None = None
    predicted_tokens_per_s: int | None = None
    speed_basis: str | None = None
    dataset_rows: int | None = None
    predicted_wall_time_s: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def summarize(
    recipe: Recipe, hardware: HardwareProfile, plan: Plan, spec: ModelSpec | None, workdir: Path | None = None
) -> ReviewSummary:
    d = recipe.data
    cutoff = readable_count(d, "cutoff_len")
    fraction, quantiles, tokens_basis = _row_lengths(recipe, workdir or recipe.folder, cutoff, plan)
    summary = ReviewSummary(
        hardware=hardware.name,
        plan=plan.label(),
        precision=plan.precision,
        micro_batch=plan.micro_batch_size,
        grad_accum=plan.grad_accum,
        gpus=plan.world_size,
        effective_batch=plan.effective_batch_size,
        deepspeed=f"{plan.deepspeed}" + ("" if plan.offload == Offload.NONE else f" offload {plan.offload}")
        if plan.deepspeed
        else "none",
        gradient_checkpointing=plan.gradient_checkpointing,
        tokens_per_step=round(plan.effective_batch_size * cutoff * fraction),
        tokens_basis=tokens_basis,
    )
    if spec is None:
        summary.note = "model shape unknown (not local, not in lfa's catalog): no memory or speed estimate"
        return summary
    summary.model = f"{spec.name} ({spec.num_params / 1e9:.2f} B params)"
    predicted = predict(spec, plan, hardware, cutoff, fraction, quantiles)
    if hardware.has_gpu:
        summary.memory_gib = {k: round(v, 2) for k, v in predicted.memory.items.items()}
        summary.reserved_gib = round(predicted.memory.reserved_gib, 2)
        summary.budget_gib = hardware.gpu.vram_gib
        summary.fits = predicted.memory.fits
    summary.host_gib = round(predicted.host.total_gib, 1)
    summary.host_ram_gib = predicted.host.ram_gib
    tokens_per_s = predicted.tokens_per_s
    summary.predicted_tokens_per_s = round(tokens_per_s)
    summary.speed_basis = speed_basis(hardware, plan)
    rows = count_dataset_rows(recipe, workdir or recipe.folder)
    if rows:
        epochs = float(d.get("num_train_epochs", 3.0))
        total = rows * epochs * cutoff * fraction
        if d.get("max_steps") and int(d["max_steps"]) > 0:
            total = min(total, int(d["max_steps"]) * summary.tokens_per_step)
        summary.dataset_rows = rows
        summary.predicted_wall_time_s = round(total / tokens_per_s)
    return summary


def _row_lengths(recipe: Recipe, workdir: Path, cutoff: int, plan: Plan) -> tuple[float, tuple[float, ...], str]:
    """Mean row length / cutoff_len and the row-length profile: 1 when packed; lfa's header (measured at generate);
    else the dataset when it is readable here (characters / 3, an estimate); else the planner's assumption of 75%,
    said as such."""
    if plan.packing:
        return 1.0, (), "packed rows fill cutoff_len"
    if "mean_seq_fraction" in recipe.meta:
        return *row_lengths_from_meta(recipe.meta), "mean row length measured by lfa generate"
    entries = dataset_entries(recipe, workdir)
    try:
        path, columns = entries[0]
        profile = profile_dataset(
            str(path), columns or {"prompt": "instruction", "query": "input", "response": "output"}, cutoff
        )
    except (IndexError, UserError):
        return (
            ASSUMED_MEAN_SEQ_FRACTION,
            (),
            f"rows assumed at {ASSUMED_MEAN_SEQ_FRACTION:.0%} of cutoff_len (dataset not readable here)",
        )
    return (
        profile.mean_seq_fraction,
        profile.length_quantiles,
        f"mean row {profile.mean_seq_fraction:.0%} of cutoff_len in {path.name} ({profile.counted_with})",
    )


def count_dataset_rows(recipe: Recipe, workdir: Path) -> int | None:
    if recipe.meta.get("dataset_rows"):
        return int(recipe.meta["dataset_rows"])
    entries = dataset_entries(recipe, workdir)
    if not entries:
        return None
    try:
        with entries[0][0].open(encoding="utf-8") as fh:
            return sum(1 for line in fh if line.strip())
    except (OSError, UnicodeDecodeError):
        return None
