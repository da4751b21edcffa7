"""Stage 5's words: why the chosen plan was chosen, what else runs on this machine, why nothing fits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import UserError
from .hardware import HardwareProfile
from .memory import (
    coefficients,
    disk_limit_gib,
)
from .model_spec import ModelSpec, catalog, load_model_spec
from .plan import Plan
from .planner import Candidate, PlanOptions, padding_free_exact_here, pick_precision, plan, rank
from .strategy import MASTER_WEIGHTS_RULE, Offload, Optimizer, Sharding, violated, violations
from .throughput import within_checked_sizes


@dataclass(frozen=True)
class MachineOption:
    """One way to run the job on this machine, for the listing of what runs here."""

    kind: str  # "exact" | "opt-in optimizer"
    candidate: Candidate
    why_not: str | None = None  # None: it fits

    @property
    def fits(self) -> bool:
        return self.why_not is None


def _why_not(c: Candidate) -> str | None:
    if c.fits:
        return None
    parts = []
    if not c.memory.fits:
        parts.append(f"GPU {c.memory.reserved_gib:.1f} > {c.memory.limit_gib:.1f} GiB")
    if not c.host.fits:
        parts.append(f"host {c.host.total_gib:.1f} > {c.host.limit_gib:.1f} GiB")
    if not c.disk_fits:
        parts.append(
            f"disk {c.disk_gib:.0f} GiB > {disk_limit_gib(c.disk_free_gib):.0f} usable"
            if c.disk_free_gib is not None
            else "no disk declared in the profile"
        )
    return "does not fit: " + ", ".join(parts)


def machine_options(priced: list[Candidate]) -> list[MachineOption]:
    """What runs on this machine: the fastest fitting plan of each strategy (sharding x offload) with AdamW, exact
    plans first; then each memory-light optimizer (opt-in: they change what is trained), its fastest fitting plan or,
    when none fits, its lightest and why."""
    exact: dict[tuple[str, str], Candidate] = {}
    for c in rank([c for c in priced if c.fits and not c.plan.changes_optimizer]):
        exact.setdefault((c.plan.sharding, c.plan.offload), c)
    rows = [MachineOption("exact", c) for c in sorted(exact.values(), key=lambda c: -c.tokens_per_s)]
    for optimizer in (o for o in Optimizer if o != Optimizer.ADAMW):
        mine = [c for c in priced if c.plan.optimizer == optimizer]
        if not mine:
            continue
        fitting = rank([c for c in mine if c.fits])
        best = fitting[0] if fitting else min(mine, key=lambda c: c.memory.reserved_gib)
        rows.append(MachineOption("opt-in optimizer", best, _why_not(best)))
    return rows


def wall_time_s(c: Candidate, rows: int, epochs: float, seq_len: int, mean_seq_fraction: float) -> float:
    """Predicted seconds for the whole run: every optimizer step of `epochs` passes over `rows` rows (the trainer
    runs a last, partial step per epoch)."""
    import math

    steps = math.ceil(rows / c.plan.effective_batch_size) * epochs
    return steps * c.step_s(seq_len, mean_seq_fraction)


def duration_text(seconds: float) -> str:
    """A predicted duration for people: seconds, minutes, hours, or days past 48 hours."""
    if seconds >= 48 * 3600:
        return f"{seconds / 86400:.1f} days"
    return (
        f"{seconds / 3600:.1f} h"
        if seconds >= 5400
        else f"{seconds / 60:.0f} min"
        if seconds >= 90
        else f"{seconds:.0f} s"
    )


def ruled_out_optimizers(listed: list[Candidate]) -> dict[str, str]:
    """The opt-in optimizers with no plan listed, and the constraint that rules each out at the listed precision."""
    if not listed:
        return {}
    probe = listed[0].plan
    shown = {c.plan.optimizer for c in listed}
    out = {}
    for optimizer in (o for o in Optimizer if o != Optimizer.ADAMW and o not in shown):
        plain = probe.replace(
            optimizer=optimizer.value, sharding=Sharding.NONE, offload=Offload.NONE, master_weights=False
        )
        reasons = [c.why for c in violations(plain)]
        if reasons:
            out[optimizer.value] = "; ".join(reasons)
    return out


def format_machine_options(
    options: list[MachineOption],
    seq_len: int,
    mean_seq_fraction: float,
    rows: int | None,
    epochs: float,
    speed_basis: str,
    pinned_optimizer: str | None = None,
) -> list[str]:
    """The listing of what runs on this machine: GPU, host and disk use, predicted speed, step and wall time."""
    if not options:
        return []
    span = (
        f"{epochs:g} epochs of {rows:,} rows"
        if rows
        else f"{epochs:g} epochs per 100,000 rows (pass --dataset for your data's figure)"
    )
    lines = [f"what runs on this machine (PREDICTED: GPU / host / disk GiB, tokens/s, one optimizer step, {span}):"]
    for o in options:
        c = o.candidate
        wall = wall_time_s(c, rows or 100_000, epochs, seq_len, mean_seq_fraction)
        tag = "exact" if o.kind == "exact" else "OPT-IN, changes what is trained"
        lines.append(
            f"  [{tag}] {c.plan.label()}: {c.memory.reserved_gib:.1f} / {c.host.total_gib:.1f} / "
            f"{c.disk_gib:.0f} GiB, {c.tokens_per_s:,.0f} tok/s, {c.step_s(seq_len, mean_seq_fraction):,.0f} s "
            f"per step, {duration_text(wall)}" + (f" -- {o.why_not}" if o.why_not else "")
        )
    for optimizer, why in ruled_out_optimizers([o.candidate for o in options]).items():
        lines.append(f"  [OPT-IN] {optimizer}: not possible here: {why}")
    exact = [o.candidate for o in options if o.kind == "exact"]
    light = [o.candidate for o in options if o.kind != "exact" and o.fits]
    if exact and light and max(c.tokens_per_s for c in light) > 2 * max(c.tokens_per_s for c in exact):
        ratio = max(c.tokens_per_s for c in light) / max(c.tokens_per_s for c in exact)
        lines.append(
            f"  note: the fastest opt-in optimizer is predicted {ratio:.1f}x faster than the fastest exact "
            "plan here; --allow-optimizer-change (or --pin optimizer=NAME) lets lfa take it, at the cost of "
            "not training with the paper's AdamW"
        )
    if not exact and pinned_optimizer not in (None, Optimizer.ADAMW):
        lines.append(f"  exact plans (the paper's AdamW) were not priced: --pin optimizer={pinned_optimizer}")
    elif not exact:
        lines.append("  no exact plan (the paper's AdamW) fits: an opt-in optimizer above, or the hardware below")
    lines.append(f"  speed rests on: {speed_basis}")
    return lines


def _what_would_fit(
    model: ModelSpec, hardware: HardwareProfile, effective_batch: int, seq_len: int, options: PlanOptions
) -> list[str]:
    """Where this batch would fit: the fewest GPUs of this kind that hold it, smaller models of the catalog."""
    would_fit: list[str] = []
    plain = dataclasses.replace(options, below_reserved_gib=None)
    for gpus in (2, 4, 8, 16, 32):
        if effective_batch % gpus:
            continue
        bigger = dataclasses.replace(hardware, gpus_per_node=min(gpus, 8), nodes=max(1, gpus // 8))
        try:
            found = plan(model, bigger, effective_batch, seq_len, plain, suggest=False)
        except UserError:
            continue
        would_fit.append(
            f"  would fit: {gpus} GPUs of this kind ({found.chosen.plan.label()}, "
            f"{found.chosen.memory.reserved_gib:.1f} GiB per GPU, {found.chosen.host.total_gib:.0f} GiB RAM per node)"
        )
        break
    smaller = []
    for name in catalog():
        other = load_model_spec(name)
        if other.num_params >= model.num_params or name == model.name:
            continue
        try:
            plan(other, hardware, effective_batch, seq_len, plain, suggest=False)
            smaller.append((other.num_params, name))
        except UserError:
            continue
    if smaller:
        would_fit.append(
            "  would fit: a smaller model, e.g. " + ", ".join(n for _, n in sorted(smaller, reverse=True)[:3])
        )
    return would_fit


def no_fit_message(
    model: ModelSpec,
    hardware: HardwareProfile,
    effective_batch: int,
    seq_len: int,
    options: PlanOptions,
    candidates: list[Candidate],
    suggest: bool = True,
) -> str:
    """Why nothing fits (the lightest plan's GPU and host needs) and what would: more GPUs of this kind, the RAM
    that ZeRO-3 offload needs, a smaller model from lfa's catalog."""
    lightest = min(candidates, key=lambda c: c.memory.reserved_gib)
    gpu_fitting = [c for c in candidates if c.memory.fits]
    where = f"{model.name} ({model.num_params / 1e9:.1f} B parameters) on {hardware.name}"
    if not hardware.has_gpu:
        return (
            f"no plan fits {where}: even {lightest.plan.label()} needs {lightest.memory.reserved_gib:.1f} GiB "
            f"of RAM against a limit of {lightest.memory.limit_gib:.1f} GiB; use a smaller model"
        )
    states = (
        f"the model states alone are {16 * model.num_params / 2**30:.1f} GiB (16 bytes per parameter, AdamW)"
        if not lightest.plan.changes_optimizer
        else f"the lightest plan, {lightest.plan.label()}, needs {lightest.memory.reserved_gib:.1f} GiB"
    )
    lines = [
        f"no plan fits {where}: {states}; the GPU has {lightest.memory.budget_gib:.1f} GiB "
        f"({lightest.memory.limit_gib:.1f} usable with {options.headroom:.0%} headroom), the host "
        f"{lightest.host.ram_gib or 0:.0f} GiB of RAM"
    ]
    if options.activation_scale > 1.0:
        lines.append(f"(activations scaled x{options.activation_scale:.2f} to match the OOM this run showed)")
    if gpu_fitting:
        best_host = min(gpu_fitting, key=lambda c: (c.host.total_gib, c.disk_gib))
        lines.append(
            f"  lightest on the GPU: {best_host.plan.label()} at {best_host.memory.reserved_gib:.1f} GiB, "
            f"but it {_why_not(best_host)}; host RAM: "
            + ", ".join(f"{k} {v:.1f}" for k, v in best_host.host.items.items())
        )
        if not best_host.host.fits:
            need_ram = best_host.host.total_gib / (1.0 - best_host.host.headroom)
            lines.append(
                f"  would fit: the same GPU with {need_ram:.0f} GiB of host RAM (declare it as ram_gib in a "
                "profile: lfa detect --save FILE, then --hardware FILE)"
            )
        if not best_host.disk_fits:
            need_disk = best_host.disk_gib / (1.0 - coefficients()["nvme"]["disk_headroom"])
            lines.append(
                f"  would fit: {need_disk:.0f} GiB free at the swap folder (lfa generate --nvme-path DIR on a "
                "larger local disk)"
            )
    else:
        lines.append(f"  lightest on the GPU: {lightest.plan.label()} at {lightest.memory.reserved_gib:.1f} GiB")
    if hardware.disk is None:
        lines.append(
            "  would fit with a local NVMe disk for ZeRO-3 NVMe offload: declare it in the profile as "
            "disk: {path: DIR, free_gib: N, read_gbs: R, write_gbs: W} (lfa detect --measure-disk --save FILE)"
        )
    if not suggest:
        return lines[0]
    return "\n".join(lines + _what_would_fit(model, hardware, effective_batch, seq_len, options))


OPTIMIZER_REASONS = {
    Optimizer.ADAMW: "AdamW, the paper's optimizer",
    Optimizer.ADAMW_8BIT: (
        "8-bit AdamW (bitsandbytes, opt-in): Adam moments quantized block-wise to 8 bits, 2 B/param "
        "instead of 8; CHANGES WHAT IS TRAINED (not the paper's AdamW)"
    ),
    Optimizer.BADAM: (
        "BAdam (opt-in): block coordinate descent, one decoder layer trained at a time with Adam "
        "(switching every 50 steps), the model kept in its checkpoint's dtype; CHANGES WHAT IS TRAINED (not "
        "the paper's AdamW; each layer sees 1/L of the updates); LLaMA-Factory checkpoints only the "
        "trainable layer, so the others keep their activations (priced)"
    ),
}


def padding_free_reason(p: Plan, hardware: HardwareProfile, options: PlanOptions, family_problem: str | None) -> str:
    if p.padding_free:
        return (
            ("on (pinned)" if options.fixed.get("padding_free") else "on")
            + ": each micro-batch's rows are flattened into one sequence with position ids restarting per row and "
            "attention limited to each row (torch's varlen flash attention), so no compute goes to padding and "
            "the step trains on exactly the same rows and tokens; where that kernel is missing at run time "
            "(torch < 2.10) the plugin trains padded and says so"
        )
    if "padding_free" in options.fixed:
        return "off (pinned)"
    if not options.padding_free:
        return "off: --no-padding-free"
    if p.packing:
        return "off: packed rows have no padding"
    if not hardware.has_gpu:
        return "off: no GPU (lfa's CPU path is one attention call per row, a reference, not a fast kernel)"
    if family_problem:
        return f"off: {family_problem}"
    if not padding_free_exact_here(hardware):
        return (
            f"off: {hardware.gpu.name} is sm{hardware.gpu.cc[0]}{hardware.gpu.cc[1]}, and torch's varlen flash "
            "attention needs sm80+ (the plugin's fallback, one attention call per row, is exact but not a fast kernel)"
        )
    return "off: padded plans were faster or the only ones that fit"


def _batch_reason(c: Candidate, hardware: HardwareProfile, options: PlanOptions) -> str:
    p, mem = c.plan, c.memory
    limit = (
        "no GPU memory limit (CPU)"
        if mem.limit_gib is None
        else (
            f"{mem.reserved_gib:.1f} GiB of {mem.limit_gib:.1f} GiB allowed ({mem.budget_gib:.1f} GiB usable, "
            f"{options.headroom:.0%} headroom)"
        )
    )
    return (
        f"effective batch kept at {p.effective_batch_size} = {p.micro_batch_size} micro-batch x "
        f"{p.grad_accum} accumulation x {p.world_size} {'GPU(s)' if hardware.has_gpu else 'process(es)'}; "
        f"predicted peak {limit}" + (f"; peak phase: {mem.phase}" if mem.phase else "")
    )


def _liger_reason(p: Plan, hardware: HardwareProfile, options: PlanOptions) -> str:
    if p.liger:
        return (
            "on: fused linear cross-entropy never materializes the fp32 logits, fused RMSNorm/SwiGLU/RoPE "
            "save activation memory"
        )
    if not hardware.has_gpu or not options.liger_available or not hardware.gpu.runs_triton:
        return "off: needs a CUDA GPU with Triton (sm80+)"
    return "off: not needed for the fastest fitting plan"


def _sharding_reason(c: Candidate, hardware: HardwareProfile) -> str:
    p = c.plan
    if p.deepspeed:
        nvme = (
            f"; fp32 master weights, Adam moments and fp32 gradients ({c.disk_gib:.0f} GiB) are swapped "
            f"to {hardware.disk.path} and stream through host buffers every optimizer step (ZeRO-Infinity)"
            if p.offloads_to_nvme and hardware.disk
            else ""
        )
        return (
            f"{p.deepspeed} with offload={p.offload}: model states do not fit otherwise; launched "
            "through torchrun (FORCE_TORCHRUN=1)" + nvme
        )
    if p.strategy.started_by == "accelerate":
        return (
            f"none; sharding fsdp2 (pinned): parameters, gradients and Adam states sharded over "
            f"{p.world_size} processes, started by `accelerate launch` with accelerate_fsdp2.yaml; "
            "speed priced as ZeRO-3 (not measured)"
            + ("; NOTE on a CPU accelerate runs this as plain DDP: it shards on GPUs only" if p.on_cpu else "")
        )
    if p.on_cpu:
        return "none: no GPU (DeepSpeed needs one)"
    if p.world_size == 1:
        return "none: one GPU holds the whole model state, DeepSpeed would add launch and copy overhead"
    return "none: DDP, every GPU holds the model state"


def _token_budget_reason(p: Plan) -> str:
    if not p.token_budget:
        return "off"
    return (
        f"each optimizer step's {p.micro_batch_size * p.grad_accum} rows per GPU are cut, longest first, into "
        f"micro-batches of at most {p.token_budget:,} tokens (memory is planned for that many), as many as "
        "the step's tokens need; the loss is normalized by the step's token count, so the gradient is the padded "
        f"step's. Without lfa's plugin LLaMA-Factory runs the fixed {p.micro_batch_size} x {p.grad_accum} above, "
        "which needs no more memory"
    )


def _recompute_reason(p: Plan, model: ModelSpec, options: PlanOptions) -> str:
    if not p.checkpoint_layers:
        return "every layer" if p.gradient_checkpointing else "none"
    L = model.num_layers
    kept = (
        f"layer {L} keeps its activations"
        if p.checkpoint_layers + 1 == L
        else f"layers {p.checkpoint_layers + 1}-{L} keep their activations"
    )
    why = " (pinned)" if "checkpoint_layers" in options.fixed else ": the fewest checkpointed layers this memory allows"
    return (
        f"the first {p.checkpoint_layers} of {L} decoder layers are checkpointed (their forward runs again in the "
        f"backward), {kept}{why}; without lfa's plugin every layer is checkpointed"
    )


def _master_weights_reason(p: Plan, options: PlanOptions) -> str:
    pinned = " (pinned)" if "master_weights" in options.fixed else ""
    if p.master_weights:
        return (
            f"on{pinned}: {p.precision} weights in the model; fp32 master weights, their fp32 gradients and Adam's "
            "states in the optimizer (lfa's plugin), as DeepSpeed keeps them: no per-micro-batch casts of the weights, "
            "a 16-bit residual stream (speed from the H100 pair of bench/README.md, session 26)"
        )
    if pinned:
        return "off (pinned): fp32 weights under autocast, as LLaMA-Factory trains"
    if not options.master_weights:
        return "off: --no-master-weights (fp32 weights under autocast, as LLaMA-Factory trains)"
    if violated(p.replace(master_weights=True), MASTER_WEIGHTS_RULE):
        return (
            "off: fp32 weights under autocast; master weights run in bf16/fp16 on one process without DeepSpeed, "
            "with AdamW"
        )
    return "off: fp32 weights under autocast; the master-weights plans are predicted slower or do not fit here"


def _sorted_steps_reason(p: Plan) -> str:
    if p.sorted_steps:
        return (
            "on: each optimizer step trains on the same random rows, but its micro-batches are cut from "
            "those rows sorted by length, so less compute goes to padding (lfa plugin, "
            "LFA_SORTED_STEPS=1; the loss is normalized by the step's token count, so the gradient is "
            "the same sum)"
        )
    if p.packing:
        return "off: packed rows have no padding"
    if p.micro_batch_size == 1:
        return "off: one row per micro-batch has no padding"
    return "off: disabled with --no-sorted-steps"


def _throughput_reason(c: Candidate, model: ModelSpec, fitting: list[Candidate]) -> str:
    p = c.plan
    caveat = ""
    if p.on_cpu:
        caveat = " (a rough CPU FLOP rate, not measured)"
    elif not within_checked_sizes(model):
        caveat = (
            f" (only to rank plans: {model.num_params / 1e6:,.1f} M parameters is far below the sizes the speed "
            "model was checked on, 350M-6.7B; such a step is bound by kernel launches)"
        )
    return f"predicted {c.tokens_per_s:,.0f} non-pad tokens/s{caveat}; {len(fitting)} plans fit"


ATTENTION_REASONS = {
    "sdpa": "sdpa: PyTorch's fused attention, no score matrix in memory, no extra package",
    "fa2": "fa2: flash-attn is installed",
    "auto": "auto",
}


def explain(
    c: Candidate,
    model: ModelSpec,
    hardware: HardwareProfile,
    options: PlanOptions,
    fitting: list[Candidate],
    seq_len: int = 2048,
) -> Plan:
    """The plan with a reason per field, as the recipe's comments and `lfa generate` print them."""
    p = c.plan
    natural, precision_reason = pick_precision(hardware)
    if p.precision != natural:
        precision_reason = (
            f"{p.precision}: pinned (--precision or --pin); on its own lfa would pick {natural}: {precision_reason}"
        )
    eager = f"eager: {model.sdpa_problem}" if model.sdpa_problem else "eager: fits and is as fast here"
    reasons = {
        "precision": precision_reason,
        "batch": _batch_reason(c, hardware, options),
        "gradient_checkpointing": (
            "on: without it the activations of this micro-batch do not fit, or a larger micro-batch with it is faster"
            if p.gradient_checkpointing
            else "off: the activations fit, which saves the ~33% recompute"
        ),
        "liger": _liger_reason(p, hardware, options),
        "attention": {**ATTENTION_REASONS, "eager": eager}[p.attention],
        "deepspeed": _sharding_reason(c, hardware),
        "padding_free": padding_free_reason(p, hardware, options, model.padding_free_problem(seq_len)),
        "token_budget": _token_budget_reason(p),
        "recompute": _recompute_reason(p, model, options),
        "packing": (
            "on: allowed by --allow-packing; rows are concatenated to cutoff_len so no compute goes to "
            "padding (changes what a batch is: rows per step grow)"
            if p.packing
            else "off: keeps one row per sample as in the paper (pass --allow-packing to trade that for speed)"
        ),
        "sorted_steps": _sorted_steps_reason(p),
        "master_weights": _master_weights_reason(p, options),
        "allocator": (
            f"PYTORCH_CUDA_ALLOC_CONF={p.alloc_conf}: micro-batches change shape from step to step; "
            "expandable segments let the caching allocator reuse memory instead of fragmenting it and "
            "retrying (synchronizing cudaFree/cudaMalloc) near the limit"
            if p.alloc_conf
            else "default caching allocator"
        ),
        "optimizer": OPTIMIZER_REASONS[p.optimizer],
        "throughput": _throughput_reason(c, model, fitting),
    }
    return p.replace(reasons=reasons)
