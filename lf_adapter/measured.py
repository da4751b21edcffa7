"""Peaks `lfa train` measured, kept per model shape and card in lfa's cache folder, so that the next `lfa generate`
of the same model on the same card plans from the measurement; and the margin a family the memory model was not
checked on is planned with."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .hardware import HardwareProfile
from .memory import DEFAULT_HEADROOM, coefficients, fit_activation_scale
from .model_spec import ModelSpec
from .plan import Plan

STORE_NAME = "measured_memory.json"
CACHE_DIR = "LFA_CACHE_DIR"  # where lfa keeps what it measured (default $XDG_CACHE_HOME/lfa or ~/.cache/lfa)
OVER_PREDICTION = 0.03  # a measured peak this far above the prediction is a warning, stored for the next generate


def cache_dir() -> Path:
    if os.environ.get(CACHE_DIR):
        return Path(os.environ[CACHE_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lfa"


def shape_key(model: ModelSpec) -> str:
    """The model's shape, not its folder: the same architecture at another path trains the same memory."""
    return (
        f"{model.arch} h{model.hidden_size} L{model.num_layers} heads{model.num_heads}/{model.num_kv_heads}"
        f"x{model.head_dim} ffn{model.intermediate_size} vocab{model.vocab_size}"
    )


def card_key(hardware: HardwareProfile) -> str:
    if hardware.has_gpu:
        return f"{hardware.gpu.name} {hardware.gpu.vram_gib:g} GiB"
    return f"cpu {hardware.ram_gib:g} GiB"


@dataclass
class MeasuredPeak:
    shape: str
    card: str
    plan: str  # Plan.label() of the run that measured it
    seq_len: int
    predicted_reserved_gib: float
    measured_reserved_gib: float
    measured_allocated_gib: float
    run: str  # the run folder
    recorded: str  # ISO time

    @property
    def over(self) -> float:
        return self.measured_reserved_gib / self.predicted_reserved_gib - 1.0


def _store_key(shape: str, card: str) -> str:
    return f"{shape} | {card}"


def _read_store() -> dict:
    try:
        data = json.loads((cache_dir() / STORE_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_peak(peak: MeasuredPeak) -> Path | None:
    """Keep the newest measurement per model shape and card (atomic write); None when the cache is not writable."""
    folder = cache_dir()
    store = _read_store()
    store[_store_key(peak.shape, peak.card)] = dataclasses.asdict(peak)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{STORE_NAME}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(store, indent=1))
        tmp.replace(folder / STORE_NAME)
    except OSError:
        return None
    return folder / STORE_NAME


def measured_peak(model: ModelSpec, hardware: HardwareProfile) -> MeasuredPeak | None:
    entry = _read_store().get(_store_key(shape_key(model), card_key(hardware)))
    try:
        return MeasuredPeak(**entry) if isinstance(entry, dict) else None
    except TypeError:
        return None


@dataclass(frozen=True)
class PlanningMargin:
    """What the planner is given beyond the memory model: its headroom and activation scale, and why."""

    headroom: float
    activation_scale: float
    note: str


def planning_margin(model: ModelSpec, hardware: HardwareProfile, use_measured: bool = True) -> PlanningMargin:
    """The headroom: catalog/memory_model.yaml's (validation) for one GPU, memory.py's 12% for several. A measured
    peak of this shape on this card scales the activations up to it; else a family the memory model was not checked
    on gets the extra headroom the catalog names (validation: its figures and why)."""
    validation = coefficients()["validation"]
    base = validation["headroom"] if hardware.world_size == 1 else DEFAULT_HEADROOM
    peak = measured_peak(model, hardware) if use_measured else None
    if peak is not None and peak.over > 0:
        plan = Plan.from_label(peak.plan)
        scale = fit_activation_scale(model, plan, peak.seq_len, peak.measured_allocated_gib)
        return PlanningMargin(
            base,
            scale,
            f"planned from a measured peak: {peak.plan} peaked at {peak.measured_reserved_gib:.2f} GiB reserved "
            f"against {peak.predicted_reserved_gib:.2f} GiB predicted on this card ({100 * peak.over:+.1f}%, run "
            f"{peak.run}, {peak.recorded[:10]}); activations and logits priced x{scale:.2f}",
        )
    families = validation["families"]
    if not hardware.has_gpu or model.arch in families:
        return PlanningMargin(base, 1.0, "")
    margin = validation["unvalidated_margin"]
    headroom = 1.0 - (1.0 - base) / (1.0 + margin)
    return PlanningMargin(
        headroom,
        1.0,
        f"{model.arch} is not among the families the memory model was checked on ({', '.join(families)}): "
        f"planned with {100 * headroom:.0f}% headroom instead of {100 * base:.0f}%, room for a "
        f"{100 * margin:.0f}% under-prediction ({validation['why']})",
    )


def generate_headroom(model: ModelSpec, hardware: HardwareProfile) -> float:
    """The headroom `lfa generate` plans this model on this card with (a measured peak changes the activations'
    scale, not this): what estimate, review and a run's pre-flight judge a recipe against."""
    return planning_margin(model, hardware, use_measured=False).headroom


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")
