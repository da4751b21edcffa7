"""Stage 4: per-GPU memory of a full-SFT plan, as a breakdown, sized for the longest sequence (cutoff_len)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import yaml

from . import catalog_dir
from .hardware import HardwareProfile
from .model_spec import ModelSpec
from .plan import Plan

GIB = 2**30
DEFAULT_HEADROOM = 0.12


@lru_cache(maxsize=1)
def coefficients() -> dict:
    return yaml.safe_load((catalog_dir() / "memory_model.yaml").read_text())


@dataclass
class MemoryBreakdown:
    items: dict[str, float] = field(default_factory=dict)  # GiB per GPU, allocated by PyTorch
    reserved_gib: float = 0.0  # what the caching allocator holds at peak
    cpu_offload_gib: float = 0.0  # host memory that DeepSpeed offload needs
    budget_gib: float | None = None  # usable per-GPU memory (None on CPU)
    headroom: float = DEFAULT_HEADROOM

    @property
    def allocated_gib(self) -> float:
        return sum(self.items.values())

    @property
    def limit_gib(self) -> float | None:
        return None if self.budget_gib is None else self.budget_gib * (1.0 - self.headroom)

    @property
    def fits(self) -> bool:
        return self.limit_gib is None or self.reserved_gib <= self.limit_gib

    @property
    def headroom_left(self) -> float | None:
        return None if self.budget_gib is None else 1.0 - self.reserved_gib / self.budget_gib

    def to_dict(self) -> dict:
        return {"items_gib": {k: round(v, 3) for k, v in self.items.items()},
                "allocated_gib": round(self.allocated_gib, 3), "reserved_gib": round(self.reserved_gib, 3),
                "cpu_offload_gib": round(self.cpu_offload_gib, 3), "budget_gib": self.budget_gib,
                "limit_gib": None if self.limit_gib is None else round(self.limit_gib, 3), "fits": self.fits}


def _model_states(model: ModelSpec, plan: Plan) -> tuple[dict[str, float], float]:
    """Weights, gradients and Adam states per GPU (bytes), and bytes moved to host memory by offload."""
    p, n = model.num_params, plan.world_size
    if plan.sharding == "fsdp2":
        # FSDP2 (accelerate) shards LLaMA-Factory's fp32-upcast parameters, their fp32 gradients and the Adam
        # moments; the current and the prefetched layer are gathered in the 16-bit compute dtype. By construction
        # from FSDP2's design, not measured yet (bench/README.md)
        gathered = 2.0 if plan.precision in ("bf16", "fp16") else 4.0
        return {"weights (fp32, sharded)": 4.0 * p / n, "gradients (fp32, sharded)": 4.0 * p / n,
                "optimizer (Adam m, v fp32, sharded)": 8.0 * p / n,
                "fsdp2 gathered layer params": gathered * 2 * model.params_per_layer}, 0.0
    if plan.deepspeed is None:
        # LLaMA-Factory upcasts trainable params to fp32 for full tuning (no pure_bf16): fp32 weights and grads,
        # two fp32 Adam moments.
        states = {"weights (fp32)": 4.0 * p, "gradients (fp32)": 4.0 * p, "optimizer (Adam m, v fp32)": 8.0 * p}
        if plan.precision in ("bf16", "fp16") and plan.grad_accum > 1:
            states["autocast 16-bit weight copies (kept with accumulation)"] = 2.0 * p
        return states, 0.0
    # DeepSpeed keeps 16-bit weights and an fp32 master copy inside its optimizer, partitioned by stage.
    weights = 2.0 * p / (n if plan.deepspeed == "zero3" else 1)
    grads = 2.0 * p / n
    optimizer = 12.0 * p / n  # fp32 master + m + v
    offloaded = 0.0
    if plan.offload in ("optimizer", "all"):
        offloaded += optimizer + 4.0 * p / n  # fp32 grads for the CPU Adam step
        optimizer = 0.0
    if plan.offload == "all" and plan.deepspeed == "zero3":
        offloaded += weights
        weights = 0.0
    states = {"weights (16-bit)": weights, "gradients (16-bit, partitioned)": grads,
              "optimizer (fp32 master + Adam, partitioned)": optimizer}
    if plan.deepspeed == "zero3":
        states["zero3 gathered layer params"] = 2.0 * 2 * model.params_per_layer  # current + prefetched layer
    if n > 1:
        states["deepspeed buckets"] = 2.0 * 2 * min(p, 5e8) / n
    return states, offloaded


def _activations(model: ModelSpec, plan: Plan, seq_len: int) -> dict[str, float]:
    c = coefficients()
    act = c["activation"]
    tokens = plan.micro_batch_size * seq_len
    h, L = model.hidden_size, model.num_layers
    # DeepSpeed trains a 16-bit model: no autocast over fp32 weights, so the residual stream and norms are 16-bit too
    # (FSDP2's mixed precision also computes with 16-bit parameters)
    sixteen_bit_model = plan.deepspeed is not None or plan.sharding == "fsdp2"
    per_layer = act[("deepspeed_" if sixteen_bit_model else "") + ("liger" if plan.liger else "eager")]
    per_token_layer = per_layer["per_hidden"] * h + per_layer["per_ffn"] * model.intermediate_size
    if plan.precision == "fp32":
        per_token_layer *= 1.6  # fp32 activations are twice the 16-bit ones; norms/residual are fp32 already
    if plan.attention == "eager":
        per_token_layer += act["eager_attention_bytes_per_score"] * model.num_heads * seq_len
    logits = c["logits"]["liger_bytes_per_element" if plan.liger else "bytes_per_element"] * tokens * model.vocab_size
    if plan.gradient_checkpointing:
        factor = act["accumulation_factor"] if plan.grad_accum > 1 else 1.0
        stored = factor * tokens * (act["checkpoint_bytes_per_hidden"] * L * h)
        loss = tokens * model.vocab_size * (act["checkpoint_bytes_per_vocab"] * factor if plan.liger
                                            else c["logits"]["bytes_per_element"])
        return {"activations (checkpointed layer inputs)": stored, "logits + loss": loss}
    return {"activations (all layers)": per_token_layer * L * tokens, "logits + loss": logits}


def estimate(model: ModelSpec, plan: Plan, seq_len: int, vram_gib: float | None,
             headroom: float = DEFAULT_HEADROOM, activation_scale: float = 1.0) -> MemoryBreakdown:
    """Peak per-GPU memory in GiB. vram_gib is the card's usable memory (None on CPU). activation_scale > 1
    corrects the activation and logits terms (the least certain ones) after an OOM showed them larger."""
    c = coefficients()["allocator"]
    states, offloaded = _model_states(model, plan)
    activations = {k: v * activation_scale for k, v in _activations(model, plan, seq_len).items()}
    if plan.grad_accum == 1 and not plan.gradient_checkpointing and not plan.shards_optimizer:
        # without accumulation the gradients are freed (set to None) before each forward and are built while
        # the activations are released: about half of them coexist with all activations
        states["gradients (fp32)"] *= 0.5
    items = {k: v / GIB for k, v in {**states, **activations}.items() if v > 0}
    items["allocator/CUDA workspace"] = coefficients()["allocator"]["allocated_overhead_gib"]
    allocated = max(sum(items.values()), 16.0 * model.num_params / GIB if not plan.shards_optimizer else 0.0)
    reserved = allocated * c["reserved_over_allocated"] + c["fixed_overhead_gib"]
    if plan.alloc_conf and "expandable_segments:True" in plan.alloc_conf:
        # expandable segments leave little fragmentation; what stays is about the fp32 logits tensor's size
        logits_fp32 = 0.0 if plan.liger else 4.0 * plan.micro_batch_size * seq_len * model.vocab_size / GIB
        reserved = allocated + c["fixed_overhead_gib"] + c["expandable_logits_fraction"] * logits_fp32
    budget = vram_gib  # profiles carry usable memory; detect() subtracts the CUDA context
    return MemoryBreakdown(items=items, reserved_gib=reserved, cpu_offload_gib=offloaded / GIB,
                           budget_gib=budget, headroom=headroom)


@dataclass
class HostMemory:
    """Host RAM one node needs at its peak, summed over the training processes on it."""
    items: dict[str, float] = field(default_factory=dict)  # GiB per node at the peak phase
    phase: str = "training"  # loading | training: which phase peaks
    ram_gib: float | None = None  # the node's RAM (None: unknown)
    headroom: float = 0.08

    @property
    def total_gib(self) -> float:
        return sum(self.items.values())

    @property
    def limit_gib(self) -> float | None:
        return None if not self.ram_gib else self.ram_gib * (1.0 - self.headroom)

    @property
    def fits(self) -> bool:
        return self.limit_gib is None or self.total_gib <= self.limit_gib

    def to_dict(self) -> dict:
        return {"items_gib": {k: round(v, 2) for k, v in self.items.items()}, "total_gib": round(self.total_gib, 2),
                "phase": self.phase, "ram_gib": self.ram_gib,
                "limit_gib": None if self.limit_gib is None else round(self.limit_gib, 2), "fits": self.fits}


def host_memory(model: ModelSpec, plan: Plan, hardware: HardwareProfile, ram_gib: float | None = None) -> HostMemory:
    """Peak host RAM per node: the larger of the loading phase (every rank without ZeRO-3 loads the whole model)
    and the training phase (DeepSpeed's offloaded states per rank), plus the launcher processes. Coefficients
    measured on the H200 (catalog/memory_model.yaml)."""
    c = coefficients()["host"]
    ranks = max(1, plan.world_size // max(1, plan.nodes))
    partition = model.num_params / plan.world_size
    runtime = {"launcher (lfa, llamafactory-cli, torchrun)": c["launcher_gib_per_node"],
               "trainer runtime (Python, torch, CUDA, data) x ranks": c["runtime_gib_per_rank"] * ranks}
    loading = dict(runtime)
    if plan.sharding == "fsdp2" and not plan.on_cpu:  # cpu_ram_efficient_loading: rank 0 reads, the others receive
        loading["model load (rank 0)"] = c["load_bytes_per_param"] * model.num_params / GIB
    elif plan.deepspeed != "zero3":
        loading["model load x ranks"] = c["load_bytes_per_param"] * model.num_params * ranks / GIB
    training = dict(runtime)
    if plan.offload in ("optimizer", "all") and plan.deepspeed:
        per_param = c["zero3_offload_bytes_per_param" if plan.deepspeed == "zero3" else "zero2_offload_bytes_per_param"]
        training["offloaded optimizer states (fp32 master, grads, Adam) x ranks"] = per_param * partition * ranks / GIB
        if plan.deepspeed != "zero3" and plan.grad_accum > 1:
            training["pinned 16-bit accumulation buffers x ranks"] = \
                c["accumulation_bytes_per_param"] * partition * ranks / GIB
    phase, items = max((("loading", loading), ("training", training)), key=lambda kv: sum(kv[1].values()))
    ram = ram_gib if ram_gib is not None else (hardware.ram_gib or None)
    return HostMemory(items=items, phase=phase, ram_gib=ram, headroom=c["headroom"])


def fit_activation_scale(model: ModelSpec, plan: Plan, seq_len: int, needed_allocated_gib: float) -> float:
    """The activation_scale at which `plan` is predicted to allocate at least needed_allocated_gib (what an OOM
    showed it needed); 1.0 when the model already predicts that much. Never below 1: an OOM is a lower bound."""
    predicted = estimate(model, plan, seq_len, None)
    activations = sum(_activations(model, plan, seq_len).values()) / GIB
    if predicted.allocated_gib >= needed_allocated_gib or activations <= 0:
        return 1.0
    return 1.0 + (needed_allocated_gib - predicted.allocated_gib) / activations


def checkpoint_gib(model: ModelSpec, plan: Plan) -> float:
    """Disk one checkpoint takes: the weights as the Trainer holds them (fp32 after LLaMA-Factory's upcast; 16-bit
    under DeepSpeed) and the optimizer state (Adam m, v in fp32; DeepSpeed also keeps its fp32 master copy)."""
    per_param = 2.0 + 12.0 if plan.deepspeed else 4.0 + 8.0
    return per_param * model.num_params / GIB
