"""Stage 9: a failure + the current plan -> the next plan to try, in a documented order that keeps the
training semantics (effective batch exact; the learning rate only moves with --allow-hparam-change)."""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field

from ..data import ASSUMED_MEAN_SEQ_FRACTION
from ..hardware import HardwareProfile
from ..memory import estimate, fit_activation_scale
from ..model_spec import ModelSpec
from ..plan import Plan
from ..planner import EXPANDABLE_SEGMENTS as EXPANDABLE
from ..planner import NoPlanFits, PlanOptions, plan
from ..strategy import Offload, Sharding, violated
from .monitor import Failure, failure_class, failure_classes

FRAGMENTATION_GIB = 1.0  # reserved-but-unallocated above this: fragmentation, not real shortage


@dataclass(frozen=True)
class Attempt:
    """What one attempt runs: the plan, plus LF keys and env that are not plan fields."""

    plan: Plan
    keys: dict = field(default_factory=dict)  # extra LLaMA-Factory overrides (learning_rate, workers...)
    env: dict = field(default_factory=dict)
    own_deepspeed_config: bool = False  # run on lfa's rendered DeepSpeed config instead of the recipe's file


@dataclass(frozen=True)
class Remedy:
    action: str
    attempt: Attempt | None  # None: stop now, no retry can help (why says what would)
    why: str


@dataclass(frozen=True)
class Context:
    hardware: HardwareProfile
    allow_hparam_change: bool = False
    learning_rate: float | None = None
    hub_mirror: str | None = None
    model_cached: bool = False
    scheduler_kwargs: dict | None = None  # the recipe's lr_scheduler_kwargs
    model: ModelSpec | None = None  # the model's shape: OOMs are re-planned with the memory model
    seq_len: int = 2048  # cutoff_len
    mean_seq_fraction: float = ASSUMED_MEAN_SEQ_FRACTION
    length_quantiles: tuple[float, ...] = ()  # the data's row-length profile, where lfa generate read the data
    liger_available: bool = False
    dataloader_workers: int | None = None  # the recipe's dataloader_num_workers (None: LLaMA-Factory's default)


def _fragmentation(a, f, c):
    wasted = f.details.get("reserved_unallocated_gib", 0.0)
    if a.plan.alloc_conf or wasted < FRAGMENTATION_GIB:
        return None
    return a.plan.replace(alloc_conf=EXPANDABLE), (
        f"{wasted:.2f} GiB reserved but unallocated: fragmentation; PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}"
    )


def _halve_micro_batch(a, f, c):
    p = a.plan
    if p.micro_batch_size < 2 and p.token_budget < 2:
        return None
    halved = p.replace(token_budget=p.token_budget // 2)
    why = [f"token budget {p.token_budget} -> {p.token_budget // 2}"] if p.token_budget else []
    if p.micro_batch_size >= 2:
        halved = halved.replace(micro_batch_size=p.micro_batch_size // 2, grad_accum=p.grad_accum * 2)
        why.append(
            f"micro-batch {p.micro_batch_size} -> {p.micro_batch_size // 2}, accumulation {p.grad_accum} -> "
            f"{p.grad_accum * 2}"
        )
    return halved, ", ".join(why) + f": effective batch stays {p.effective_batch_size}"


def _checkpoint_every_layer(a, f, c):
    p = a.plan
    if p.gradient_checkpointing and p.checkpoint_layers is None:
        return None
    return p.replace(gradient_checkpointing=True, checkpoint_layers=None), (
        "gradient checkpointing on every layer: keep only layer inputs, recompute the rest"
    )


def _switch(field_name, value, why):
    def action(a, f, c):
        if getattr(a.plan, field_name) == value:
            return None
        return a.plan.replace(**{field_name: value}), why

    return action


def _gpu_only(action):
    def wrapped(a, f, c):
        return None if not c.hardware.has_gpu else action(a, f, c)

    return wrapped


def _triton_gpu_only(action):
    """An action that turns liger on: only where Triton runs (sm80+, GPUSpec.runs_triton)."""

    def wrapped(a, f, c):
        return None if not c.hardware.has_gpu or not c.hardware.gpu.runs_triton else action(a, f, c)

    return wrapped


def _not_zero3(action):
    """An action that turns liger on: not under ZeRO-3 (strategy.CONSTRAINTS: liger_with_zero3)."""

    def wrapped(a, f, c):
        return None if violated(a.plan.replace(liger=True), "liger_with_zero3") else action(a, f, c)

    return wrapped


# from lightest to heaviest on the host: (DeepSpeed stage, offload)
DEEPSPEED_ORDER = [
    (None, Offload.NONE.value),
    (Sharding.ZERO2.value, Offload.NONE.value),
    (Sharding.ZERO2.value, Offload.OPTIMIZER.value),
    (Sharding.ZERO3.value, Offload.OPTIMIZER.value),
    (Sharding.ZERO3.value, Offload.ALL.value),
]


def _deepspeed(stage, offload):
    def action(a, f, c):
        p = a.plan
        current = (p.deepspeed, p.offload)
        if (
            not c.hardware.has_gpu
            or current not in DEEPSPEED_ORDER
            or DEEPSPEED_ORDER.index((stage, offload)) <= DEEPSPEED_ORDER.index(current)
        ):
            return None
        moved = p.replace(sharding=stage or "none", offload=offload)
        liger = p.liger and not violated(moved, "liger_with_zero3")
        return moved.replace(liger=liger), (
            f"DeepSpeed {stage}"
            + ("" if offload == Offload.NONE else f" with {offload} offload to CPU")
            + ": partitions/moves model states off the GPU (launched with FORCE_TORCHRUN=1)"
            + ("; liger off: its fused cross-entropy reads the sharded lm_head weight" if p.liger and not liger else "")
        )

    return action


def _bf16_if_supported(a, f, c):
    if a.plan.precision != "fp16" or not c.hardware.has_gpu or not c.hardware.gpu.bf16:
        return None
    return a.plan.replace(precision="bf16"), "fp16 overflowed; this GPU has native bf16 (fp32 range, no loss scaling)"


def _fp16(a, f, c):
    if a.plan.precision != "bf16":
        return None
    return a.plan.replace(precision="fp16"), "the GPU lacks bf16: fp16 mixed precision with dynamic loss scaling"


def _no_master_weights(a, f, c):
    if not a.plan.master_weights or a.plan.precision != "fp16":
        return None
    return a.plan.replace(master_weights=False), (
        "fp16 overflowed with master weights: fp32 weights under autocast keep the residual stream in fp32"
    )


def _drop_deepspeed(a, f, c):
    if a.plan.deepspeed is None or a.plan.world_size > 1:
        return None
    return a.plan.replace(sharding="none", offload="none"), "one GPU: plain training needs no DeepSpeed launcher"


# actions that change the plan: (attempt, failure, context) -> (plan, why) or None
PLAN_ACTIONS = {
    "fragmentation": _gpu_only(_fragmentation),  # PYTORCH_CUDA_ALLOC_CONF does nothing on a CPU
    "halve_micro_batch": _halve_micro_batch,
    "gradient_checkpointing": _checkpoint_every_layer,
    "liger": _triton_gpu_only(
        _not_zero3(_switch("liger", True, "liger kernel on: fused cross-entropy never materializes fp32 logits"))
    ),
    "no_liger": _switch("liger", False, "liger-kernel is not installed here: run without it"),
    "sdpa": _switch("attention", "sdpa", "sdpa attention: no score matrix in memory, no extra package"),
    "eager_attention": _switch("attention", "eager", "eager attention: rules out a fused-kernel numerics problem"),
    "zero2": _deepspeed(Sharding.ZERO2.value, Offload.NONE.value),
    "zero2_offload": _deepspeed(Sharding.ZERO2.value, Offload.OPTIMIZER.value),
    "zero3_offload": _deepspeed(Sharding.ZERO3.value, Offload.ALL.value),
    "fp16": _fp16,
    "bf16_if_supported": _bf16_if_supported,
    "no_master_weights": _no_master_weights,
    "drop_deepspeed": _drop_deepspeed,
}


# Actions that change the attempt's keys or environment, not its plan: (attempt, failure, context) -> (attempt, why)
def _set_env(name: str, value_of, why_of, applies=lambda a, c: True):
    def action(a: Attempt, f, c: Context):
        value = value_of(c)
        if not value or not applies(a, c) or a.env.get(name) == value:
            return None
        return dataclasses.replace(a, env={**a.env, name: value}), why_of(c)

    return action


def _lfa_deepspeed_config(a: Attempt, f, c: Context):
    if a.own_deepspeed_config or a.plan.deepspeed is None:
        return None
    return dataclasses.replace(a, own_deepspeed_config=True), (
        "the DeepSpeed config offloads without naming an optimizer: use lfa's config for the same plan "
        "(it adds an AdamW optimizer section, so DeepSpeed runs its CPU Adam)"
    )


def _min_lr_rate(a: Attempt, f, c: Context):
    kwargs = dict(a.keys.get("lr_scheduler_kwargs") or c.scheduler_kwargs or {})
    lr = a.keys.get("learning_rate", c.learning_rate)
    if "min_lr" not in kwargs or not lr:
        return None
    min_lr = float(kwargs.pop("min_lr"))
    kwargs["min_lr_rate"] = round(min_lr / lr, 10)
    return dataclasses.replace(a, keys={**a.keys, "lr_scheduler_kwargs": kwargs}), (
        f"min_lr {min_lr:.1e} as min_lr_rate {kwargs['min_lr_rate']} (the same schedule): an absolute min_lr makes "
        "transformers read optimizer.defaults, which DeepSpeed ZeRO-3's optimizer lacks"
    )


def _resume_as_is(a: Attempt, f, c: Context):
    cause = {
        "nccl_timeout": "a transient collective timeout",
        "killed": "a kill from outside (no sign of a host OOM)",
    }.get(getattr(f, "kind", ""), "a transient failure")
    return a, f"{cause}: resume from the last checkpoint unchanged"


def _fewer_checkpoints(a: Attempt, f, c: Context):
    if a.keys.get("save_total_limit") == 1:
        return None
    return dataclasses.replace(a, keys={**a.keys, "save_total_limit": 1}), "disk full: keep only the newest checkpoint"


def _fewer_workers(a: Attempt, f, c: Context):
    workers = a.keys.get("dataloader_num_workers", c.dataloader_workers)
    if workers is not None and int(workers) == 0:
        return None  # nothing to take away: never an identical retry
    return dataclasses.replace(a, keys={**a.keys, "preprocessing_num_workers": 1, "dataloader_num_workers": 0}), (
        "killed by SIGKILL: fewer host processes (data workers) to lower host memory"
    )


def _lower_lr(a: Attempt, f, c: Context):
    if not c.allow_hparam_change or c.learning_rate is None:
        return None
    lr = a.keys.get("learning_rate", c.learning_rate) / 2
    return dataclasses.replace(a, keys={**a.keys, "learning_rate": lr}), (
        f"NaN persists: learning rate halved to {lr:.1e} (--allow-hparam-change)"
    )


def _changes_plan(plan_action):
    """A plan action ((a, f, c) -> (plan, why)) as an attempt action."""

    def action(a: Attempt, f, c: Context):
        result = plan_action(a, f, c)
        return None if result is None else (dataclasses.replace(a, plan=result[0]), result[1])

    return action


# every remedy a ladder in failures/classes.yaml can name: (attempt, failure, context) -> (attempt, why) or None
ACTIONS = {
    **{name: _changes_plan(fn) for name, fn in PLAN_ACTIONS.items()},
    "force_torchrun": _set_env("FORCE_TORCHRUN", lambda c: "1", lambda c: "FORCE_TORCHRUN=1: launch through torchrun"),
    "hub_mirror": _set_env(
        "HF_ENDPOINT", lambda c: c.hub_mirror, lambda c: f"hub unreachable: HF_ENDPOINT={c.hub_mirror}"
    ),
    "hub_offline": _set_env(
        "HF_HUB_OFFLINE",
        lambda c: "1",
        lambda c: "hub unreachable but files cached: HF_HUB_OFFLINE=1",
        applies=lambda a, c: c.model_cached,
    ),
    "lfa_deepspeed_config": _lfa_deepspeed_config,
    "min_lr_rate": _min_lr_rate,
    "resume_as_is": _resume_as_is,
    "fewer_checkpoints": _fewer_checkpoints,
    "fewer_workers": _fewer_workers,
    "lower_lr": _lower_lr,
}


def oom_budget_gib(failure: Failure, hardware: HardwareProfile) -> float:
    """Usable GPU memory as the OOM line reports it: the process's cap when one was set, else the card's capacity
    less what other processes hold; never more than the profile says."""
    d = failure.details
    budget = hardware.gpu.vram_gib
    if d.get("allowed_gib"):
        return min(budget, d["allowed_gib"])
    if d.get("capacity_gib"):
        others = max(0.0, d["capacity_gib"] - d.get("free_gib", 0.0) - d.get("in_use_gib", 0.0))
        budget = min(budget, d["capacity_gib"] - others)
    return budget


def replan_after_oom(attempt: Attempt, failure: Failure, context: Context) -> Remedy | None:
    """A CUDA OOM re-planned by the memory model with the log's evidence: the budget the line reports, the
    activation terms scaled up until the failing plan is predicted at what it had allocated plus what it asked
    for, then the fastest plan predicted to fit (GPU and host) with the same effective batch, precision, packing
    and launcher. Expandable segments alone when that plan fits and the cached-but-free share explains the OOM.
    Returns a stop (attempt None) when nothing fits, None without a model or GPU to plan with."""
    if context.model is None or not context.hardware.has_gpu:
        return None
    failing, d = attempt.plan, failure.details
    budget = oom_budget_gib(failure, context.hardware)
    needed = d.get("allocated_gib", 0.0) + d.get("asked_gib", 0.0)
    scale = fit_activation_scale(context.model, failing, context.seq_len, needed) if needed else 1.0
    evidence = (
        f"the OOM line shows {d.get('allocated_gib', 0):.2f} GiB allocated + {d.get('asked_gib', 0):.2f} "
        f"GiB asked of {budget:.2f} GiB"
        if needed
        else "the OOM line has no allocation figures"
    )
    if scale > 1.0:
        evidence += f"; activations rescaled x{scale:.2f} so the failing plan is predicted at that"
    failing_now = estimate(context.model, failing, context.seq_len, budget, activation_scale=scale)
    wasted = d.get("reserved_unallocated_gib", 0.0)
    if not failing.alloc_conf and wasted >= max(FRAGMENTATION_GIB, d.get("asked_gib", 0.0)):
        expandable = estimate(
            context.model, failing.replace(alloc_conf=EXPANDABLE), context.seq_len, budget, activation_scale=scale
        )
        if expandable.fits:
            return Remedy(
                "fragmentation",
                dataclasses.replace(attempt, plan=failing.replace(alloc_conf=EXPANDABLE)),
                f"{wasted:.2f} GiB reserved but unallocated covers the {d.get('asked_gib', 0):.2f} GiB asked "
                f"and the memory model puts this plan at {expandable.reserved_gib:.1f} of "
                f"{expandable.limit_gib:.1f} GiB: fragmentation; PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}",
            )
    precision = failing.precision
    gpu = context.hardware.gpu
    if precision == "bf16" and not gpu.bf16:  # a recipe written for a bf16 card, re-planned for this one
        precision = "fp16"
        evidence += f"; {gpu.name} has no native bf16 (sm{gpu.compute_capability}): the next plan runs fp16"
    fixed = {"precision": precision, "packing": failing.packing, "launcher": failing.launcher}
    options = PlanOptions(
        allow_packing=failing.packing,
        launcher=failing.launcher,
        liger_available=context.liger_available or failing.liger,
        mean_seq_fraction=context.mean_seq_fraction,
        length_quantiles=context.length_quantiles,
        fixed=fixed,
        activation_scale=scale,
        vram_gib=budget,
        # a plan the model thinks fits did not: only plans that need less than it may follow
        below_reserved_gib=failing_now.reserved_gib if failing_now.fits else None,
    )
    try:
        result = plan(context.model, context.hardware, failing.effective_batch_size, context.seq_len, options)
    except NoPlanFits as exc:
        return Remedy("no_plan_fits", None, f"{evidence}. {exc}")
    chosen = result.chosen
    new_plan = chosen.plan.replace(reasons={})
    return Remedy(
        "replan",
        dataclasses.replace(attempt, plan=new_plan),
        (
            f"{evidence}; the memory model puts {failing.label()} at {failing_now.reserved_gib:.1f} GiB and "
            f"{new_plan.label()} at {chosen.memory.reserved_gib:.1f} of {chosen.memory.limit_gib:.1f} GiB "
            f"(host {chosen.host.total_gib:.0f} of {chosen.host.limit_gib or 0:.0f} GiB RAM), the fastest that fits; "
            f"effective batch stays {new_plan.effective_batch_size}"
        ),
    )


def _keep_schedule_under_zero3(remedy: Remedy | None, context: Context) -> Remedy | None:
    """A remedy that moves to ZeRO-3 writes an absolute min_lr as min_lr_rate (the same schedule): transformers
    reads optimizer.defaults for min_lr, which DeepSpeed's ZeRO-3 optimizer lacks."""
    if remedy is None or remedy.attempt is None or not remedy.attempt.plan.strategy.min_lr_as_rate:
        return remedy
    converted = _min_lr_rate(remedy.attempt, None, context)
    if converted is None:
        return remedy
    return Remedy(remedy.action, converted[0], f"{remedy.why}; {converted[1]}")


def next_remedy(attempt: Attempt, failure: Failure, context: Context, tried: set[str]) -> Remedy | None:
    return _keep_schedule_under_zero3(_next_remedy(attempt, failure, context, tried), context)


def ladder_problems() -> list[str]:
    """Ladder steps in failures/classes.yaml that name no action (a typo would otherwise be skipped silently)."""
    known = sorted(ACTIONS)
    problems = []
    for failure_kind in failure_classes():
        for step in failure_kind.ladder:
            if step.rstrip("*") not in known:
                near = difflib.get_close_matches(step.rstrip("*"), known, n=1)
                problems.append(
                    f"class {failure_kind.name}: ladder step {step!r} is no action"
                    + (f" (did you mean {near[0]!r}?)" if near else "")
                )
    return problems


def _next_remedy(attempt: Attempt, failure: Failure, context: Context, tried: set[str]) -> Remedy | None:
    """The first step of the class's ladder that was not taken yet and applies to this attempt. Steps are
    remembered in `tried` as "class:index"; a step whose action ends in * stays available while it applies."""
    if not failure.retriable or failure.kind == "unknown":
        return None
    if failure.kind == "cuda_oom":
        replanned = replan_after_oom(attempt, failure, context)
        if replanned is not None and (replanned.attempt is None or replanned.attempt.plan != attempt.plan):
            return replanned
    for index, step in enumerate(failure_class(failure.kind).ladder):
        action, repeatable = step.rstrip("*"), step.endswith("*")
        if f"{failure.kind}:{index}" in tried:
            continue
        result = ACTIONS[action](attempt, failure, context) if action in ACTIONS else None
        if result is not None:
            tried.update(() if repeatable else [f"{failure.kind}:{index}"])
            return Remedy(action, result[0], result[1])
    return None


def hub_mirror_from_env() -> str | None:
    return os.environ.get("LFA_HF_MIRROR")
