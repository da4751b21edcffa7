"""Which of the plugin's kernel choices a run used. The memory and throughput models price this plugin's choices;
a measurement made before a choice existed ran without it, so bench rows record theirs ("kernels") and are repriced
inside measured_with(of_row(row)). No torch."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, fields

from . import contract


@dataclass(frozen=True)
class KernelChoices:
    loss_chunk_min_rows: int = 2048  # liger's fused loss in chunks of at least this many rows (0: liger's own)
    fused_gate_up: bool = True  # liger's Phi-3 MLP through its fused gate-up SwiGLU (plugin/fused_mlp.py)
    attention_row_view: bool = True  # lfa's varlen attention squeezes its one row: its gradients stay views
    padded_width_aligned: bool = True  # padded token-budget micro-batches as wide as a multiple of 8 (token_budget)
    fused_weight_gradients: bool = True  # master weights: linear layers' weight-gradient GEMMs add into the fp32 ones


# what runs used before each choice existed: liger's own chunks and its chunked Phi-3 MLP (before session 28), the
# attention's row taken by indexing (before session 30), padded micro-batches at their longest row (before session 36),
# master weights' gradients added by a hook (before session 40)
BEFORE = KernelChoices(
    loss_chunk_min_rows=0,
    fused_gate_up=False,
    attention_row_view=False,
    padded_width_aligned=False,
    fused_weight_gradients=False,
)
ROW_KEY = "kernels"
_priced = [KernelChoices()]


def priced() -> KernelChoices:
    return _priced[-1]


def of_row(row: dict) -> KernelChoices:
    """A bench row's choices; a row without the record ran before they existed."""
    recorded = row.get(ROW_KEY) or {}
    return KernelChoices(**{f.name: recorded.get(f.name, getattr(BEFORE, f.name)) for f in fields(KernelChoices)})


def carried(row: dict) -> dict:
    """The row's record, to copy into a row derived from it (nothing for a row from before the record)."""
    return {ROW_KEY: row[ROW_KEY]} if ROW_KEY in row else {}


# each choice's environment variable (contract's knobs)
KNOB = {
    "loss_chunk_min_rows": contract.LOSS_CHUNK_ROWS,
    "fused_gate_up": contract.FUSED_GATE_UP,
    "attention_row_view": contract.ATTENTION_ROW_VIEW,
    "padded_width_aligned": contract.PADDED_WIDTH_ALIGNED,
    "fused_weight_gradients": contract.FUSED_WEIGHT_GRADIENTS,
}


def from_env(env) -> KernelChoices:
    """The choices a process with this environment runs."""
    from .loss_chunks import min_rows_from_env

    return KernelChoices(
        loss_chunk_min_rows=min_rows_from_env(env.get(KNOB["loss_chunk_min_rows"])),
        fused_gate_up=env.get(KNOB["fused_gate_up"]) != "0",
        attention_row_view=env.get(KNOB["attention_row_view"]) != "0",
        padded_width_aligned=env.get(KNOB["padded_width_aligned"]) != "0",
        fused_weight_gradients=env.get(KNOB["fused_weight_gradients"]) != "0",
    )


def record(env) -> dict:
    return asdict(from_env(env))


def compile_backend(env) -> str | None:
    """LFA_COMPILE_LAYERS: "1" (inductor) or a dynamo backend's name; unset, empty or "0": no compile."""
    value = env.get(contract.COMPILE_LAYERS, "").strip()
    return value if value not in ("", "0") else None


def unpriced(env) -> list[str]:
    """The settings in env under which a run's memory is not what its plan was priced for: kernel choices other than
    the priced ones, and torch.compile of the layers (a bench experiment, never priced)."""
    ran, planned = from_env(env), priced()
    found = [
        f"{KNOB[f.name]}={env.get(KNOB[f.name])}"
        for f in fields(KernelChoices)
        if getattr(ran, f.name) != getattr(planned, f.name)
    ]
    backend = compile_backend(env)
    return found + ([f"{contract.COMPILE_LAYERS}={backend}"] if backend else [])


@contextlib.contextmanager
def measured_with(choices: KernelChoices):
    """Price as a measured run ran."""
    _priced.append(choices)
    try:
        yield
    finally:
        _priced.pop()
