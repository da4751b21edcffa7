"""Stage 4: per-GPU memory of a full-SFT plan, as a breakdown, sized for the longest sequence (cutoff_len)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import yaml

from . import catalog_dir
from .hardware import HardwareProfile
from .model_spec import ModelSpec
from .plan import Plan
from .plugin import loss_chunks
from .saved_tensors import saved_tensors_per_token
from .strategy import Optimizer

GIB = 2**30
TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}  # plan precision -> config.json dtype
DEFAULT_HEADROOM = 0.12  # where the checked rows say nothing: several GPUs, a re-plan after an OOM (measured.py)


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
    phase: str = ""  # the moment of the step the items are taken at (the predicted peak)

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
        return {
            "items_gib": {k: round(v, 3) for k, v in self.items.items()},
            "allocated_gib": round(self.allocated_gib, 3),
            "reserved_gib": round(self.reserved_gib, 3),
            "cpu_offload_gib": round(self.cpu_offload_gib, 3),
            "budget_gib": self.budget_gib,
            "limit_gib": None if self.limit_gib is None else round(self.limit_gib, 3),
            "fits": self.fits,
            "phase": self.phase,
        }


BNB_BLOCK = 256  # bitsandbytes' 8-bit optimizers quantize each state in blocks of 256 with one fp32 scale


def badam_block_params(model: ModelSpec) -> int:
    """BAdam (layer mode) trains one block at a time: a decoder layer, or the embedding / lm_head."""
    return max(model.params_per_layer, model.embedding_params)


def checkpoint_bytes(model: ModelSpec) -> float:
    """Bytes per parameter of the checkpoint as loaded (LLaMA-Factory loads with dtype "auto"); 16-bit when the
    config does not say."""
    return 4.0 if model.torch_dtype == "float32" else 2.0


def badam_graph_layers(model: ModelSpec, plan: Plan) -> int:
    """Layers whose whole forward graph BAdam keeps. LLaMA-Factory checkpoints only layers with trainable
    parameters (model_utils/checkpointing.py, custom_gradient_checkpointing_func): every layer above the active
    one keeps its activations; ascending switching starts at layer 0, so for the first switch interval all but one
    do."""
    return model.num_layers - 1 if plan.gradient_checkpointing else model.num_layers


def _single_process_states(model: ModelSpec, plan: Plan) -> dict[str, float]:
    """Weights, gradients and optimizer states without DeepSpeed or FSDP, by optimizer."""
    p = model.num_params
    if plan.optimizer == Optimizer.BADAM:
        # LLaMA-Factory keeps the model in the checkpoint's dtype under BAdam (no fp32 upcast); BAdam gives the
        # active block an fp32 copy, fp32 gradients and Adam moments, and only that block has gradients of its own
        # (the block's fp32 gradients exist only inside the optimizer step, after the activations are freed)
        block, stored = badam_block_params(model), checkpoint_bytes(model)
        return {
            f"weights ({model.torch_dtype or '16-bit'} as loaded, BAdam: no fp32 upcast)": stored * p,
            "active block (one layer): fp32 copy + Adam m, v": 12.0 * block,
            "active block: gradients in the model's dtype": stored * block,
        }
    if plan.master_weights:  # lfa's plugin: the optimizer holds the fp32 masters, their gradients and Adam's m, v
        return {
            f"weights ({plan.precision}, in the model)": 2.0 * p,
            "fp32 master weights (optimizer)": 4.0 * p,
            "gradients (fp32, the masters')": 4.0 * p,
            "optimizer (Adam m, v fp32)": 8.0 * p,
        }
    # LLaMA-Factory upcasts trainable params to fp32 for full tuning (no pure_bf16): fp32 weights and grads
    states = {"weights (fp32)": 4.0 * p, "gradients (fp32)": 4.0 * p}
    if plan.optimizer == Optimizer.ADAMW_8BIT:
        states["optimizer (8-bit Adam m, v + fp32 block scales, bitsandbytes)"] = (2.0 + 2 * 4.0 / BNB_BLOCK) * p
    else:
        states["optimizer (Adam m, v fp32)"] = 8.0 * p
    if plan.precision in ("bf16", "fp16") and plan.accumulates and not plan.gradient_checkpointing:
        # with checkpointing autocast's copies live only until the forward ends (_autocast_recompute_phases)
        states["autocast 16-bit weight copies (kept with accumulation)"] = 2.0 * p
    return states


def _model_states(model: ModelSpec, plan: Plan) -> tuple[dict[str, float], float]:
    """Weights, gradients and Adam states per GPU (bytes), and bytes moved off the GPU by offload. What each
    strategy divides by the number of processes is its record's shards (strategy.STRATEGIES), read through the plan."""
    p, n = model.num_params, plan.world_size
    if plan.strategy.engine == "fsdp2":
        # FSDP2 (accelerate) shards LLaMA-Factory's fp32-upcast parameters, their fp32 gradients and the Adam
        # moments; the current and the prefetched layer are gathered in the 16-bit compute dtype. By construction
        # from FSDP2's design, not measured yet (bench/README.md)
        gathered = 2.0 if plan.precision in ("bf16", "fp16") else 4.0
        return {
            "weights (fp32, sharded)": 4.0 * p / n,
            "gradients (fp32, sharded)": 4.0 * p / n,
            "optimizer (Adam m, v fp32, sharded)": 8.0 * p / n,
            "fsdp2 gathered layer params": gathered * 2 * model.params_per_layer,
        }, 0.0
    if plan.deepspeed is None:
        return _single_process_states(model, plan), 0.0
    # DeepSpeed keeps 16-bit weights and an fp32 master copy inside its optimizer, partitioned by stage.
    weights = 2.0 * p / (n if plan.shards_parameters else 1)
    grads = 2.0 * p / (n if plan.shards_gradients else 1)
    if plan.shards_parameters and plan.offloads_optimizer:
        # ZeRO-3 with optimizer offload reduces gradients through GPU buckets (reduce_bucket_size: hidden^2 under
        # LLaMA-Factory's "auto") straight into a host buffer (stage3.py grad_partitions_flat_buffer on the CPU);
        # matches the offload-all runs: 6.7B width 42.6 vs 44.3 GiB measured, 1.3B 83.3 vs 85.1 (bench/README.md)
        grads = 2.0 * 2 * model.hidden_size**2
    optimizer = 12.0 * p / n  # fp32 master + m + v (every ZeRO stage shards them)
    offloaded = 0.0
    if plan.offloads_optimizer:
        offloaded += optimizer + 4.0 * p / n  # fp32 grads for the CPU Adam step
        optimizer = 0.0
    if plan.offloads_parameters:
        offloaded += weights
        weights = 0.0
    to_host = stages_gradients_to_host(plan)
    if to_host:
        grads_name, grads = (
            "gradients (DeepSpeed's reduce bucket; partitions go to the host)",
            2.0 * reduce_bucket_elements(),
        )
    elif plan.shards_parameters and plan.offloads_optimizer:
        grads_name = "gradients (16-bit reduce buckets; partitions go to the host)"
    else:
        grads_name = "gradients (16-bit" + (", partitioned)" if plan.shards_gradients else ")")
    states = {"weights (16-bit)": weights, grads_name: grads, "optimizer (fp32 master + Adam, partitioned)": optimizer}
    if to_host:
        # stage_1_and_2.py: a 16-bit buffer of the largest weight's size stays on the GPU for the host copies
        states["offload staging buffer (the largest weight, 16-bit)"] = 2.0 * model.largest_tensor_params
    if plan.shards_parameters:
        states["zero3 gathered layer params"] = 2.0 * 2 * model.params_per_layer  # current + prefetched layer
    if n > 1 and not to_host:
        states["deepspeed buckets"] = 2.0 * 2 * min(p, 5e8) / n
    return states, offloaded


def reduce_bucket_elements() -> float:
    """DeepSpeed's reduce_bucket_size as lfa's ZeRO-1/2 config writes it (templates/deepspeed/zero.json.j2)."""
    return float(coefficients()["deepspeed"]["reduce_bucket_elements"])


def stages_gradients_to_host(plan: Plan) -> bool:
    """ZeRO-1/2 with the optimizer on the host: no gradient partition on the GPU, one reduce bucket instead."""
    return plan.deepspeed is not None and plan.offloads_optimizer and not plan.shards_parameters


def _end_of_backward_bytes(model: ModelSpec, plan: Plan, states: dict[str, float]) -> float:
    """ZeRO-1/2 offload: the embedding's gradient is reduced last, its fp64 norm copy beside the model states and
    buffers (the measured floor of small micro-batches, bench/results/memory_probe.json); 0 for other plans."""
    if not stages_gradients_to_host(plan):
        return 0.0
    embedding = model.embedding_params
    outside_bucket = 2.0 * embedding if embedding > reduce_bucket_elements() else 0.0
    return sum(states.values()) + 8.0 * embedding + outside_bucket


def _offload_norm_copy_bytes(model: ModelSpec, plan: Plan) -> float:
    """ZeRO-1/2 offload takes each gradient's norm over an fp64 copy when its bucket is reduced, in the backward
    once the loss's tensors are freed: the lm_head's (untied) or an MLP matrix's; 0 for other plans."""
    if not stages_gradients_to_host(plan):
        return 0.0
    return 8.0 * (model.hidden_size * model.intermediate_size if model.tied_embeddings else model.embedding_params)


def micro_batch_tokens(plan: Plan, seq_len: int) -> int:
    """The most tokens one micro-batch holds: its token budget (but a row of cutoff_len goes alone when the budget is
    smaller), else micro_batch_size rows of cutoff_len."""
    return max(plan.token_budget, seq_len) if plan.token_budget else plan.micro_batch_size * seq_len


def eager_scores(model: ModelSpec, plan: Plan, seq_len: int) -> float:
    """One layer's attention score elements (heads x queries x keys) in the largest micro-batch under eager
    attention; 0 for the fused kernels, which never hold them."""
    return model.num_heads * seq_len * micro_batch_tokens(plan, seq_len) if plan.attention == "eager" else 0.0


def _eager_backward_bytes(model: ModelSpec, plan: Plan, seq_len: int) -> float:
    """While one layer's backward runs under eager attention: its fp32 score gradient (0 for the fused kernels)."""
    return coefficients()["activation"]["eager_backward_bytes_per_score"] * eager_scores(model, plan, seq_len)


EAGER_BACKWARD = "eager attention backward (one layer's fp32 score gradient)"


def _activations(model: ModelSpec, plan: Plan, seq_len: int) -> dict[str, float]:
    items = _kept_activations(model, plan, seq_len)
    eager_backward = _eager_backward_bytes(model, plan, seq_len)
    if eager_backward:
        items[EAGER_BACKWARD] = eager_backward
    return items


def layer_norms_run_in_fp32(model: ModelSpec, plan: Plan) -> bool:
    """Master weights run the 16-bit model under the trainer's autocast, whose fp32 list has torch's LayerNorm: without
    liger's norms each such norm's output is fp32 and each linear reading it keeps its own 16-bit cast, so the layer
    keeps (and walks) what autocast over fp32 weights does (measured: bench/README.md, session 29, StarCoder2)."""
    return plan.master_weights and model.layer_norm and not plan.liger


def _layer_bytes_per_token(model: ModelSpec, plan: Plan, seq_len: int) -> float:
    """What one decoder layer keeps per token for its backward (lf_adapter/saved_tensors.py), eager scores included."""
    act = coefficients()["activation"]
    sixteen_bit_model = plan.sixteen_bit_model
    path = ("sixteen_bit_" if sixteen_bit_model else "autocast_") + ("liger" if plan.liger else "eager")
    attention = "varlen" if plan.padding_free else "eager" if plan.attention == "eager" else "sdpa"
    per_token_layer = act["saved_tensor_scale"][path] * sum(
        saved_tensors_per_token(
            model, sixteen_bit_model and not layer_norms_run_in_fp32(model, plan), plan.liger, attention
        ).values()
    )
    if plan.precision == "fp32":
        per_token_layer *= 1.6  # fp32 activations are twice the 16-bit ones; norms/residual are fp32 already
    if plan.attention == "eager":
        # soft-capping (Gemma-2) squashes the scores through tanh, which keeps its 16-bit output too
        per_score = act["eager_attention_bytes_per_score"] + (2.0 if model.attention_softcap else 0.0)
        per_token_layer += per_score * model.num_heads * seq_len
    return per_token_layer


def _loss_bytes(model: ModelSpec, plan: Plan, tokens: int) -> float:
    """The logits and loss path over fp32 weights: liger's fused loss by construction, else the fitted logits term."""
    if plan.liger:
        return _liger_loss_bytes(model, plan, tokens)
    return coefficients()["logits"]["bytes_per_element"] * tokens * model.vocab_size


def _kept_activations(model: ModelSpec, plan: Plan, seq_len: int) -> dict[str, float]:
    """Activations of the paths priced as one phase (checkpointing under autocast has its phases)."""
    c = coefficients()
    act = c["activation"]
    tokens = micro_batch_tokens(plan, seq_len)
    h, L = model.hidden_size, model.num_layers
    per_token_layer = _layer_bytes_per_token(model, plan, seq_len)
    if plan.optimizer == Optimizer.BADAM:
        # BAdam's own fit (badam_frozen_layer_fraction) was made with the per-token logits term
        logits = (
            c["logits"]["liger_bytes_per_element" if plan.liger else "bytes_per_element"] * tokens * model.vocab_size
        )
        graph_layers = badam_graph_layers(model, plan)
        frozen = act["badam_frozen_layer_fraction"]  # a frozen linear does not keep its input for the backward
        items = {
            f"activations ({graph_layers} of {L} layers not checkpointed: BAdam, LLaMA-Factory checkpoints "
            "only the trainable layer)": frozen * per_token_layer * graph_layers * tokens,
            "checkpointed input of the active layer": tokens * act["checkpoint_bytes_per_hidden"] * h
            if plan.gradient_checkpointing
            else 0.0,
            "logits + loss": logits,
        }
        if plan.precision in ("bf16", "fp16") and model.torch_dtype != TORCH_DTYPES[plan.precision]:
            # autocast casts each weight to the compute dtype and the backward keeps those copies for every
            # layer in the graph (a bf16 checkpoint under fp16, or a checkpoint whose dtype is not known)
            items[
                f"autocast {plan.precision} weight copies of those layers (checkpoint is "
                f"{model.torch_dtype or 'of unknown dtype'})"
            ] = 2.0 * model.params_per_layer * graph_layers
        return items
    if plan.sixteen_bit_model:
        return _sixteen_bit_activations(model, plan, per_token_layer, tokens)
    return {"activations (all layers)": per_token_layer * L * tokens, "logits + loss": _loss_bytes(model, plan, tokens)}


@dataclass(frozen=True)
class Phase:
    """A moment of the step whose live tensors may be the peak: the model states alive then and the activations."""

    name: str
    states: dict[str, float]
    activations: dict[str, float]


def _phase_bytes(phase: Phase, activation_scale: float = 1.0) -> float:
    return sum(phase.states.values()) + activation_scale * sum(phase.activations.values())


def _peak_phase(model: ModelSpec, plan: Plan, seq_len: int, states: dict[str, float], scale: float = 1.0) -> Phase:
    if plan.gradient_checkpointing and not plan.sixteen_bit_model:
        phases = _autocast_recompute_phases(model, plan, seq_len, states)
        return max(phases, key=lambda phase: _phase_bytes(phase, scale))
    return Phase("forward and backward", states, _activations(model, plan, seq_len))


def _autocast_recompute_phases(model: ModelSpec, plan: Plan, seq_len: int, states: dict[str, float]) -> list[Phase]:
    """Checkpointing over fp32 weights under autocast, by construction (bench/README.md "Recompute by phase"). Each
    checkpointed layer keeps its fp32 input (the residual stream); autocast's cache holds a 16-bit copy of every
    weight until the forward ends; the backward recomputes one layer at a time while the fp32 gradient of the
    residual stream flows down. Without accumulation the gradients do not exist before the backward builds them,
    layer by layer, as the inputs are freed: the peak is the end of the forward, the first recompute or the last."""
    tokens = micro_batch_tokens(plan, seq_len)
    h, L, k = model.hidden_size, model.num_layers, plan.checkpointed_layers(model.num_layers)
    layer = _layer_bytes_per_token(model, plan, seq_len) * tokens
    residual = 4.0 * tokens * h
    kept = {f"activations ({L - k} layers not checkpointed)": layer * (L - k)} if k < L else {}
    loss = _loss_bytes(model, plan, tokens)
    forward = {"activations (checkpointed layer inputs, fp32)": residual * k, **kept, "logits + loss": loss}
    recompute = {"the layer being recomputed": layer, EAGER_BACKWARD: _eager_backward_bytes(model, plan, seq_len)}
    before_gradients = (
        states if plan.accumulates else {n: v for n, v in states.items() if not n.startswith("gradients")}
    )
    autocast = plan.precision in ("bf16", "fp16")
    cache = {"autocast's 16-bit weight cache (until the forward ends)": 2.0 * model.num_params if autocast else 0.0}
    first = {**forward, **(recompute if k == L else {}), "gradient of the residual stream (fp32)": residual}
    last = {
        "the bottom layer's input (fp32)": residual,
        **recompute,
        "gradients of the residual stream (fp32)": 2 * residual,
    }
    return [
        Phase("end of the forward", {**before_gradients, **cache}, forward),
        Phase("first recompute", before_gradients, first),
        Phase("last recompute", states, last),
    ]


def _sixteen_bit_activations(model: ModelSpec, plan: Plan, per_token_layer: float, tokens: int) -> dict[str, float]:
    """A 16-bit model (DeepSpeed, FSDP2: no autocast copies, so accumulation changes nothing). A checkpointed layer
    keeps its 16-bit input. Layers without checkpointing keep their whole graph through the loss; the peak is either
    then (the end of the forward) or at the top checkpointed layer's recompute, which finds the loss and the layers
    above freed but for the lm_head's gradient and the gradients flowing down (bench/results/memory_probe.json,
    bench/README.md session 25)."""
    L, h, V = model.num_layers, model.hidden_size, model.vocab_size
    loss = _loss_bytes_16bit(model, plan, tokens)
    if not plan.gradient_checkpointing:
        return {"activations (all layers)": per_token_layer * L * tokens, "logits + loss": loss}
    k = plan.checkpointed_layers(L)
    items = {f"activations ({k} of {L} layers checkpointed: 16-bit inputs)": 2.0 * h * k * tokens}
    # the end of the forward: the layers not checkpointed keep their graphs, and the loss its tensors
    forward = {f"activations ({L - k} layers not checkpointed)": per_token_layer * (L - k) * tokens} if k < L else {}
    forward["logits + loss"] = loss
    # the top checkpointed layer's recompute (the layers above have freed theirs): its backward holds 16-bit
    # gradients of width h: of its output, its input, the residual branch and their sum; four is FITTED on one row
    # (Phi-3-mini capped, bench/README.md "Activations by construction")
    recompute = {
        "activations (the layer being recomputed)": per_token_layer * tokens,
        "lm_head gradient + the layer's input/output gradients": 2.0 * V * h + 4 * 2.0 * tokens * h,
        "gradient norm (fp64 copy of one weight's gradient)": _offload_norm_copy_bytes(model, plan),
    }
    return {**items, **max(forward, recompute, key=lambda phase: sum(phase.values()))}


def _loss_bytes_16bit(model: ModelSpec, plan: Plan, tokens: int) -> float:
    """Without liger the logits path (fitted bytes per token x vocabulary entry). Liger's fused linear cross-entropy
    (ops/fused_linear_cross_entropy.py) computes the gradients in the forward: the lm_head's (16-bit, held until
    the backward takes it), the hidden states' and one chunk of logits (chunk rows: tokens / ceil(V / h), to a
    power of two)."""
    h, V = model.hidden_size, model.vocab_size
    if not plan.liger:
        return coefficients()["logits"]["bytes_per_element"] * tokens * V
    lm_head_gradient = 4.0 if plan.master_weights else 2.0  # the plugin has liger sum it in fp32 (accum_dtype)
    return lm_head_gradient * V * h + 2.0 * tokens * h + 2.0 * liger_loss_chunk_rows(model, tokens) * V


def _liger_loss_bytes(model: ModelSpec, plan: Plan, tokens: int) -> float:
    """Liger's fused linear cross-entropy over fp32 weights (ops/fused_linear_cross_entropy.py, 0.8.5): the fp32
    lm_head gradient it builds in the forward and holds until the backward, the fp32 gradient of its input, one chunk
    of logits and, under autocast, each chunk's 16-bit cast of the weight's transposed view (a view is not in
    autocast's cache). By construction; it does not grow with the vocabulary times the tokens (checked: Gemma-2-2B
    on the H100 at 4,096 and 16,384 tokens per micro-batch, bench/README.md)."""
    if plan.sixteen_bit_model:
        return _loss_bytes_16bit(model, plan, tokens)
    h, V = model.hidden_size, model.vocab_size
    autocast = plan.precision != "fp32"
    weight_cast = 2.0 * V * h if autocast else 0.0
    return (
        4.0 * V * h
        + weight_cast
        + 4.0 * tokens * h
        + (2.0 if autocast else 4.0) * liger_loss_chunk_rows(model, tokens) * V
    )


def liger_loss_chunk_rows(model: ModelSpec, tokens: float) -> int:
    """Rows of one chunk of liger's fused linear cross-entropy over a micro-batch of `tokens`, as lfa's plugin runs
    it (plugin/loss_chunks.py: at least 2,048 rows where the micro-batch has them)."""
    return loss_chunks.planned_chunk_rows(model.vocab_size, model.hidden_size, tokens)


def estimate(
    model: ModelSpec,
    plan: Plan,
    seq_len: int,
    vram_gib: float | None,
    headroom: float = DEFAULT_HEADROOM,
    activation_scale: float = 1.0,
) -> MemoryBreakdown:
    """Peak per-GPU memory in GiB. vram_gib is the card's usable memory (None on CPU). activation_scale > 1
    corrects the activation and logits terms (the least certain ones) after an OOM showed them larger."""
    c = coefficients()["allocator"]
    states, offloaded = _model_states(model, plan)
    # the peak can fall outside the forward/backward: the optimizer step holds every model state at once (without
    # DeepSpeed), or ZeRO-1/2 offload reduces the embedding's gradient at the end of the backward
    floors = {
        "optimizer step (all model states at once)": sum(states.values())
        if plan.strategy.holds_all_states_at_step
        else 0.0,
        "end of the backward (the embedding gradient's fp64 norm copy)": _end_of_backward_bytes(model, plan, states),
    }
    floor_name, floor = max(floors.items(), key=lambda kv: kv[1])
    if not plan.accumulates and not plan.gradient_checkpointing and "gradients (fp32)" in states:
        # without accumulation the gradients are freed (set to None) before each forward and are built while
        # the activations are released: about half of them coexist with all activations
        states["gradients (fp32)"] *= 0.5
    phase = _peak_phase(model, plan, seq_len, states, activation_scale)
    activations = {k: v * activation_scale for k, v in phase.activations.items()}
    items = {k: v / GIB for k, v in {**phase.states, **activations}.items() if v > 0}
    items["allocator/CUDA workspace"] = coefficients()["allocator"]["allocated_overhead_gib"]
    phase_name = phase.name
    if floor / GIB > sum(items.values()):
        items[f"peak phase: {floor_name}"] = floor / GIB - sum(items.values())
        phase_name = floor_name
    allocated = sum(items.values())
    reserved = allocated * c["reserved_over_allocated"] + c["fixed_overhead_gib"]
    if plan.alloc_conf and "expandable_segments:True" in plan.alloc_conf:
        reserved = allocated + c["fixed_overhead_gib"] + _cached_over_allocated(model, plan, seq_len)
    budget = vram_gib  # profiles carry usable memory; detect() subtracts the CUDA context
    return MemoryBreakdown(
        items=items,
        reserved_gib=reserved,
        cpu_offload_gib=offloaded / GIB,
        budget_gib=budget,
        headroom=headroom,
        phase=phase_name,
    )


def _cached_over_allocated(model: ModelSpec, plan: Plan, seq_len: int) -> float:
    """GiB the allocator keeps cached above the allocated peak with expandable segments: a share of the largest
    transient fp32 tensor (the logits without liger, one layer's eager scores) or, under ZeRO-1/2 offload, what its
    backward phases leave cached; the largest of them, as the blocks one phase frees are what the next reuses."""
    c = coefficients()["allocator"]
    logits_fp32 = 0.0 if plan.liger else 4.0 * micro_batch_tokens(plan, seq_len) * model.vocab_size
    scores_fp32 = 4.0 * eager_scores(model, plan, seq_len)
    return max(
        c["expandable_logits_fraction"] * logits_fp32 / GIB,
        c["expandable_eager_scores_fraction"] * scores_fp32 / GIB,
        c["offload_fragmentation_gib"] if stages_gradients_to_host(plan) else 0.0,
    )


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
        return {
            "items_gib": {k: round(v, 2) for k, v in self.items.items()},
            "total_gib": round(self.total_gib, 2),
            "phase": self.phase,
            "ram_gib": self.ram_gib,
            "limit_gib": None if self.limit_gib is None else round(self.limit_gib, 2),
            "fits": self.fits,
        }


def host_memory(model: ModelSpec, plan: Plan, hardware: HardwareProfile, ram_gib: float | None = None) -> HostMemory:
    """Peak host RAM per node: the larger of the loading phase (every rank without ZeRO-3 loads the whole model)
    and the training phase (DeepSpeed's offloaded states per rank), plus the launcher processes. Coefficients
    measured on the H200 (catalog/memory_model.yaml)."""
    c = coefficients()["host"]
    ranks = max(1, plan.world_size // max(1, plan.nodes))
    partition = model.num_params / plan.world_size
    runtime = {
        "launcher (lfa, llamafactory-cli, torchrun)": c["launcher_gib_per_node"],
        "trainer runtime (Python, torch, CUDA, data) x ranks": c["runtime_gib_per_rank"] * ranks,
    }
    loading = dict(runtime)
    host_load = plan.strategy.host_load
    if host_load == "rank 0" and not plan.on_cpu:  # FSDP2's cpu_ram_efficient_loading: the others receive
        loading["model load (rank 0)"] = c["load_bytes_per_param"] * model.num_params / GIB
    elif host_load != "partitioned":  # ZeRO-3's zero.Init partitions while loading
        loading["model load x ranks"] = c["load_bytes_per_param"] * model.num_params * ranks / GIB
    training = dict(runtime)
    if plan.offloads_to_nvme:
        training.update({f"{k} x ranks": v * ranks / GIB for k, v in nvme_host_bytes(model, plan).items()})
    elif plan.offloads_optimizer and plan.deepspeed:
        per_param = c["zero3_offload_bytes_per_param" if plan.shards_parameters else "zero2_offload_bytes_per_param"]
        training["offloaded optimizer states (fp32 master, grads, Adam) x ranks"] = per_param * partition * ranks / GIB
        if not plan.shards_parameters and plan.grad_accum > 1:
            training["pinned 16-bit accumulation buffers x ranks"] = (
                c["accumulation_bytes_per_param"] * partition * ranks / GIB
            )
    phase, items = max((("loading", loading), ("training", training)), key=lambda kv: sum(kv[1].values()))
    ram = ram_gib if ram_gib is not None else (hardware.ram_gib or None)
    return HostMemory(items=items, phase=phase, ram_gib=ram, headroom=c["headroom"])


@dataclass(frozen=True)
class NvmeSettings:
    """What lfa writes into the DeepSpeed JSON of an NVMe offload plan (catalog/memory_model.yaml: nvme)."""

    sub_group_size: int
    optimizer_buffer_count: int
    param_buffer_count: int
    param_buffer_size: int  # elements; at least the largest parameter tensor
    param_max_in_cpu: int
    aio_block_size: int
    aio_queue_depth: int
    aio_intra_op_parallelism: int


def nvme_settings(model: ModelSpec) -> NvmeSettings:
    c = coefficients()["nvme"]
    largest_tensor = model.largest_tensor_params
    return NvmeSettings(
        sub_group_size=int(c["sub_group_size"]),
        optimizer_buffer_count=int(c["optimizer_buffer_count"]),
        param_buffer_count=int(c["param_buffer_count"]),
        param_buffer_size=int(max(c["param_buffer_elements"], largest_tensor)),
        param_max_in_cpu=int(c["param_max_in_cpu"]),
        aio_block_size=int(c["aio_block_size"]),
        aio_queue_depth=int(c["aio_queue_depth"]),
        aio_intra_op_parallelism=int(c["aio_intra_op_parallelism"]),
    )


def nvme_host_bytes(model: ModelSpec, plan: Plan) -> dict[str, float]:
    """Host memory of one rank under NVMe offload (bytes): buffers by construction from DeepSpeed 0.19.8's code, the
    per-parameter part fitted on two H200 runs (catalog/memory_model.yaml nvme)."""
    settings = nvme_settings(model)
    partition = model.num_params / plan.world_size
    sub_group = min(settings.sub_group_size, partition)
    per_param = coefficients()["nvme"]["host_bytes_per_param"]
    items = {
        "pinned 16-bit gradient partition and ZeRO-3 offload bookkeeping (fitted)": per_param * partition,
        "pinned fp32 NVMe swap buffers (optimizer)": settings.optimizer_buffer_count * sub_group * 4.0,
        "fp32 gradients of one sub-group on their way to the disk": sub_group * 4.0,
    }
    if plan.offloads_parameters:
        items["pinned 16-bit NVMe swap buffers (parameters)"] = (
            settings.param_buffer_count * settings.param_buffer_size * 2.0
        )
        items["16-bit parameters kept in host memory (max_in_cpu)"] = min(settings.param_max_in_cpu, partition) * 2.0
    return items


def disk_gib(model: ModelSpec, plan: Plan) -> float:
    """Disk one node's NVMe offload swaps to (GiB); 0 for every other plan."""
    if not plan.offloads_to_nvme:
        return 0.0
    c = coefficients()["nvme"]
    per_param = c["disk_bytes_per_param_optimizer"] + (
        c["disk_bytes_per_param_parameters"] if plan.offloads_parameters else 0.0
    )
    ranks = max(1, plan.world_size // max(1, plan.nodes))
    return per_param * model.num_params / plan.world_size * ranks / GIB


def disk_limit_gib(free_gib: float) -> float:
    return free_gib * (1.0 - coefficients()["nvme"]["disk_headroom"])


def fit_activation_scale(model: ModelSpec, plan: Plan, seq_len: int, needed_allocated_gib: float) -> float:
    """The activation_scale at which `plan` is predicted to allocate at least needed_allocated_gib (what an OOM
    showed it needed); 1.0 when the model already predicts that much. Never below 1: an OOM is a lower bound."""
    predicted = estimate(model, plan, seq_len, None)
    states, _ = _model_states(model, plan)
    activations = sum(_peak_phase(model, plan, seq_len, states).activations.values()) / GIB
    if predicted.allocated_gib >= needed_allocated_gib or activations <= 0:
        return 1.0
    return 1.0 + (needed_allocated_gib - predicted.allocated_gib) / activations


def checkpoint_gib(model: ModelSpec, plan: Plan) -> float:
    """Disk one checkpoint takes: the weights as the Trainer holds them (fp32 after LLaMA-Factory's upcast; 16-bit
    under DeepSpeed) and the optimizer state (Adam m, v in fp32; DeepSpeed also keeps its fp32 master copy)."""
    per_param = 2.0 + 12.0 if plan.deepspeed else 4.0 + 8.0
    return per_param * model.num_params / GIB
