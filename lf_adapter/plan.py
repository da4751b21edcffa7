"""The value that travels from the planner to the renderer, the estimator and the supervisor."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


# lfa's attention names -> LLaMA-Factory's flash_attn values (AttentionFunction: auto, disabled, sdpa, fa2, fa3);
# transformers' "eager" is LLaMA-Factory's "disabled"
LF_FLASH_ATTN = {"auto": "auto", "sdpa": "sdpa", "fa2": "fa2", "fa3": "fa3", "eager": "disabled"}
ATTENTION_FROM_LF = {lf: ours for ours, lf in LF_FLASH_ATTN.items()}


@dataclass(frozen=True)
class Plan:
    precision: str  # bf16 | fp16 | fp32
    micro_batch_size: int
    grad_accum: int
    world_size: int = 1
    nodes: int = 1
    on_cpu: bool = False
    gradient_checkpointing: bool = True
    liger: bool = False
    attention: str = "sdpa"  # sdpa | fa2 | eager | auto
    deepspeed: str | None = None  # None | zero2 | zero3
    offload: str = "none"  # none | optimizer | all
    packing: bool = False
    sorted_steps: bool = False  # micro-batches sorted by length inside each optimizer step (lfa plugin)
    alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF
    launcher: str = "torchrun"  # torchrun (LLaMA-Factory's FORCE_TORCHRUN relaunch) | ray (USE_RAY=1)
    reasons: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def effective_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def flash_attn(self) -> str:
        """The recipe's flash_attn value for this plan's attention."""
        return LF_FLASH_ATTN[self.attention]

    def replace(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_label(cls, label: str, **fields) -> "Plan":
        """Read back label()'s fields: 'bf16/mbs16xga4x1/nogc/sdpa/zero3-offload-all/sorted' (bench tables)."""
        parts = label.split("/")
        mbs, rest = parts[1][len("mbs"):].split("xga")
        ga, world = rest.split("x")
        stage = next((p for p in parts if p.startswith("zero")), "")
        deepspeed, _, offload = stage.partition("-offload-")
        attention = next((p for p in parts if p in ("sdpa", "fa2", "eager", "auto")), "sdpa")
        return cls(precision=parts[0], micro_batch_size=int(mbs), grad_accum=int(ga), world_size=int(world),
                   gradient_checkpointing=parts[2] == "gc", liger="liger" in parts, attention=attention,
                   deepspeed=deepspeed or None, offload=offload or "none", packing="packing" in parts,
                   sorted_steps="sorted" in parts, launcher="ray" if "ray" in parts else "torchrun", **fields)

    def label(self) -> str:
        parts = [self.precision, f"mbs{self.micro_batch_size}xga{self.grad_accum}x{self.world_size}",
                 "gc" if self.gradient_checkpointing else "nogc"]
        if self.liger:
            parts.append("liger")
        parts.append(self.attention)
        if self.deepspeed:
            parts.append(self.deepspeed + ("" if self.offload == "none" else f"-offload-{self.offload}"))
        if self.packing:
            parts.append("packing")
        if self.sorted_steps:
            parts.append("sorted")
        if self.launcher == "ray":
            parts.append("ray")
        return "/".join(parts)
