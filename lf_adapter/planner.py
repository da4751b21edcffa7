"""Stage 5: search the plan space and pick the fastest plan that fits, with reasons and runners-up."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from . import UserError
from .data import ASSUMED_MEAN_SEQ_FRACTION
from .hardware import HardwareProfile
from .measured import generate_headroom
from .memory import (
    DEFAULT_HEADROOM,
    HostMemory,
    MemoryBreakdown,
    disk_gib,
    disk_limit_gib,
    estimate,
    host_memory,
)
from .model_spec import ModelSpec
from .plan import Plan
from .strategy import (
    MASTER_WEIGHTS_RULE,
    NOT_PLANNED,
    OFFLOADS,
    STRATEGIES,
    Offload,
    Optimizer,
    Sharding,
    normalized_sharding,
    violated,
    violations,
)
from .throughput import predict_tokens_per_s

EXPANDABLE_SEGMENTS = "expandable_segments:True"


@dataclass(frozen=True)
class PlanOptions:
    allow_packing: bool = False
    allow_deepspeed: bool = True
    alloc_conf: str | None = EXPANDABLE_SEGMENTS  # PYTORCH_CUDA_ALLOC_CONF for GPU plans
    launcher: str = "torchrun"  # or "ray" (LLaMA-Factory's USE_RAY=1)
    liger_available: bool = True  # liger-kernel needs a CUDA GPU with Triton
    flash_attn_available: bool = False
    headroom: float = DEFAULT_HEADROOM
    sort_steps: bool = True  # length-sorted micro-batches inside each step (no change to what a step trains on)
    padding_free: bool = True  # rows flattened where the exact varlen kernel exists (sm80+); --no-padding-free
    token_budget: bool = True  # micro-batches cut by a token budget (GPU plans without DeepSpeed); --no-token-budget
    master_weights: bool = True  # 16-bit model, fp32 masters (GPU plans on one process); --no-master-weights
    # mean non-pad length / cutoff_len, when the dataset was not profiled
    mean_seq_fraction: float = ASSUMED_MEAN_SEQ_FRACTION
    length_quantiles: tuple[float, ...] = ()  # the profiled data's row lengths (data.length_quantiles)
    fixed: dict = field(default_factory=dict)  # plan fields the user pinned, e.g. {"precision": "fp16"}
    # recovery after an OOM (remedies.replan_after_oom): what the log showed
    activation_scale: float = 1.0  # > 1: activations measured larger than modelled
    vram_gib: float | None = None  # usable GPU memory (default: the profile's)
    ram_gib: float | None = None  # host RAM of a node (default: the profile's)
    below_reserved_gib: float | None = None  # only plans predicted to need less than the one that failed
    allow_optimizer_change: bool = False  # memory-light optimizers (8-bit AdamW, BAdam) may be chosen


def allowed_optimizers(options: PlanOptions) -> tuple[str, ...]:
    if options.fixed.get("optimizer"):
        return (options.fixed["optimizer"],)
    return tuple(o.value for o in Optimizer) if options.allow_optimizer_change else (Optimizer.ADAMW.value,)


@dataclass
class Candidate:
    plan: Plan
    memory: MemoryBreakdown
    tokens_per_s: float  # predicted non-pad tokens per second, whole job
    host: HostMemory = field(default_factory=HostMemory)
    disk_gib: float = 0.0  # what NVMe offload swaps to the node's disk
    disk_free_gib: float | None = None  # the profile's disk (None: no disk declared)

    @property
    def disk_fits(self) -> bool:
        if self.disk_gib <= 0:
            return True
        return self.disk_free_gib is not None and self.disk_gib <= disk_limit_gib(self.disk_free_gib)

    @property
    def fits(self) -> bool:
        return self.memory.fits and self.host.fits and self.disk_fits

    def step_s(self, seq_len: int, mean_seq_fraction: float) -> float:
        """Predicted seconds per optimizer step (the effective batch of rows)."""
        tokens = self.plan.effective_batch_size * seq_len * (1.0 if self.plan.packing else mean_seq_fraction)
        return tokens / self.tokens_per_s


class NoPlanFits(UserError):
    """No allowed plan fits GPU, host and disk together; the message says what would. `priced` holds every plan
    that was priced (opt-in optimizers included) for the report of what runs on this machine."""

    def __init__(self, message: str, priced: list[Candidate] | None = None):
        super().__init__(message)
        self.priced = priced or []


@dataclass
class PlanResult:
    chosen: Candidate
    runners_up: list[Candidate]
    rejected: list[Candidate]
    priced: list[Candidate] = field(default_factory=list)  # every plan priced, opt-in optimizers included


def pick_precision(hardware: HardwareProfile) -> tuple[str, str]:
    if not hardware.has_gpu:
        return "fp32", "no GPU: the CPU trains in fp32 (16-bit autocast on CPU is slow and lossy)"
    gpu = hardware.gpu
    if gpu.bf16:
        return (
            "bf16",
            f"{gpu.name} is sm{gpu.cc[0]}{gpu.cc[1]} (>= 8.0): native bf16, the paper's precision, no loss scaling",
        )
    return "fp16", (
        f"{gpu.name} is sm{gpu.cc[0]}{gpu.cc[1]} (< 8.0): no native bf16 (transformers' check passes only "
        "through slow emulation), so fp16 mixed precision with dynamic loss scaling"
    )


def _divisors_pow2(effective_batch: int, world: int) -> list[int]:
    per_gpu = effective_batch // world
    return [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= per_gpu and per_gpu % m == 0]


# token budgets priced, in rows of cutoff_len: between the powers of two as well, so the budget can follow memory
BUDGET_ROWS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def padding_free_exact_here(hardware: HardwareProfile) -> bool:
    """Padding-free runs on torch's varlen flash attention, which needs sm80+; elsewhere the plugin would fall back
    to one attention call per row (exact, slow), so lfa plans padded there."""
    return hardware.has_gpu and hardware.gpu.cc >= (8, 0)


BUDGET_UNDER_ENGINE = (
    "token_budget under DeepSpeed or FSDP: their engines own gradient accumulation, so lfa's plugin trains the "
    "recipe's fixed micro-batches and ignores the budget; drop the budget or the sharding pin"
)


def blocking_rules(ruled_out: list[frozenset[str]]) -> list[str]:
    """The constraints every ruled-out plan broke (the pin's own conflict), else every one that was broken."""
    if not ruled_out:
        return []
    return sorted(frozenset.intersection(*ruled_out) or frozenset.union(*ruled_out))


def micro_batch_shapes(effective_batch: int, world: int, seq_len: int, budgets: bool, pinned_budget: int | None):
    """(micro_batch_size, token_budget) pairs to price: fixed micro-batches of every power-of-two size, and token
    budgets of BUDGET_ROWS x cutoff_len; a budget's micro_batch_size is the largest fixed size within it (what
    runs without lfa's plugin: never more memory)."""
    sizes = _divisors_pow2(effective_batch, world)
    per_gpu = effective_batch // world
    shapes = [(m, 0) for m in sizes]
    tokens = [pinned_budget] if pinned_budget else [int(r * seq_len) for r in BUDGET_ROWS if r <= per_gpu]
    if budgets or pinned_budget:
        for budget in tokens:
            within = [m for m in sizes if m * seq_len <= budget] or [1]
            shapes.append((max(within), budget))
    return shapes


def _refuse_impossible_pins(
    model: ModelSpec, hardware: HardwareProfile, effective_batch: int, options: PlanOptions
) -> None:
    """Pins no plan can honour, and a batch the GPUs cannot split, stop with the reason."""
    world = hardware.world_size
    pinned_sharding = options.fixed.get("sharding")
    if pinned_sharding in NOT_PLANNED:
        raise UserError(f"--pin sharding={pinned_sharding}: {NOT_PLANNED[pinned_sharding]}")
    if not hardware.has_gpu:  # FSDP2 runs on CPUs (accelerate makes it DDP there): tests/test_distributed.py
        engines = {f: options.fixed[f] for f in ("sharding", "deepspeed") if options.fixed.get(f) in STRATEGIES}
        for pin_field, value in engines.items():
            if STRATEGIES[value].engine == "deepspeed":
                raise UserError(
                    f"--pin {pin_field}={value}: DeepSpeed needs CUDA GPUs and {hardware.name} has none (on the CPU "
                    "lfa trains in fp32 without it)"
                )
        if options.fixed.get("offload", Offload.NONE.value) != Offload.NONE.value:
            raise UserError(
                f"--pin offload={options.fixed['offload']}: offload is DeepSpeed's, which needs CUDA GPUs, and "
                f"{hardware.name} has none"
            )
    if options.fixed.get("checkpoint_layers", 0) > model.num_layers:
        raise UserError(
            f"--pin checkpoint_layers={options.fixed['checkpoint_layers']}: {model.name} has {model.num_layers} "
            "decoder layers"
        )
    if effective_batch % world:
        raise UserError(
            f"effective batch {effective_batch} is not divisible by {world} GPUs: the task's batch "
            "cannot be kept exactly; pass --gpus to use fewer GPUs"
        )


def _engines(hardware: HardwareProfile, options: PlanOptions) -> list[tuple[str | None, str]]:
    """(DeepSpeed stage or FSDP2 or None, offload) pairs worth pricing on this hardware, from the strategy records:
    the engines the planner proposes, with the offloads each runs (on one process: the ones worth it there, and
    none when a strategy is pinned); NVMe offload where the profile has an SSD."""
    none = Offload.NONE.value
    pinned = options.fixed.get("sharding") or options.fixed.get("deepspeed")
    if pinned in STRATEGIES and STRATEGIES[pinned].proposed == "pinned":  # FSDP2: its speed is not measured yet
        return [(pinned, none)]
    if not hardware.has_gpu or not options.allow_deepspeed:
        return [(None, none)]
    ssd = hardware.disk is not None and not hardware.disk.rotational
    pairs: list[tuple[str | None, str]] = [(None, none)]
    for name, strategy in STRATEGIES.items():
        if strategy.engine == "none" or strategy.proposed != "always":
            continue
        offloads = (
            strategy.offloads
            if hardware.world_size > 1
            else strategy.one_process_offloads | ({none} if pinned else set())
        )
        pairs += [
            (name, offload)
            for offload in OFFLOADS  # the vocabulary's order
            if offload in offloads and (OFFLOADS[offload].device != "nvme" or ssd)
        ]
    return pairs


def _kernel_choices(
    model: ModelSpec, hardware: HardwareProfile, options: PlanOptions, seq_len: int
) -> tuple[list[bool], list[str], list[bool]]:
    """The liger, attention and padding-free values worth pricing for this model here (a pin that cannot hold
    stops with the reason)."""
    on_cpu = not hardware.has_gpu
    liger = [False] if on_cpu or not options.liger_available or not hardware.gpu.runs_triton else [True, False]
    attention = (
        ["sdpa"] if on_cpu else (["fa2", "sdpa", "eager"] if options.flash_attn_available else ["sdpa", "eager"])
    )
    if model.sdpa_problem:
        if options.fixed.get("attention") == "sdpa":
            raise UserError(f"--pin attention=sdpa: {model.sdpa_problem}")
        attention = [a for a in attention if a != "sdpa"] or ["eager"]
    family_problem = model.padding_free_problem(seq_len)
    if family_problem and options.fixed.get("padding_free"):
        raise UserError(f"--pin padding_free=true: {family_problem}")
    padding_free = (
        [bool(options.fixed["padding_free"])]
        if "padding_free" in options.fixed
        else [True, False]
        if options.padding_free and padding_free_exact_here(hardware) and not family_problem
        else [False]
    )
    return liger, attention, padding_free


def candidate_plans(
    model: ModelSpec,
    hardware: HardwareProfile,
    effective_batch: int,
    options: PlanOptions,
    forbidden: list[frozenset[str]] | None = None,
    seq_len: int = 2048,
):
    """Every plan worth pricing that matches the pinned fields; each plan matching the pins that constraints ruled
    out adds the set of their whys to `forbidden`, for the message when nothing is left."""
    precision = options.fixed.get("precision") or pick_precision(hardware)[0]
    world = hardware.world_size
    _refuse_impossible_pins(model, hardware, effective_batch, options)
    on_cpu = not hardware.has_gpu
    packing = [True, False] if options.allow_packing else [False]
    liger, attention, padding_free = _kernel_choices(model, hardware, options, seq_len)
    ds = _engines(hardware, options)
    # every optimizer is priced (the report shows what an opt-in would give); plan() chooses among the allowed
    optimizers = [options.fixed["optimizer"]] if options.fixed.get("optimizer") else [o.value for o in Optimizer]
    fixed = {
        **options.fixed,
        **({"sharding": normalized_sharding(options.fixed["sharding"], world)} if "sharding" in options.fixed else {}),
    }
    pinned_budget = options.fixed.get("token_budget")
    shapes = micro_batch_shapes(
        effective_batch, world, seq_len, options.token_budget and not on_cpu, int(pinned_budget or 0) or None
    )
    masters = (
        [bool(options.fixed["master_weights"])]
        if "master_weights" in options.fixed
        else [True, False]
        if options.master_weights and not on_cpu
        else [False]
    )
    for (mbs, budget), gc, lg, attn, (stage, offload), pack, pf, optimizer, master in itertools.product(
        shapes, [False, True], liger, attention, ds, packing, padding_free, optimizers, masters
    ):
        if budget and not STRATEGIES[stage or Sharding.NONE.value].token_budget:  # an engine owns accumulation
            if pinned_budget and forbidden is not None:
                forbidden.append(frozenset({BUDGET_UNDER_ENGINE}))
            continue
        if budget and (pack or optimizer == Optimizer.BADAM) and not pinned_budget:
            continue  # packed rows fill cutoff_len already; BAdam switches per step
        plan = Plan(
            precision=precision,
            micro_batch_size=mbs,
            token_budget=budget,
            checkpoint_layers=options.fixed.get("checkpoint_layers") if gc else None,
            grad_accum=effective_batch // (mbs * world),
            world_size=world,
            nodes=hardware.nodes,
            on_cpu=on_cpu,
            gradient_checkpointing=gc,
            liger=lg,
            attention=attn,
            sharding=stage or "none",
            offload=offload,
            packing=pack,
            padding_free=pf,
            # sorted steps: less padding, and where padding-free falls back to padding at run time; token budgets
            # keep the same row order, so that a resume that switches to fixed micro-batches skips the same rows
            sorted_steps=options.sort_steps and (mbs > 1 or budget > 0) and not pack,
            alloc_conf=None if on_cpu else options.fixed.get("alloc_conf", options.alloc_conf),
            launcher=options.launcher,
            optimizer=optimizer,
            master_weights=master,
        )
        if not all(getattr(plan, key) == value for key, value in fixed.items() if key != "alloc_conf"):
            continue
        if master and "master_weights" not in fixed and violated(plan, MASTER_WEIGHTS_RULE):
            continue  # offered where it runs; only a pin of it is reported as broken
        broken = violations(plan)  # strategy.CONSTRAINTS, e.g. liger with ZeRO-3
        if broken:
            if forbidden is not None:
                forbidden.append(frozenset(f"{c.rule}: {c.why}" for c in broken))
            continue
        yield plan


def _recompute_sized_to_memory(model, c: Candidate, hardware, options: PlanOptions, price) -> Candidate | None:
    """A fitting plan that checkpoints every layer, narrowed to the fewest first layers whose recompute the memory
    still needs (memory grows as fewer layers are checkpointed, so a bisection finds it); None when it cannot be
    narrowed: all layers are needed, no GPU, BAdam (LLaMA-Factory checkpoints its own way), or pinned."""
    p = c.plan
    if (
        not c.fits
        or not p.gradient_checkpointing
        or p.checkpoint_layers is not None
        or "checkpoint_layers" in options.fixed
        or not hardware.has_gpu
        or p.optimizer == Optimizer.BADAM
    ):
        return None
    below = options.below_reserved_gib
    best, low, high = None, 1, model.num_layers - 1
    while low <= high:
        k = (low + high) // 2
        narrowed = price(p.replace(checkpoint_layers=k))
        if narrowed.fits and (below is None or narrowed.memory.reserved_gib < below):
            best, high = narrowed, k - 1
        else:
            low = k + 1
    return best


NEAR_TIE = 0.05  # predictions closer than this are within the throughput model's error (bench/README.md)


def rank(fitting: list[Candidate]) -> list[Candidate]:
    """Fastest first, except that plans within NEAR_TIE of the fastest count as ties: among them prefer simpler
    launches (no DeepSpeed, no offload), then larger micro-batches (the per-micro-batch overhead is the least
    certain term of the model), then less memory."""
    if not fitting:
        return []
    best = max(c.tokens_per_s for c in fitting)

    def key(c: Candidate):
        simplicity = (c.plan.deepspeed is not None) + (c.plan.offload != Offload.NONE) + c.plan.offloads_to_nvme
        tied = c.tokens_per_s >= best * (1.0 - NEAR_TIE)
        return (
            not tied,
            simplicity if tied else 0,
            -c.plan.micro_batch_size if tied else 0,
            -c.tokens_per_s,
            c.memory.reserved_gib,
        )

    return sorted(fitting, key=key)


def predict(
    model: ModelSpec,
    plan: Plan,
    hardware: HardwareProfile,
    seq_len: int,
    mean_seq_fraction: float,
    length_quantiles: tuple[float, ...] = (),
) -> Candidate:
    """One plan's predicted GPU memory, host RAM and speed (what `lfa train` records per attempt and the report
    draws beside the measurements), judged against the headroom `lfa generate` plans with."""
    vram = hardware.gpu.vram_gib if hardware.has_gpu else None
    headroom = generate_headroom(model, hardware)
    fraction = 1.0 if plan.packing else mean_seq_fraction
    return _price(model, plan, hardware, seq_len, fraction, vram, headroom, length_quantiles=length_quantiles)


def _price(
    model: ModelSpec,
    plan: Plan,
    hardware: HardwareProfile,
    seq_len: int,
    mean_seq_fraction: float,
    vram_gib: float | None,
    headroom: float = DEFAULT_HEADROOM,
    activation_scale: float = 1.0,
    ram_gib: float | None = None,
    length_quantiles: tuple[float, ...] = (),
) -> Candidate:
    """A plan priced for GPU memory, speed, host RAM and disk."""
    return Candidate(
        plan,
        estimate(model, plan, seq_len, vram_gib, headroom, activation_scale),
        predict_tokens_per_s(model, plan, hardware, seq_len, mean_seq_fraction, length_quantiles),
        host_memory(model, plan, hardware, ram_gib),
        disk_gib(model, plan),
        hardware.disk.free_gib if hardware.disk else None,
    )


def plan(
    model: ModelSpec,
    hardware: HardwareProfile,
    effective_batch: int,
    seq_len: int,
    options: PlanOptions = PlanOptions(),
    suggest: bool = True,
) -> PlanResult:
    """The fastest plan that fits GPU and host memory. NoPlanFits when none does (with suggest: what would)."""
    from .plan_reasons import explain, no_fit_message  # they plan again to suggest (a cycle at import time)

    if hardware.has_gpu:
        vram = options.vram_gib or hardware.gpu.vram_gib
    else:
        vram = hardware.ram_gib or None  # on CPU, host RAM
    seen, candidates, forbidden = set(), [], []

    def price(p: Plan) -> Candidate:
        return _price(
            model,
            p,
            hardware,
            seq_len,
            options.mean_seq_fraction,
            vram,
            options.headroom,
            options.activation_scale,
            options.ram_gib,
            options.length_quantiles,
        )

    below = options.below_reserved_gib
    for p in candidate_plans(model, hardware, effective_batch, options, forbidden, seq_len):
        if p in seen:
            continue
        seen.add(p)
        candidates.append(price(p))
        fewer = _recompute_sized_to_memory(model, candidates[-1], hardware, options, price)
        if fewer is not None and fewer.plan not in seen:
            seen.add(fewer.plan)
            candidates.append(fewer)
    if not candidates:
        pinned = ", ".join(f"{k}={v}" for k, v in options.fixed.items())
        raise UserError(
            f"no plan for {model.name} on {hardware.name} matches the pinned fields ({pinned})"
            + "".join(f"; {why}" for why in blocking_rules(forbidden))
        )
    allowed = allowed_optimizers(options)
    fitting = [
        c
        for c in candidates
        if c.fits and (below is None or c.memory.reserved_gib < below) and c.plan.optimizer in allowed
    ]
    if hardware.world_size == 1:
        # one GPU: DeepSpeed (offload) only when the model states need it with the same optimizer; its CPU Adam
        # and PCIe copies are hard to predict and it is one more package and launcher that can fail
        plain = {c.plan.optimizer for c in fitting if c.plan.deepspeed is None}
        fitting = [c for c in fitting if c.plan.deepspeed is None or c.plan.optimizer not in plain]
    fitting = rank(fitting)
    rejected = sorted(
        (c for c in candidates if not c.fits and c.plan.optimizer in allowed), key=lambda c: c.memory.reserved_gib
    )
    if not fitting:
        allowed_candidates = [c for c in candidates if c.plan.optimizer in allowed] or candidates
        raise NoPlanFits(
            no_fit_message(model, hardware, effective_batch, seq_len, options, allowed_candidates, suggest),
            priced=candidates,
        )
    chosen = fitting[0]
    return PlanResult(
        chosen=dataclasses.replace(chosen, plan=explain(chosen, model, hardware, options, fitting, seq_len)),
        runners_up=fitting[1:6],
        rejected=rejected[:5],
        priced=candidates,
    )
