"""Stage 5: search the plan space and pick the fastest plan that fits, with reasons and runners-up."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from . import UserError
from .hardware import HardwareProfile
from .memory import DEFAULT_HEADROOM, HostMemory, MemoryBreakdown, estimate, host_memory
from .model_spec import ModelSpec, catalog, load_model_spec
from .plan import Plan
from .throughput import predict_tokens_per_s
from .strategy import normalized_sharding, violations

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
    mean_seq_fraction: float = 0.75  # mean non-pad length / cutoff_len, when the dataset was not profiled
    fixed: dict = field(default_factory=dict)  # plan fields the user pinned, e.g. {"precision": "fp16"}
    # recovery after an OOM (remedies.replan_after_oom): what the log showed
    activation_scale: float = 1.0  # > 1: activations measured larger than modelled
    vram_gib: float | None = None  # usable GPU memory (default: the profile's)
    ram_gib: float | None = None  # host RAM of a node (default: the profile's)
    below_reserved_gib: float | None = None  # only plans predicted to need less than the one that failed


@dataclass
class Candidate:
    plan: Plan
    memory: MemoryBreakdown
    tokens_per_s: float  # predicted non-pad tokens per second, whole job
    host: HostMemory = field(default_factory=HostMemory)

    @property
    def fits(self) -> bool:
        return self.memory.fits and self.host.fits


class NoPlanFits(UserError):
    """No plan fits GPU and host memory together; the message says what would."""


@dataclass
class PlanResult:
    chosen: Candidate
    runners_up: list[Candidate]
    rejected: list[Candidate]


def pick_precision(hardware: HardwareProfile) -> tuple[str, str]:
    if not hardware.has_gpu:
        return "fp32", "no GPU: the CPU trains in fp32 (16-bit autocast on CPU is slow and lossy)"
    gpu = hardware.gpu
    if gpu.bf16:
        return "bf16", f"{gpu.name} is sm{gpu.cc[0]}{gpu.cc[1]} (>= 8.0): native bf16, the paper's precision, no loss scaling"
    return "fp16", (f"{gpu.name} is sm{gpu.cc[0]}{gpu.cc[1]} (< 8.0): no native bf16 (transformers' check passes only "
                    "through slow emulation), so fp16 mixed precision with dynamic loss scaling")


def _divisors_pow2(effective_batch: int, world: int) -> list[int]:
    per_gpu = effective_batch // world
    return [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= per_gpu and per_gpu % m == 0]


def candidate_plans(model: ModelSpec, hardware: HardwareProfile, effective_batch: int, options: PlanOptions,
                    forbidden: set[str] | None = None):
    """Every plan worth pricing that matches the pinned fields; the constraints that ruled out plans matching the
    pins are added to `forbidden` (their why), for the message when nothing is left."""
    precision = options.fixed.get("precision") or pick_precision(hardware)[0]
    world = hardware.world_size
    if effective_batch % world:
        raise UserError(f"effective batch {effective_batch} is not divisible by {world} GPUs: the task's batch "
                        "cannot be kept exactly; pass --gpus to use fewer GPUs")
    on_cpu = not hardware.has_gpu
    liger = [False] if on_cpu or not options.liger_available else [True, False]
    attention = ["sdpa"] if on_cpu else (["fa2", "sdpa", "eager"] if options.flash_attn_available else ["sdpa", "eager"])
    packing = [True, False] if options.allow_packing else [False]
    # padding-free only when pinned until its speed is measured on a GPU (bench/README.md)
    padding_free = [True] if options.fixed.get("padding_free") else [False]
    if options.fixed.get("sharding") == "fsdp2":  # only when pinned: FSDP2's speed is not measured yet
        ds = [("fsdp2", "none")]
    elif on_cpu or not options.allow_deepspeed:
        ds = [(None, "none")]
    elif world == 1:  # on one GPU DeepSpeed only pays when it offloads model states (plan() prefers no DeepSpeed)
        ds = [(None, "none"), ("zero2", "none"), ("zero3", "none"), ("zero2", "optimizer"), ("zero3", "all")]
    else:
        ds = [(None, "none"), ("zero2", "none"), ("zero3", "none"), ("zero2", "optimizer"), ("zero3", "optimizer"),
              ("zero3", "all")]
    fixed = {**options.fixed, **({"sharding": normalized_sharding(options.fixed["sharding"], world)}
                                 if "sharding" in options.fixed else {})}
    for mbs, gc, lg, attn, (stage, offload), pack, pf in itertools.product(
            _divisors_pow2(effective_batch, world), [False, True], liger, attention, ds, packing, padding_free):
        plan = Plan(precision=precision, micro_batch_size=mbs, grad_accum=effective_batch // (mbs * world),
                    world_size=world, nodes=hardware.nodes, on_cpu=on_cpu, gradient_checkpointing=gc, liger=lg,
                    attention=attn, sharding=stage or "none", offload=offload, packing=pack,
                    padding_free=pf, sorted_steps=options.sort_steps and mbs > 1 and not pack and not pf,
                    alloc_conf=None if on_cpu else options.fixed.get("alloc_conf", options.alloc_conf),
                    launcher=options.launcher)
        if not all(getattr(plan, key) == value for key, value in fixed.items() if key != "alloc_conf"):
            continue
        broken = violations(plan)  # strategy.CONSTRAINTS, e.g. liger with ZeRO-3
        if broken:
            if forbidden is not None:
                forbidden.update(f"{c.rule}: {c.why}" for c in broken)
            continue
        yield plan


NEAR_TIE = 0.05  # predictions closer than this are within the throughput model's error (bench/README.md)


def rank(fitting: list[Candidate]) -> list[Candidate]:
    """Fastest first, except that plans within NEAR_TIE of the fastest count as ties: among them prefer simpler
    launches (no DeepSpeed, no offload), then larger micro-batches (the per-micro-batch overhead is the least
    certain term of the model), then less memory."""
    if not fitting:
        return []
    best = max(c.tokens_per_s for c in fitting)

    def key(c: Candidate):
        simplicity = (c.plan.deepspeed is not None) + (c.plan.offload != "none")
        tied = c.tokens_per_s >= best * (1.0 - NEAR_TIE)
        return (not tied, simplicity if tied else 0, -c.plan.micro_batch_size if tied else 0, -c.tokens_per_s,
                c.memory.reserved_gib)
    return sorted(fitting, key=key)


def predict(model: ModelSpec, plan: Plan, hardware: HardwareProfile, seq_len: int,
            mean_seq_fraction: float) -> Candidate:
    """One plan's predicted GPU memory, host RAM and speed (what `lfa train` records per attempt and the report
    draws beside the measurements)."""
    vram = hardware.gpu.vram_gib if hardware.has_gpu else None
    fraction = 1.0 if plan.packing else mean_seq_fraction
    return Candidate(plan, estimate(model, plan, seq_len, vram),
                     predict_tokens_per_s(model, plan, hardware, seq_len, fraction), host_memory(model, plan, hardware))


def plan(model: ModelSpec, hardware: HardwareProfile, effective_batch: int, seq_len: int,
         options: PlanOptions = PlanOptions(), suggest: bool = True) -> PlanResult:
    """The fastest plan that fits GPU and host memory. NoPlanFits when none does (with suggest: what would)."""
    if hardware.has_gpu:
        vram = options.vram_gib or hardware.gpu.vram_gib
    else:
        vram = hardware.ram_gib or None  # on CPU, host RAM
    seen, candidates, forbidden = set(), [], set()
    for p in candidate_plans(model, hardware, effective_batch, options, forbidden):
        if p in seen:
            continue
        seen.add(p)
        mem = estimate(model, p, seq_len, vram, options.headroom, options.activation_scale)
        candidates.append(Candidate(p, mem, predict_tokens_per_s(model, p, hardware, seq_len, options.mean_seq_fraction),
                                    host_memory(model, p, hardware, options.ram_gib)))
    if not candidates:
        pinned = ", ".join(f"{k}={v}" for k, v in options.fixed.items())
        raise UserError(f"no plan for {model.name} on {hardware.name} matches the pinned fields ({pinned})" +
                        "".join(f"; {why}" for why in sorted(forbidden)))
    below = options.below_reserved_gib
    fitting = [c for c in candidates if c.fits and (below is None or c.memory.reserved_gib < below)]
    if hardware.world_size == 1 and any(c.plan.deepspeed is None for c in fitting):
        # one GPU: DeepSpeed (offload) only when the model states need it; its CPU Adam and PCIe copies are
        # hard to predict and it is one more package and launcher that can fail
        fitting = [c for c in fitting if c.plan.deepspeed is None]
    fitting = rank(fitting)
    rejected = sorted((c for c in candidates if not c.fits), key=lambda c: c.memory.reserved_gib)
    if not fitting:
        raise NoPlanFits(no_fit_message(model, hardware, effective_batch, seq_len, options, candidates, suggest))
    chosen = fitting[0]
    return PlanResult(chosen=Candidate(explain(chosen, hardware, options, fitting), chosen.memory, chosen.tokens_per_s,
                                       chosen.host),
                      runners_up=fitting[1:6], rejected=rejected[:5])


def no_fit_message(model: ModelSpec, hardware: HardwareProfile, effective_batch: int, seq_len: int,
                   options: PlanOptions, candidates: list[Candidate], suggest: bool = True) -> str:
    """Why nothing fits (the lightest plan's GPU and host needs) and what would: more GPUs of this kind, the RAM
    that ZeRO-3 offload needs, a smaller model from lfa's catalog."""
    lightest = min(candidates, key=lambda c: c.memory.reserved_gib)
    gpu_fitting = [c for c in candidates if c.memory.fits]
    where = f"{model.name} ({model.num_params / 1e9:.1f} B parameters) on {hardware.name}"
    if not hardware.has_gpu:
        return (f"no plan fits {where}: even {lightest.plan.label()} needs {lightest.memory.reserved_gib:.1f} GiB "
                f"of RAM against a limit of {lightest.memory.limit_gib:.1f} GiB; use a smaller model")
    lines = [f"no plan fits {where}: the model states alone are {16 * model.num_params / 2**30:.1f} GiB "
             f"(16 bytes per parameter); the GPU has {lightest.memory.budget_gib:.1f} GiB "
             f"({lightest.memory.limit_gib:.1f} usable with {options.headroom:.0%} headroom), the host "
             f"{lightest.host.ram_gib or 0:.0f} GiB of RAM"]
    if options.activation_scale > 1.0:
        lines.append(f"(activations scaled x{options.activation_scale:.2f} to match the OOM this run showed)")
    if gpu_fitting:
        best_host = min(gpu_fitting, key=lambda c: c.host.total_gib)
        lines.append(f"  lightest on the GPU: {best_host.plan.label()} at {best_host.memory.reserved_gib:.1f} GiB, "
                     f"but it needs {best_host.host.total_gib:.1f} GiB of host RAM "
                     f"({best_host.host.limit_gib or 0:.1f} usable): " +
                     ", ".join(f"{k} {v:.1f}" for k, v in best_host.host.items.items()))
        need_ram = best_host.host.total_gib / (1.0 - best_host.host.headroom)
        lines.append(f"  would fit: the same GPU with {need_ram:.0f} GiB of host RAM")
    else:
        lines.append(f"  lightest on the GPU: {lightest.plan.label()} at {lightest.memory.reserved_gib:.1f} GiB")
    if not suggest:
        return lines[0]
    plain = dataclasses.replace(options, below_reserved_gib=None)
    for gpus in (2, 4, 8, 16, 32):
        if effective_batch % gpus:
            continue
        bigger = dataclasses.replace(hardware, gpus_per_node=min(gpus, 8), nodes=max(1, gpus // 8))
        try:
            found = plan(model, bigger, effective_batch, seq_len, plain, suggest=False)
        except UserError:
            continue
        lines.append(f"  would fit: {gpus} GPUs of this kind ({found.chosen.plan.label()}, "
                     f"{found.chosen.memory.reserved_gib:.1f} GiB per GPU, {found.chosen.host.total_gib:.0f} GiB RAM per node)")
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
        lines.append("  would fit: a smaller model, e.g. " + ", ".join(n for _, n in sorted(smaller, reverse=True)[:3]))
    return "\n".join(lines)


def explain(c: Candidate, hardware: HardwareProfile, options: PlanOptions, fitting: list[Candidate]) -> Plan:
    p = c.plan
    _, precision_reason = pick_precision(hardware)
    mem = c.memory
    limit = "no GPU memory limit (CPU)" if mem.limit_gib is None else (
        f"{mem.reserved_gib:.1f} GiB of {mem.limit_gib:.1f} GiB allowed ({mem.budget_gib:.1f} GiB usable, "
        f"{options.headroom:.0%} headroom)")
    reasons = {
        "precision": precision_reason,
        "batch": (f"effective batch kept at {p.effective_batch_size} = {p.micro_batch_size} micro-batch x "
                  f"{p.grad_accum} accumulation x {p.world_size} {'GPU(s)' if hardware.has_gpu else 'process(es)'}; "
                  f"predicted peak {limit}"),
        "gradient_checkpointing": ("on: without it the activations of this micro-batch do not fit, or a larger "
                                   "micro-batch with it is faster" if p.gradient_checkpointing else
                                   "off: the activations fit, which saves the ~33% recompute"),
        "liger": ("on: fused linear cross-entropy never materializes the fp32 logits, fused RMSNorm/SwiGLU/RoPE "
                  "save activation memory" if p.liger else
                  ("off: needs a CUDA GPU with Triton" if not hardware.has_gpu or not options.liger_available
                   else "off: not needed for the fastest fitting plan")),
        "attention": {"sdpa": "sdpa: PyTorch's fused attention, no score matrix in memory, no extra package",
                      "fa2": "fa2: flash-attn is installed", "eager": "eager: fits and is as fast here",
                      "auto": "auto"}[p.attention],
        "deepspeed": (f"{p.deepspeed} with offload={p.offload}: model states do not fit otherwise; launched "
                      "through torchrun (FORCE_TORCHRUN=1)" if p.deepspeed else
                      f"none; sharding fsdp2 (pinned): parameters, gradients and Adam states sharded over "
                      f"{p.world_size} processes, started by `accelerate launch` with accelerate_fsdp2.yaml; "
                      "speed priced as ZeRO-3 (not measured)" + ("; NOTE on a CPU accelerate runs this as plain "
                                                                 "DDP: it shards on GPUs only" if p.on_cpu else "")
                      if p.sharding == "fsdp2" else
                      ("none: one GPU holds the whole model state, DeepSpeed would add launch and copy overhead"
                       if p.world_size == 1 else "none: DDP, every GPU holds the model state")),
        "padding_free": ("on (pinned): each micro-batch's rows are flattened into one sequence with position ids "
                         "restarting per row and attention limited to each row, so no compute goes to padding and "
                         "the step trains on exactly the same rows and tokens; speed not measured yet"
                         if p.padding_free else "off"),
        "packing": ("on: allowed by --allow-packing; rows are concatenated to cutoff_len so no compute goes to "
                    "padding (changes what a batch is: rows per step grow)" if p.packing else
                    "off: keeps one row per sample as in the paper (pass --allow-packing to trade that for speed)"),
        "sorted_steps": ("on: each optimizer step trains on the same random rows, but its micro-batches are cut from "
                         "those rows sorted by length, so less compute goes to padding (lfa plugin, "
                         "LFA_SORTED_STEPS=1; the loss is normalized by the step's token count, so the gradient is "
                         "the same sum)" if p.sorted_steps else
                         "off: " + ("packed rows have no padding" if p.packing else
                                    "one row per micro-batch has no padding" if p.micro_batch_size == 1 else
                                    "disabled with --no-sorted-steps")),
        "allocator": (f"PYTORCH_CUDA_ALLOC_CONF={p.alloc_conf}: micro-batches change shape from step to step; "
                      "expandable segments let the caching allocator reuse memory instead of fragmenting it and "
                      "retrying (synchronizing cudaFree/cudaMalloc) near the limit" if p.alloc_conf else
                      "default caching allocator"),
        "throughput": f"predicted {c.tokens_per_s:,.0f} non-pad tokens/s; {len(fitting)} plans fit",
    }
    return p.replace(reasons=reasons)
