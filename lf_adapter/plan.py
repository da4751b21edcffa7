"""The value that travels from the planner to the renderer, the estimator and the supervisor."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .strategy import (
    ATTENTIONS,
    LAUNCHERS,
    OFFLOADS,
    PRECISIONS,
    STRATEGIES,
    Offload,
    OffloadKind,
    Optimizer,
    Strategy,
    normalized_sharding,
)

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
    attention: str = "sdpa"  # strategy.ATTENTIONS
    sharding: str = "none"  # strategy.Sharding: none (one process) | ddp | zero1 | zero2 | zero3 | fsdp2
    offload: str = "none"  # strategy.Offload: none | optimizer | all | nvme-optimizer | nvme-all
    optimizer: str = "adamw"  # strategy.Optimizer: adamw (the paper's) | adamw_8bit | badam (opt-in only)
    packing: bool = False
    padding_free: bool = False  # each micro-batch's rows flattened, attention per row (lfa plugin, LFA_PADDING_FREE)
    sorted_steps: bool = False  # micro-batches sorted by length inside each optimizer step (lfa plugin)
    # token-budget micro-batches (lfa plugin, LFA_TOKEN_BUDGET): each optimizer step's rows are cut into micro-batches
    # of at most this many tokens instead of micro_batch_size rows; 0: fixed micro-batches. micro_batch_size x
    # grad_accum stay the recipe's keys (the fixed plan LLaMA-Factory runs without the plugin, never larger)
    token_budget: int = 0
    # with gradient checkpointing: how many decoder layers are checkpointed, the first k of L (lfa plugin,
    # LFA_CHECKPOINT_LAYERS); None: all of them (LLaMA-Factory's own setting, what runs without the plugin)
    checkpoint_layers: int | None = None
    # 16-bit weights in the model, fp32 master weights and gradients in the optimizer (lfa plugin, LFA_MASTER_WEIGHTS):
    # no autocast casts of the weights per micro-batch, a 16-bit residual stream; False: fp32 weights under autocast
    master_weights: bool = False
    alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF
    launcher: str = "torchrun"  # torchrun (LLaMA-Factory's FORCE_TORCHRUN relaunch) | ray (USE_RAY=1)
    reasons: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        for name, allowed in (("precision", PRECISIONS), ("attention", ATTENTIONS), ("launcher", LAUNCHERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r}: use one of {', '.join(allowed)}")
        object.__setattr__(self, "sharding", normalized_sharding(self.sharding, self.world_size))
        object.__setattr__(self, "offload", Offload.parse(self.offload, "offload"))
        object.__setattr__(self, "optimizer", Optimizer.parse(self.optimizer, "optimizer"))
        if self.token_budget < 0:
            raise ValueError(f"token_budget {self.token_budget}: use 0 (off) or a number of tokens")
        if self.checkpoint_layers is not None and (not self.gradient_checkpointing or self.checkpoint_layers < 1):
            raise ValueError(
                f"checkpoint_layers {self.checkpoint_layers}: needs gradient checkpointing and at least one layer"
            )

    def checkpointed_layers(self, num_layers: int) -> int:
        """Decoder layers whose forward is recomputed in the backward (0 without checkpointing)."""
        if not self.gradient_checkpointing:
            return 0
        return num_layers if self.checkpoint_layers is None else min(self.checkpoint_layers, num_layers)

    @property
    def accumulates(self) -> bool:
        """Several micro-batches per optimizer step (token budgets may cut a step into several)."""
        return self.grad_accum > 1 or self.token_budget > 0

    @property
    def strategy(self) -> Strategy:
        """The sharding strategy's record (strategy.STRATEGIES)."""
        return STRATEGIES[self.sharding]

    @property
    def deepspeed(self) -> str | None:
        """The DeepSpeed stage's name (zero1/zero2/zero3), None when DeepSpeed is not used."""
        return self.sharding if self.strategy.engine == "deepspeed" else None

    @property
    def sixteen_bit_model(self) -> bool:
        """The model's weights are 16-bit (DeepSpeed, FSDP2's mixed precision, BAdam, master weights), not fp32 under
        autocast."""
        return self.strategy.sixteen_bit_model or self.optimizer == Optimizer.BADAM or self.master_weights

    @property
    def deepspeed_stage(self) -> int | None:
        return self.strategy.deepspeed_stage

    @property
    def offload_kind(self) -> OffloadKind:
        return OFFLOADS[self.offload]

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_kind.optimizer

    @property
    def offloads_parameters(self) -> bool:
        return self.offload_kind.parameters

    @property
    def offloads_to_nvme(self) -> bool:
        return self.offload_kind.device == "nvme"

    @property
    def changes_optimizer(self) -> bool:
        """Not the paper's AdamW: what is trained changes (opt-in only)."""
        return self.optimizer != Optimizer.ADAMW

    @property
    def shards_parameters(self) -> bool:
        return "parameters" in self.strategy.shards

    @property
    def shards_gradients(self) -> bool:
        return "gradients" in self.strategy.shards

    @property
    def shards_optimizer(self) -> bool:
        return "optimizer" in self.strategy.shards

    @property
    def distributed(self) -> bool:
        """Started through torchrun / accelerate: several processes, or DeepSpeed / FSDP2 even on one."""
        return self.world_size > 1 or self.strategy.engine != "none"

    @property
    def effective_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def flash_attn(self) -> str:
        """The recipe's flash_attn value for this plan's attention."""
        return LF_FLASH_ATTN[self.attention]

    def replace(self, **changes) -> Plan:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_label(cls, label: str, **fields) -> Plan:
        """Read back label()'s fields: 'bf16/mbs16xga4x1/gc20/sdpa/zero3-offload-all/padfree/tb24576' (bench
        tables)."""
        parts = label.split("/")
        mbs, rest = parts[1][len("mbs") :].split("xga")
        ga, world = rest.split("x")
        stage = next((p for p in parts if p.startswith(("zero", "fsdp"))), "")
        sharding, _, offload = stage.partition("-offload-")
        attention = next((p for p in parts if p in ATTENTIONS), "sdpa")
        optimizer = next((p for p in parts if p in {o.value for o in Optimizer}), "adamw")
        return cls(
            optimizer=optimizer,
            precision=parts[0],
            micro_batch_size=int(mbs),
            grad_accum=int(ga),
            world_size=int(world),
            gradient_checkpointing=parts[2].startswith("gc"),
            checkpoint_layers=int(parts[2][2:]) if parts[2][2:].isdigit() else None,
            token_budget=next((int(p[2:]) for p in parts if p.startswith("tb") and p[2:].isdigit()), 0),
            liger="liger" in parts,
            attention=attention,
            sharding=sharding or "none",
            offload=offload or "none",
            packing="packing" in parts,
            padding_free="padfree" in parts,
            sorted_steps="sorted" in parts,
            master_weights="master" in parts,
            launcher="ray" if "ray" in parts else "torchrun",
            **fields,
        )

    def label(self) -> str:
        parts = [
            self.precision,
            f"mbs{self.micro_batch_size}xga{self.grad_accum}x{self.world_size}",
            ("gc" if self.checkpoint_layers is None else f"gc{self.checkpoint_layers}")
            if self.gradient_checkpointing
            else "nogc",
        ]
        if self.liger:
            parts.append("liger")
        parts.append(self.attention)
        if self.strategy.engine != "none":
            parts.append(self.sharding + ("" if self.offload == Offload.NONE else f"-offload-{self.offload}"))
        if self.changes_optimizer:
            parts.append(self.optimizer)
        if self.packing:
            parts.append("packing")
        if self.master_weights:
            parts.append("master")
        if self.padding_free:
            parts.append("padfree")
        if self.sorted_steps:
            parts.append("sorted")
        if self.token_budget:
            parts.append(f"tb{self.token_budget}")
        if self.launcher == "ray":
            parts.append("ray")
        return "/".join(parts)


# the plan fields `lfa generate --pin FIELD=VALUE` fixes, their type, and what the help says of their values
PINNABLE: dict[str, tuple[type, str]] = {
    "micro_batch_size": (int, ""),
    "gradient_checkpointing": (bool, ""),
    "liger": (bool, ""),
    "attention": (str, "|".join(ATTENTIONS)),
    "deepspeed": (
        str,
        "|".join(n for n, s in STRATEGIES.items() if s.engine == "deepspeed" and s.proposed != "never") + "|none",
    ),
    "sharding": (str, "|".join(STRATEGIES)),
    "offload": (str, "|".join(OFFLOADS)),
    "optimizer": (str, "|".join(o.value for o in Optimizer) + ": all but adamw change what is trained"),
    "alloc_conf": (str, "PYTORCH_CUDA_ALLOC_CONF, none: the default allocator"),
    "padding_free": (bool, ""),
    "token_budget": (int, "tokens per micro-batch, 0: fixed micro-batches"),
    "checkpoint_layers": (int, "the first k decoder layers recompute, the rest keep their activations"),
    "master_weights": (bool, "16-bit weights in the model, fp32 masters in the optimizer; one GPU"),
}


def pin_help() -> str:
    fields = ", ".join(f"{name} ({note})" if note else name for name, (_, note) in PINNABLE.items())
    return f"Fix a plan field the planner would choose: {fields}."
