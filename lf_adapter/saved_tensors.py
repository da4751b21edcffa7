"""What autograd keeps per token for the backward of one decoder layer, tensor by tensor, from the architecture
(bench/README.md "Activations by construction"). Pure functions; memory.py turns them into GiB."""

from __future__ import annotations

from typing import Literal

from .model_spec import ModelSpec

SIXTEEN_BIT = 2.0
FP32 = 4.0


def _norm_bytes(model: ModelSpec, liger: bool, input_bytes: float) -> float:
    """Per element of a norm's input: liger's RMSNorm and torch's LayerNorm keep the input itself; the modeling
    code's RMSNorm keeps an fp32 copy (the input when it is fp32 already) and the normalized input in its dtype."""
    if liger or model.layer_norm:
        return input_bytes
    return FP32 + input_bytes


# how the attention keeps its tensors: padded SDPA (k and v at the key-value heads' width, its output transposed
# into a copy for o_proj), lfa's varlen path (k and v repeated to the query heads by padding_free._repeat_kv, its
# [tokens, heads, dim] output is o_proj's input itself; a torch whose kernel takes enable_gqa keeps them unrepeated,
# still priced repeated: not measured yet), eager (transformers' repeat_kv copies, a transposed copy);
# the flash-attn package's padded path (fa2) is priced as sdpa
AttentionPath = Literal["sdpa", "varlen", "eager"]


def saved_tensors_per_token(
    model: ModelSpec, sixteen_bit_model: bool, liger: bool, attention: AttentionPath = "sdpa"
) -> dict[str, float]:
    """Bytes per token of each tensor one decoder layer keeps. Under autocast over fp32 weights (sixteen_bit_model
    False) the residual stream and the norms' outputs are fp32, and every linear reading them keeps its own 16-bit
    cast of its input; a 16-bit model's linears share their 16-bit input."""
    h, f = model.hidden_size, model.intermediate_size
    q, kv = model.q_width, model.kv_width
    kv_kept = kv if attention == "sdpa" else q
    residual = SIXTEEN_BIT if sixteen_bit_model else FP32
    qkv_inputs = 1 if sixteen_bit_model else model.qkv_projections
    mlp_inputs = 1 if sixteen_bit_model else model.mlp_input_projections
    tensors = {
        "norms before attention and MLP (their inputs)": 2 * _norm_bytes(model, liger, residual) * h,
        "16-bit inputs of q/k/v": SIXTEEN_BIT * h * qkv_inputs,
        "attention kernel's q, k, v and output": SIXTEEN_BIT * (2 * q + 2 * kv_kept),
        "16-bit inputs of the MLP": SIXTEEN_BIT * h * mlp_inputs,
    }
    if attention != "varlen":
        tensors["o_proj input (the attention output, made contiguous)"] = SIXTEEN_BIT * q
    if model.qkv_projections == 1 and kv_kept == kv:  # v is a view into the fused q/k/v output, kept alive with it
        tensors["the fused q/k/v output (v's storage)"] = SIXTEEN_BIT * (q + kv)
    if model.qk_norm:  # applied to the 16-bit projections' outputs
        tensors["q/k norms"] = _norm_bytes(model, liger, SIXTEEN_BIT) * (q + kv)
    if model.norms_per_layer > 2:  # after the attention and the MLP, on their 16-bit outputs
        tensors["norms after attention and MLP"] = (
            (model.norms_per_layer - 2) * _norm_bytes(model, liger, SIXTEEN_BIT) * h
        )
    if not model.gated_mlp:
        tensors["MLP: up's output, its activation"] = 2 * SIXTEEN_BIT * f
    elif liger:
        tensors["MLP: gate and up (liger's fused SwiGLU), down's input"] = 3 * SIXTEEN_BIT * f
    else:
        tensors["MLP: gate, its activation, up, down's input"] = 4 * SIXTEEN_BIT * f
    return tensors
