"""The strategy axis: how model states are spread over GPUs (sharding) and moved to the host (offload), as typed
vocabularies, what each strategy shards, and one table of the combinations that do not work."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .plan import Plan


class _Vocabulary(str, enum.Enum):
    """A closed set of names; members compare and hash equal to their string (Python 3.10 has no StrEnum)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str, what: str) -> str:
        """The value as a plain string, or a ValueError naming the allowed ones."""
        try:
            return cls(str(value)).value
        except ValueError:
            raise ValueError(f"{what} {value!r}: use one of {', '.join(m.value for m in cls)}") from None


class Sharding(_Vocabulary):
    NONE = "none"  # one process
    DDP = "ddp"  # several processes, each with all model states (LLaMA-Factory's torchrun relaunch)
    ZERO1 = "zero1"  # DeepSpeed: optimizer states sharded
    ZERO2 = "zero2"  # + gradients sharded
    ZERO3 = "zero3"  # + parameters sharded (gathered per module)
    FSDP2 = "fsdp2"  # PyTorch FSDP2 (fully_shard) through accelerate: parameters, gradients, optimizer sharded


class Offload(_Vocabulary):
    NONE = "none"
    OPTIMIZER = "optimizer"  # DeepSpeed ZeRO-Offload: fp32 master + Adam on the host, CPU Adam
    ALL = "all"  # + parameters (ZeRO-3 only)
    NVME_OPTIMIZER = "nvme-optimizer"  # ZeRO-Infinity: fp32 master, Adam and fp32 grads on a local disk (ZeRO-3)
    NVME_ALL = "nvme-all"  # + 16-bit parameters on the disk (ZeRO-3)


OffloadDevice = Literal["gpu", "cpu", "nvme"]


@dataclass(frozen=True)
class OffloadKind:
    """Where one Offload value puts the model states: the DeepSpeed device and what moves there."""

    device: OffloadDevice  # "gpu": nothing leaves the GPU
    optimizer: bool  # fp32 master weights + Adam moments (+ fp32 gradients) leave the GPU; CPU Adam steps them
    parameters: bool  # the 16-bit parameters leave the GPU between uses (ZeRO-3 gathers them per module)


OFFLOADS: dict[str, OffloadKind] = {
    Offload.NONE: OffloadKind("gpu", optimizer=False, parameters=False),
    Offload.OPTIMIZER: OffloadKind("cpu", optimizer=True, parameters=False),
    Offload.ALL: OffloadKind("cpu", optimizer=True, parameters=True),
    Offload.NVME_OPTIMIZER: OffloadKind("nvme", optimizer=True, parameters=False),
    Offload.NVME_ALL: OffloadKind("nvme", optimizer=True, parameters=True),
}


class Optimizer(_Vocabulary):
    """What updates the weights. Only ADAMW is the paper's; the others change what is trained (opt-in)."""

    ADAMW = "adamw"  # torch AdamW (DeepSpeed's CPU Adam under offload): fp32 moments
    ADAMW_8BIT = "adamw_8bit"  # bitsandbytes AdamW with 8-bit block-wise quantized moments (optim: adamw_bnb_8bit)
    BADAM = "badam"  # BAdam: block coordinate descent, Adam states for one decoder layer at a time (use_badam)


class Precision(_Vocabulary):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


class Launcher(_Vocabulary):
    TORCHRUN = "torchrun"  # LLaMA-Factory's FORCE_TORCHRUN relaunch (or one plain process)
    RAY = "ray"  # USE_RAY=1: Ray workers


Attention = Literal["sdpa", "fa2", "fa3", "eager", "auto"]
PRECISIONS: tuple[str, ...] = tuple(m.value for m in Precision)
ATTENTIONS: tuple[str, ...] = ("sdpa", "fa2", "fa3", "eager", "auto")
LAUNCHERS: tuple[str, ...] = tuple(m.value for m in Launcher)

ShardedState = Literal["optimizer", "gradients", "parameters"]
Engine = Literal["none", "deepspeed", "fsdp2"]  # what owns the model states (memory.py prices each engine's)
StartedBy = Literal["llamafactory-cli", "torchrun", "accelerate"]
HostLoad = Literal["every rank", "rank 0", "partitioned"]  # who reads the checkpoint into host RAM
Proposed = Literal["always", "pinned", "never"]  # whether the planner prices it unasked


@dataclass(frozen=True)
class Strategy:
    """What one sharding strategy is: the one place behaviour reads it from (never `== Sharding.X`)."""

    sharding: Sharding
    engine: Engine
    shards: frozenset[str]  # ShardedState: what is divided by the number of processes
    started_by: StartedBy  # on one process; several processes are always a launcher's
    config_template: str | None  # templates/ file the recipe folder gets (None: train.yaml alone)
    header_key: str | None  # lfa-meta key recording it where train.yaml has no key for it
    deepspeed_stage: int | None = None
    sixteen_bit_model: bool = False  # the engine holds 16-bit weights (fp32 master in its optimizer): no autocast
    host_load: HostLoad = "every rank"
    offloads: frozenset[str] = frozenset({"none"})  # Offload values it runs
    # the offloads the planner prices on one process (plus none when the strategy is pinned): on one GPU ZeRO shards
    # nothing and adds its own flat buffers (a pinned mbs2 6.7B plan predicted 116 GiB died allocating a 25 GiB fp32
    # copy), so only its offloads are worth it
    one_process_offloads: frozenset[str] = frozenset({"none"})
    # the name its rendered config gets beside the recipe where the name is fixed (DeepSpeed's names its stage and
    # offload: recipe.keys.deepspeed_file_name)
    config_file: str | None = None
    # ZeRO-3's hooks gather a module's parameters only inside that module's forward (liger's fused loss reads
    # lm_head.weight outside it)
    gathers_per_module: bool = False
    # its optimizer has no .defaults, where transformers reads an absolute min_lr (ZeRO-3): min_lr_rate only
    min_lr_as_rate: bool = False
    min_processes: int = 1
    proposed: Proposed = "always"
    not_proposed_why: str = ""  # a pin of a "never" strategy is refused with this
    speed_caveat: str = ""  # where its speed is priced by another strategy's terms

    @property
    def token_budget(self) -> bool:
        """lfa's plugin cuts steps into token-budget micro-batches only where no engine owns accumulation."""
        return self.engine == "none"

    @property
    def holds_all_states_at_step(self) -> bool:
        """torch's AdamW steps over every state at once (the engines step partitions)."""
        return self.engine == "none"


_ZERO_OFFLOADS = frozenset({"none", "optimizer"})
_ZERO3_OFFLOADS = frozenset({"none", "optimizer", "all", "nvme-optimizer", "nvme-all"})
STRATEGIES: dict[str, Strategy] = {
    s.sharding.value: s
    for s in (
        Strategy(Sharding.NONE, "none", frozenset(), "llamafactory-cli", None, None),
        Strategy(Sharding.DDP, "none", frozenset(), "torchrun", None, None),
        Strategy(
            Sharding.ZERO1, "deepspeed", frozenset({"optimizer"}), "torchrun", "deepspeed/zero.json.j2", None,
            deepspeed_stage=1, sixteen_bit_model=True, offloads=_ZERO_OFFLOADS, proposed="never",
            not_proposed_why="lfa does not plan ZeRO-1: on one GPU it shards nothing, and on several ZeRO-2 shards "
            "the optimizer states as ZeRO-1 does and the gradients too, for the same communication volume; pin "
            "sharding=zero2",
        ),
        Strategy(
            Sharding.ZERO2, "deepspeed", frozenset({"optimizer", "gradients"}), "torchrun", "deepspeed/zero.json.j2",
            None, deepspeed_stage=2, sixteen_bit_model=True, offloads=_ZERO_OFFLOADS,
            one_process_offloads=frozenset({"optimizer"}),
        ),
        Strategy(
            Sharding.ZERO3, "deepspeed", frozenset({"optimizer", "gradients", "parameters"}), "torchrun",
            "deepspeed/zero.json.j2", None, deepspeed_stage=3, sixteen_bit_model=True, host_load="partitioned",
            offloads=_ZERO3_OFFLOADS, gathers_per_module=True, min_lr_as_rate=True,
            one_process_offloads=frozenset({"all", "nvme-optimizer", "nvme-all"}),
        ),
        Strategy(
            Sharding.FSDP2, "fsdp2", frozenset({"optimizer", "gradients", "parameters"}), "accelerate",
            "launch/accelerate_fsdp2.yaml.j2", "sharding", sixteen_bit_model=True, host_load="rank 0",
            config_file="accelerate_fsdp2.yaml",
            min_processes=2, proposed="pinned",
            speed_caveat="FSDP2 priced as ZeRO-3 (its own speed is not measured yet)",
        ),
    )
}  # fmt: skip

SHARDING_OF_STAGE = {s.deepspeed_stage: name for name, s in STRATEGIES.items() if s.deepspeed_stage}


def normalized_sharding(value: str | None, world_size: int) -> str:
    """'none' and 'ddp' name the same thing (no sharding) for one and for several processes."""
    sharding = Sharding.parse(value or "none", "sharding")
    if sharding in (Sharding.NONE, Sharding.DDP):
        return (Sharding.DDP if world_size > 1 else Sharding.NONE).value
    return sharding


# strategies lfa reads in recipes but never plans, and why: a pin of one is refused with this
NOT_PLANNED = {name: s.not_proposed_why for name, s in STRATEGIES.items() if s.proposed == "never"}


@dataclass(frozen=True)
class Constraint:
    rule: str  # also the review finding's rule id
    violated: Callable[[Plan], bool]
    why: str
    fix: str
    key: str  # the recipe key a review finding points at


MASTER_WEIGHTS_RULE = "master_weights_on_one_process"

CONSTRAINTS: tuple[Constraint, ...] = (
    Constraint(
        "liger_with_zero3",
        lambda p: p.liger and p.strategy.gathers_per_module,
        "enable_liger_kernel with ZeRO-3: liger's fused cross-entropy reads lm_head.weight directly, which "
        "ZeRO-3 leaves sharded (size mismatch on the first step; huggingface/trl#3368, #5891)",
        "turn liger off or use ZeRO-2",
        "enable_liger_kernel",
    ),
    Constraint(
        "offload_needs_deepspeed",
        lambda p: p.offload != Offload.NONE and p.strategy.engine != "deepspeed",
        "offload is DeepSpeed's ZeRO-Offload (CPU Adam); lfa plans no FSDP2 CPU offload",
        "use ZeRO-2 (optimizer) or ZeRO-3 (all) for offload",
        "deepspeed",
    ),
    Constraint(
        "parameter_offload_needs_zero3",
        lambda p: OFFLOADS[p.offload].parameters and p.offload not in p.strategy.offloads,
        "parameters can only be offloaded when ZeRO-3 partitions them",
        "use ZeRO-3 or offload the optimizer only",
        "deepspeed",
    ),
    Constraint(
        "nvme_offload_needs_zero3",
        lambda p: OFFLOADS[p.offload].device == "nvme" and p.offload not in p.strategy.offloads,
        "DeepSpeed swaps optimizer states to NVMe only in ZeRO-3 (stage_1_and_2.py has no swapper; 0.19.8)",
        "use ZeRO-3 for NVMe offload",
        "deepspeed",
    ),
    Constraint(
        "optimizer_change_with_deepspeed",
        lambda p: p.optimizer != Optimizer.ADAMW and p.distributed,
        "lfa prices 8-bit AdamW and BAdam on one process only (BAdam does not run under DeepSpeed or FSDP; "
        "8-bit AdamW's states would be sharded differently)",
        "use AdamW, or one GPU without DeepSpeed",
        "optim",
    ),
    Constraint(
        "badam_needs_bf16",
        lambda p: p.optimizer == Optimizer.BADAM and p.precision != "bf16",
        "BAdam trains the checkpoint's 16-bit weights directly, and fp16 mixed precision's loss scaler cannot "
        "unscale 16-bit gradients (measured on the H200, the 6.7B's bf16 checkpoint: NotImplementedError "
        "'_amp_foreach_non_finite_check_and_unscale_cuda' not implemented for 'BFloat16'; an fp16 checkpoint "
        "meets torch's 'Attempting to unscale FP16 gradients')",
        "use a GPU with native bf16 (sm80+), or 8-bit AdamW, or the exact NVMe offload plan",
        "use_badam",
    ),
    Constraint(
        MASTER_WEIGHTS_RULE,
        lambda p: p.master_weights and (p.precision == "fp32" or p.distributed or p.optimizer != Optimizer.ADAMW),
        "master weights (a 16-bit model, fp32 masters in lfa's plugin) run in bf16 or fp16 on one process without "
        "DeepSpeed, with AdamW: DeepSpeed keeps its own masters, DDP reduces the model's own gradients",
        "drop the master_weights pin, or train in 16 bits on one GPU",
        "bf16",
    ),
    Constraint(
        "padding_free_with_packing",
        lambda p: p.padding_free and p.packing,
        "packing already leaves no padding (and mixes rows); padding-free keeps rows apart without it",
        "use one of them",
        "packing",
    ),
    Constraint(
        "fsdp2_on_one_process",
        lambda p: p.world_size < p.strategy.min_processes,
        "FSDP2 on one process has nothing to shard it over",
        "use it with several GPUs, or no sharding",
        "deepspeed",
    ),
    Constraint(
        "fsdp2_with_ray",
        lambda p: p.strategy.started_by == "accelerate" and p.launcher == Launcher.RAY,
        "LLaMA-Factory starts FSDP2 through `accelerate launch`, not through its Ray workers",
        "use the torchrun launcher",
        "deepspeed",
    ),
)


def violations(plan: Plan) -> list[Constraint]:
    return [c for c in CONSTRAINTS if c.violated(plan)]


def violated(plan: Plan, rule: str) -> bool:
    return any(c.rule == rule for c in violations(plan))
