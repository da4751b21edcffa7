"""The throughput model: predicted non-pad tokens per second of a plan on a machine (coefficients in
catalog/memory_model.yaml, fitted in bench/README.md), and what a prediction rests on."""

from __future__ import annotations

import math

from . import UserError
from .hardware import GPUSpec, HardwareProfile
from .memory import badam_block_params, coefficients, layer_norms_run_in_fp32, liger_loss_chunk_rows
from .model_spec import FUSED_GATE_UP, FUSED_QKV, ModelSpec
from .plan import Plan
from .plugin import run_kernels, token_budget
from .quoting import comment_text
from .strategy import Offload, Optimizer

# master weights (lfa plugin), by construction: each micro-batch adds the 16-bit weight gradients into the fp32
# masters' (read 2 + 4 bytes, write 4); each step copies the masters back into the 16-bit model (read 4, write 2).
# Memory-bound, so priced at the streaming rate like the other byte counts (the add measured 68% of the H100's
# datasheet bandwidth in Gemma-2's session-37 profile; the datasheet rate under-priced it by a third)
MASTER_ACCUMULATE_BYTES_PER_PARAM = 10.0
MASTER_COPY_BACK_BYTES_PER_PARAM = 6.0
# the decoder's linear weights whose GEMM adds into the fp32 gradient (run_kernels.fused_weight_gradients): what that
# costs over a 16-bit GEMM output, in bytes per parameter at the streaming rate. MEASURED on the 6.7B's linears at
# 4,096 tokens (bench/wgrad_check.py, H200, session 38): 75.43 ms against the hook path's 91.50, of which the add
# was priced 22.49 ms at 10 bytes: (75.43 - 91.50 + 22.49) / 22.49 x 10. Checked in training (session 40, H100s):
# the 6.7B's layers +1.2-2.1% against the hook (priced +2.0%), the capped 1.3B +1.1% (priced +1.3%)
FUSED_ACCUMULATE_BYTES_PER_PARAM = 2.85


def _once_per_step_s(model: ModelSpec, plan: Plan, hardware: HardwareProfile) -> float:
    """What an optimizer step costs once, after its micro-batches: the Adam update, NVMe or CPU offload and the
    gradient exchange between processes."""
    t = coefficients()["throughput"]
    gpu = hardware.gpu
    partition = model.num_params / (plan.world_size if plan.shards_optimizer else 1)
    updated = badam_block_params(model) if plan.optimizer == Optimizer.BADAM else partition  # BAdam steps one block
    hbm = datasheet_bytes_per_s(gpu.hbm_tbps)  # what the per-parameter terms were fitted against
    seconds = t["optimizer_bytes_per_param"] * updated / hbm
    if plan.master_weights:
        seconds += MASTER_COPY_BACK_BYTES_PER_PARAM * updated / streaming_bytes_per_s(gpu.hbm_tbps)
    if plan.offloads_to_nvme:
        seconds += nvme_step_s(model, plan, hardware)
    if plan.offloads_optimizer:  # CPU Adam over the partition; 16-bit gradients down and parameters back up
        link = host_link_bytes_per_s(hardware)
        seconds += partition / t["cpu_adam_params_per_s"] + 2 * 2.0 * partition / link
        if not plan.shards_parameters and plan.grad_accum > 1:
            # ZeRO-1/2 offload accumulates in pinned host buffers: after the first micro-batch each one copies the
            # running sum up, adds its gradients and copies it back down (stage_1_and_2.py,
            # async_accumulate_grad_in_cpu_via_gpu)
            seconds += (plan.grad_accum - 1) * 2 * 2.0 * partition / link
        elif plan.shards_parameters and plan.grad_accum > 1:
            # ZeRO-3 offload adds every micro-batch's gradient partition into the fp32 host copy (a CPU pass)
            seconds += (plan.grad_accum - 1) * partition / t["zero3_offload_accumulate_params_per_s"]
    if plan.world_size > 1:
        seconds += 2.0 * model.num_params * 2 * (plan.world_size - 1) / plan.world_size / _link_bytes_per_s(hardware)
    return seconds


def predict_tokens_per_s(
    model: ModelSpec,
    plan: Plan,
    hardware: HardwareProfile,
    seq_len: int,
    mean_seq_fraction: float,
    length_quantiles: tuple[float, ...] = (),
) -> float:
    """Throughput model (coefficients in catalog/memory_model.yaml, fitted in bench/README.md): the CPU launches
    a micro-batch's kernels while the GPU runs the previous ones, so a micro-batch takes the longer of the two;
    then the optimizer step, DeepSpeed offload and gradient exchange once per step. length_quantiles: the data's
    row-length profile (data.length_quantiles), where lfa generate read the data."""
    if hardware.has_gpu and not hardware.gpu.peak_tflops_16bit > 0:
        raise UserError(
            f"lfa does not know the {comment_text(hardware.gpu.name)[:80]}'s dense 16-bit TFLOP/s, which plans are "
            "priced by: save a profile (lfa detect --save my-gpu.yaml), set gpu.peak_tflops_16bit and gpu.hbm_tbps "
            "from the card's datasheet, and pass --hardware my-gpu.yaml"
        )
    t = coefficients()["throughput"]
    fill = 0.98 if plan.packing else mean_seq_fraction
    # without packing a micro-batch is padded to its longest row: about cutoff_len unless it is a single row, or
    # the step's rows were sorted by length so that each micro-batch holds rows of similar length (token budgets
    # group them longest first too)
    micro_batches = None
    if plan.packing or plan.padding_free or (plan.micro_batch_size == 1 and not plan.token_budget):
        padded_len = seq_len if plan.packing else seq_len * mean_seq_fraction  # padding-free: no padding at all
    elif (plan.sorted_steps or plan.token_budget) and length_quantiles:
        padded_len, micro_batches = sorted_step_padding(plan, length_quantiles, seq_len)
    elif plan.sorted_steps or plan.token_budget:
        padded_len = seq_len * (mean_seq_fraction + t["sorted_padding_residual"] * (1.0 - mean_seq_fraction))
    else:
        padded_len = seq_len
    rows = plan.micro_batch_size * plan.grad_accum  # one optimizer step's rows on one process
    if micro_batches is None:
        micro_batches = micro_batches_per_step(plan, padded_len)
    real_tokens = rows * seq_len * fill / micro_batches  # per micro-batch, on average
    badam = plan.optimizer == Optimizer.BADAM
    flops = rows * padded_len / micro_batches * model.flops_per_token(seq_len, weight_gradients=not badam)
    # BAdam: LLaMA-Factory recomputes only the trainable layer (memory.badam_graph_layers), so no recompute is priced
    recomputed = 0.0 if badam else plan.checkpointed_layers(model.num_layers) / model.num_layers
    recompute_flops = rows * padded_len / micro_batches * recomputed * model.layer_forward_flops_per_token(seq_len)
    if not hardware.has_gpu:
        return real_tokens / ((flops + recompute_flops) / t["cpu_flops"])
    gpu = hardware.gpu
    rate = gpu.peak_tflops_16bit * 1e12 * (t["fp32_fraction_of_peak"] if plan.precision == "fp32" else t["mfu_max"])
    if plan.padding_free:  # one flattened row of varying length per micro-batch
        rate *= t["padding_free_shape_efficiency"]
    elif not plan.packing:  # a new shape every micro-batch runs below the fixed-shape rate
        rate *= t["variable_shape_efficiency"]
    if not plan.liger and plan.precision != "fp32":
        rate *= t["no_liger_gpu_efficiency"]
    widening = layer_width(model) / t["fitted_hidden_size"]
    # wider layers: larger GEMMs, and the memory-bound elementwise work shrinks relative to the matmuls (the rates
    # above were fitted at hidden 2048); never above the fixed-shape rate
    rate = min(rate * widening ** t["width_rate_exponent"], gpu.peak_tflops_16bit * 1e12 * t["mfu_max"])
    if plan.precision != "fp32":
        rate /= sub_cap_time_factor(rate, gpu)
    # the checkpointed layers' forward again at the same rate (their GEMMs, attention and norms; not the lm_head, the
    # loss or the optimizer): by construction, checked on same-budget sweeps (bench/README.md, session 29)
    gpu_s = (flops + recompute_flops) / rate
    padded_tokens = rows * padded_len / micro_batches
    if plan.attention == "eager":
        gpu_s += eager_scores_s(model, plan, padded_tokens, padded_len, recomputed, gpu.hbm_tbps)
    if plan.liger and plan.precision != "fp32":
        gpu_s += fused_loss_walk_s(model, plan, padded_tokens, rate, gpu.hbm_tbps)
    elif plan.precision != "fp32":
        gpu_s += unfused_loss_walk_s(model, padded_tokens, gpu.hbm_tbps)
    if plan.precision != "fp32":
        gpu_s += fused_projection_copies_s(model, plan, padded_tokens, recomputed, gpu.hbm_tbps)
        gpu_s += attention_row_copies_s(model, plan, padded_tokens, gpu.hbm_tbps)
    hbm = datasheet_bytes_per_s(gpu.hbm_tbps)  # what the per-parameter terms were fitted against
    if plan.master_weights:
        gpu_s += master_accumulate_bytes(model) / streaming_bytes_per_s(gpu.hbm_tbps)
        if not layer_norms_run_in_fp32(model, plan):
            # the rates were fitted under autocast, whose residual stream is fp32: a 16-bit model does not move those
            # bytes (per token, hidden unit and layer; forward and backward; autocast's recompute is priced below)
            residual = t["autocast_residual_bytes"] * padded_tokens * model.hidden_size * model.num_layers
            gpu_s -= min(residual / hbm, gpu_s / 2)  # never more than half (the 1.3B's elementwise was 23%)
    elif not plan.deepspeed and plan.precision != "fp32" and not badam:
        # memory-bound work per micro-batch that grows with the model, not the tokens: autocast casts the fp32
        # weights to 16 bits (again for recomputed layers) and the 16-bit weight gradients are added into fp32 ones
        gpu_s += t["micro_batch_bytes_per_param"] * model.num_params / hbm
    if plan.precision in ("bf16", "fp16") and (not plan.sixteen_bit_model or layer_norms_run_in_fp32(model, plan)):
        # autocast's recompute walks the fp32 residual stream again: casts, fp32 norms and adds, per checkpointed layer
        again = t["autocast_recompute_bytes"] * recomputed * padded_tokens * model.hidden_size * model.num_layers
        gpu_s += again / hbm
    cpu_s = t["launch_s_per_layer"] * model.num_layers * (1.0 + (t["checkpointing_launch_factor"] - 1.0) * recomputed)
    zero3_fetch_s = 0.0  # ZeRO-3 / FSDP2 gather every layer's 16-bit parameters for the forward and the backward
    if plan.shards_parameters:  # per-module hooks cost time even when there is nothing to gather
        # FSDP2 uses ZeRO-3's measured hook cost until it is measured itself (speed_basis says so)
        zero3_fetch_s += t["zero3_hook_s_per_layer"] * model.num_layers
    if plan.offloads_parameters and plan.offloads_to_nvme:  # every layer read from the disk, forward and backward
        zero3_fetch_s += 2 * 2.0 * model.num_params / disk_bytes_per_s(hardware)[0]
    elif plan.offloads_parameters:
        zero3_fetch_s += 2 * 2.0 * model.num_params / host_link_bytes_per_s(hardware)
    elif plan.shards_parameters and plan.world_size > 1:
        zero3_fetch_s += 2 * 2.0 * model.num_params / _link_bytes_per_s(hardware)
    step_s = micro_batches * (max(cpu_s, gpu_s) + zero3_fetch_s)
    step_s += _once_per_step_s(model, plan, hardware)
    return real_tokens * micro_batches * plan.world_size / step_s


def master_accumulate_bytes(model: ModelSpec) -> float:
    """Bytes one micro-batch moves to add its weight gradients into the fp32 masters': the fused GEMM's extra for the
    decoder's linear weights where the run fuses them, the hook's add for the rest (embeddings, norms, biases)."""
    fused = model.num_layers * model.linear_weights_per_layer if run_kernels.priced().fused_weight_gradients else 0
    return FUSED_ACCUMULATE_BYTES_PER_PARAM * fused + MASTER_ACCUMULATE_BYTES_PER_PARAM * (model.num_params - fused)


def sub_cap_time_factor(rate: float, gpu: GPUSpec) -> float:
    """The 16-bit rates below the fixed-shape one (mfu_max) lose their difference to memory-bound work: varying
    shapes, kernels liger would fuse, a narrow layer's elementwise share. That share of the time scales with the
    card's FLOPs per byte of bandwidth against the reference card's (catalog/memory_model.yaml), within the range
    measured (a card outside it is priced as the nearest measured one); a rate at the cap is GEMM-bound and keeps its
    time. The factor the time is multiplied by: 1 on the reference card."""
    t = coefficients()["throughput"]
    share = max(0.0, 1.0 - rate / (gpu.peak_tflops_16bit * 1e12 * t["mfu_max"]))
    reference = t["sub_cap_reference_flops_per_byte"]
    flops_per_byte = gpu.peak_tflops_16bit * 1e12 / datasheet_bytes_per_s(gpu.hbm_tbps)
    flops_per_byte = min(max(flops_per_byte, t["sub_cap_lowest_checked_flops_per_byte"]), reference)
    return (1.0 - share) + share * flops_per_byte / reference


def layer_width(model: ModelSpec) -> float:
    """The hidden size of the Llama-shaped layer (as many query as key-value heads, a gated MLP of 8/3 x hidden:
    12 h^2 weights) with as many weights as this model's layer, never below the hidden size: a layer's GEMM work per
    token against the elementwise work along its residual stream. The hidden size on the fitted DeepSeek shapes
    (2,053 and 4,107 for 2,048 and 4,096); wider for a wide MLP (Qwen2.5-Coder-3B: 2,534 at 2,048). Fewer
    key-value heads or an ungated MLP do not narrow it (StarCoder2 and Llama-3.2-3B keep 3,072: narrowed, their
    rows moved 4-5% away from the measurements)."""
    return max(float(model.hidden_size), math.sqrt(model.params_per_layer / 12.0))


def fused_loss_walk_s(model: ModelSpec, plan: Plan, tokens: float, rate: float, hbm_tbps: float) -> float:
    """Liger's fused linear cross-entropy runs the lm_head over a micro-batch in chunks (memory.liger_loss_chunk_rows)
    and each chunk's three GEMMs read the whole lm_head weight or its gradient (bytes per weight element in
    catalog/memory_model.yaml); a GEMM takes the longer of its FLOPs and its bytes, so below a thousand rows or so
    they are memory-bound. The time beyond the FLOPs already priced: the memory-bound GEMMs' excess and autocast's
    cast of the weight in every chunk (large vocabularies under small chunks; lfa's plugin asks for chunks of at
    least 2,048 rows, where the GEMMs are compute-bound)."""
    chunk_rows = liger_loss_chunk_rows(model, tokens)
    chunks = math.ceil(max(1.0, tokens) / chunk_rows)
    weight = model.vocab_size * model.hidden_size
    per_element = coefficients()["throughput"]["fused_loss_bytes_per_weight_per_chunk"]
    path = "master" if plan.master_weights else "sixteen_bit" if plan.sixteen_bit_model else "autocast"
    cast, *gemms = per_element[path]
    streaming = streaming_bytes_per_s(hbm_tbps)
    gemm_s = 2.0 * chunk_rows * weight / rate  # each of the three
    excess = cast * weight / streaming + sum(max(0.0, b * weight / streaming - gemm_s) for b in gemms)
    return chunks * excess


def unfused_loss_walk_s(model: ModelSpec, tokens: float, hbm_tbps: float) -> float:
    """Without liger the logits are materialized (tokens x vocabulary) and walked by elementwise kernels: the fp32
    upcast, log-softmax and its backward, and a final soft-capping's divide, tanh and multiply (Gemma-2); bytes per
    logit in catalog/memory_model.yaml, by construction from transformers' ForCausalLMLoss. Memory-bound: the
    bytes over the streaming rate."""
    per_logit = coefficients()["throughput"]["unfused_loss_bytes_per_logit"]
    walked = per_logit["loss"] + (per_logit["softcap"] if model.final_softcap else 0.0)
    return tokens * model.vocab_size * walked / streaming_bytes_per_s(hbm_tbps)


def fused_projection_copies_s(model: ModelSpec, plan: Plan, tokens: float, recomputed: float, hbm_tbps: float) -> float:
    """Families whose q/k/v come out of one projection (Phi-3) slice it into strided views: liger's RoPE copies q
    and k to contiguous tensors in each forward, and autograd gives each slice's gradient a zero-filled tensor of the
    whole projection's width (write 2, then the slice copied in: read and write 2 each) and adds the three (read 4,
    write 2, twice). A fused gate/up MLP under liger's chunked SwiGLU copies both halves in each forward and
    concatenates their gradients; lfa's plugin runs liger's fused gate-up function instead (no copies). 16-bit bytes
    by construction from transformers' Phi3Attention and liger 0.8.5's rope/swiglu; memory-bound."""
    q, kv = model.q_width, model.kv_width
    forward = backward = 0.0
    if model.arch in FUSED_QKV and plan.liger:
        forward += 4.0 * (q + kv)
        width = q + 2 * kv
        backward += 3 * 2.0 * width + 4.0 * width + 2 * 6.0 * width
    if model.arch in FUSED_GATE_UP and plan.liger and not run_kernels.priced().fused_gate_up:
        forward += 8.0 * model.intermediate_size
        backward += 8.0 * model.intermediate_size
    per_token = model.num_layers * (forward * (1.0 + recomputed) + backward)
    return tokens * per_token / streaming_bytes_per_s(hbm_tbps)


def attention_row_copies_s(model: ModelSpec, plan: Plan, tokens: float, hbm_tbps: float) -> float:
    """Before session 30 lfa's varlen attention took its one row by indexing (run_kernels.attention_row_view off):
    the backward wrote q's, k's and v's gradients into zero-filled [1, heads, tokens, dim] tensors, and liger's
    RoPE and v's reshape copied them back: two strided copies per tensor, per layer and micro-batch, 16-bit reads
    and writes of 2 bytes per element (by construction; the zero-fills are not priced). Strided copies run below
    the streaming rate: their rate is measured (catalog/memory_model.yaml). The squeeze keeps the gradients views."""
    if not plan.padding_free or run_kernels.priced().attention_row_view:
        return 0.0
    elements = model.q_width + 2 * model.kv_width  # q, k and v per token
    copy_rate = datasheet_bytes_per_s(hbm_tbps) * coefficients()["throughput"]["strided_copy_bandwidth_fraction"]
    return 2 * 4.0 * elements * tokens * model.num_layers / copy_rate


def eager_scores_s(
    model: ModelSpec, plan: Plan, tokens: float, row_len: float, recomputed: float, hbm_tbps: float
) -> float:
    """Eager attention materializes each layer's scores (heads x queries x keys) and walks them with elementwise
    kernels: scale, soft-capping, mask, fp32 softmax, the 16-bit cast, forward and backward (bytes per score in
    catalog/memory_model.yaml, by construction from transformers' eager_attention_forward); the checkpointed layers
    run the forward again. Memory-bound: the score bytes over the streaming rate."""
    per_score = coefficients()["throughput"]["eager_bytes_per_score"]
    forward, backward = per_score["sixteen_bit" if plan.sixteen_bit_model else "autocast"]
    if model.attention_softcap:
        forward, backward = forward + per_score["softcap"][0], backward + per_score["softcap"][1]
    scores = model.num_layers * model.num_heads * tokens * row_len  # each row's length squared, summed
    return scores * (forward * (1.0 + recomputed) + backward) / streaming_bytes_per_s(hbm_tbps)


def datasheet_bytes_per_s(hbm_tbps: float) -> float:
    """A profile's datasheet bandwidth in bytes per second (at least 0.5 TB/s where a profile gives less or none)."""
    return max(hbm_tbps, 0.5) * 1e12


def streaming_bytes_per_s(hbm_tbps: float) -> float:
    """What memory-bound kernels reach of the datasheet bandwidth (measured on the H100, catalog/memory_model.yaml)."""
    return datasheet_bytes_per_s(hbm_tbps) * coefficients()["throughput"]["streaming_bandwidth_fraction"]


def sorted_step_padding(plan: Plan, length_quantiles: tuple[float, ...], seq_len: int) -> tuple[float, float]:
    """(padded tokens per row, micro-batches per step) of a padded plan whose steps are sorted or cut by a token
    budget, by construction: the plugin's own grouping (token_budget.group_rows, or consecutive rows of
    micro_batch_size, each as wide as its longest row rounded up to 8) run on a typical step, whose rows are the
    data's expected order statistics (row i of n at quantile 1 - (i + 1/2) / n). The padding grows with the rows
    per micro-batch (pseudo2norm-shaped data: 2.6% at mbs2 / 4,096 tokens, 18% at mbs16 / 49,152; 400 simulated
    steps of the bench's data agree within a point: bench/README.md, session 39)."""
    rows = plan.micro_batch_size * plan.grad_accum
    steps = len(length_quantiles) - 1

    def at(p: float) -> float:  # linear between the profile's points
        x = min(max(p, 0.0), 1.0) * steps
        i = min(int(x), steps - 1)
        return length_quantiles[i] + (length_quantiles[i + 1] - length_quantiles[i]) * (x - i)

    step = [max(1, round(seq_len * at(1.0 - (i + 0.5) / rows))) for i in range(rows)]
    full, multiple = max(step), token_budget.PAD_MULTIPLE
    if plan.token_budget:  # the plugin trims each cut micro-batch (to a multiple of 8 since session 36)
        multiple = multiple if run_kernels.priced().padded_width_aligned else 1
        groups = token_budget.group_rows(step, plan.token_budget, False, full, multiple)
    else:  # LLaMA-Factory's collator pads each micro-batch to its longest row, a multiple of 8
        groups = [list(range(k, min(rows, k + plan.micro_batch_size))) for k in range(0, rows, plan.micro_batch_size)]
    padded = sum(token_budget.padded_width(max(step[i] for i in g), full, multiple) * len(g) for g in groups)
    return padded / rows, float(len(groups))


def micro_batches_per_step(plan: Plan, padded_len: float) -> float:
    """Micro-batches one process runs per optimizer step: grad_accum, or under a token budget the step's tokens
    over the budget plus half a micro-batch for the last, partly filled one (by construction; the plugin reports
    the real count per step as micro_batches in its events)."""
    if not plan.token_budget:
        return float(plan.grad_accum)
    rows = plan.micro_batch_size * plan.grad_accum
    return min(float(rows), max(1.0, rows * padded_len / plan.token_budget + 0.5))


def within_checked_sizes(model: ModelSpec) -> bool:
    """Whether the throughput model was checked on models of about this size (not far below the smallest)."""
    return model.num_params >= coefficients()["throughput"]["smallest_checked_params"]


def disk_bytes_per_s(hardware: HardwareProfile) -> tuple[float, float]:
    """(read, write) bytes/s of the profile's disk; the measured H200 device's disk when the profile has no rates."""
    c = coefficients()["nvme"]
    disk = hardware.disk
    if disk is not None and disk.known_rates:
        return disk.read_gbs * 1e9, disk.write_gbs * 1e9
    return c["default_read_gbs"] * 1e9, c["default_write_gbs"] * 1e9


def nvme_step_s(model: ModelSpec, plan: Plan, hardware: HardwareProfile) -> float:
    """Disk time of one optimizer step under NVMe offload (each rank swaps its partition; ranks of a node share
    the disk): every sub-group's p, m, v, g read and p, m, v, g written, not overlapped with each other or with
    CPU Adam (DeepSpeed's pipeline_read/write are off)."""
    c = coefficients()["nvme"]
    read, write = disk_bytes_per_s(hardware)
    node_params = model.num_params / max(1, plan.nodes)
    seconds = node_params * (c["step_read_bytes_per_param"] / read + c["step_write_bytes_per_param"] / write)
    if plan.offloads_parameters:  # the updated 16-bit parameters go back to the disk
        seconds += node_params * c["disk_bytes_per_param_parameters"] / write
    return seconds


def _link_bytes_per_s(hardware: HardwareProfile) -> float:
    """The slowest link a collective over every GPU crosses: inside a node NVLink or PCIe, between nodes the
    profile's internode_gbs (else a typical 100 Gb/s network, not measured)."""
    t = coefficients()["throughput"]
    link = t["nvlink_bytes_per_s"] if hardware.interconnect == "nvlink" else t["pcie_bytes_per_s"]
    if hardware.nodes > 1:
        link = min(link, hardware.internode_gbs * 1e9 if hardware.internode_gbs else t["internode_bytes_per_s"])
    return link


def host_link_bytes_per_s(hardware: HardwareProfile) -> float:
    """GPU <-> host copies (offload): the profile's PCIe rate times the share pinned copies reach, else the
    coefficient fitted on the H200."""
    t = coefficients()["throughput"]
    gbs = hardware.gpu.host_link_gbs if hardware.gpu else 0.0
    return gbs * 1e9 * t["host_link_efficiency"] if gbs else t["pcie_bytes_per_s"]


def nvme_basis(hardware: HardwareProfile) -> str:
    disk = hardware.disk
    if disk is not None and disk.known_rates:
        rates = (
            f"the profile's disk at {disk.read_gbs:g} GB/s read, {disk.write_gbs:g} GB/s write "
            f"({disk.source or 'source not given'})"
        )
    else:
        c = coefficients()["nvme"]
        rates = (
            f"no measured disk rates in the profile: the H200 device's {c['default_read_gbs']:g} / "
            f"{c['default_write_gbs']:g} GB/s (lfa detect --measure-disk --save measures yours)"
        )
    return f"NVMe offload's step streams 32 B/param through {rates}; disk model by construction (bench/README.md)"


def speed_basis(hardware: HardwareProfile, plan: Plan) -> str:
    """What a speed and wall-time prediction rests on: the throughput model was fitted on H200 runs only."""
    if not hardware.has_gpu:
        return "CPU: a rough FLOP rate, not measured"
    gpu = hardware.gpu
    basis = (
        f"throughput model fitted on one H200 (bench/README.md); {gpu.name} scaled by its datasheet "
        f"{gpu.peak_tflops_16bit:g} TFLOP/s and {gpu.hbm_tbps:g} TB/s (the memory-bound share by FLOPs per byte, "
        "checked between the H100 and the H200 only)"
    )
    if plan.offload != Offload.NONE:
        basis += f", offload over a {gpu.host_link_gbs or 'default'} GB/s host link and the H200 host's CPU Adam rate"
    if plan.offloads_to_nvme:
        basis += "; " + nvme_basis(hardware)
    if plan.strategy.speed_caveat:
        basis += "; " + plan.strategy.speed_caveat
    if hardware.nodes > 1:
        basis += (
            f"; between nodes {hardware.internode_gbs:g} GB/s (the profile's internode_gbs)"
            if hardware.internode_gbs
            else "; between nodes a typical 100 Gb/s network (not measured: declare internode_gbs in the profile)"
        )
    if "H200" in gpu.name:
        caveats = [
            text
            for applies, text in (
                (plan.offloads_to_nvme, nvme_basis(hardware)),
                (plan.offload == "all", "ZeRO-3 offload fitted on 1.3B only, 37% pessimistic at the 6.7B width"),
                (plan.padding_free, "padding-free plans measured from 2% slower to 9% faster than this"),
                (bool(plan.strategy.speed_caveat), plan.strategy.speed_caveat),
            )
            if applies
        ]
        measured = (
            "the master-weights default plans of 2026-12-07 measured 2.0% and 8.9% (1.3B, a cold and a warm Triton "
            "cache) and 2.2% (6.7B) above their prediction, the 1.3B at a 31.73 GiB cap from 1.7% below to 7.5% "
            "above; six other families' defaults from 10.3% below (Gemma-2, session 30) to 7.3% above (StarCoder2)"
            if plan.master_weights
            else "the default plans of 2026-12-04 within -7.8% (1.3B at a 31.73 GiB cap), -2.7% (1.3B) and -1.1% "
            "(6.7B width), the 350M width +0.2%"
        )
        return "; ".join([f"throughput model fitted on H200 runs (bench/README.md): {measured}", *caveats])
    if "H100 80GB HBM3" in gpu.name:  # the device's other card (SXM): the zoo's rows, sessions 21-37
        checked = (
            "session 37): the master-weights defaults of six families ran from 7.6% below (Llama-3.2-3B) to 7.1% "
            "above their prediction (StarCoder2): Qwen2.5-Coder-3B 4.1% and Qwen3-1.7B 2.8% below, Phi-3-mini 0.2% "
            "and Gemma-2 2.4-2.8% above (warm Triton cache)"
            if plan.master_weights
            else "sessions 21-26): 18 runs of six families and the 1.3B/6.7B widths ran between 8.1% below and 6.8% "
            "above their prediction"
        )
        return f"{basis}; checked on the H100 SXM (bench/README.md, {checked}"
    return basis + "; not measured on this GPU"
