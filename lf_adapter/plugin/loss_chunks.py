"""How many rows each chunk of liger's fused linear cross-entropy takes (LFA_LOSS_CHUNK_ROWS). Liger bounds a
chunk's logits to about as many elements as the micro-batch's hidden states (rows: tokens / ceil(V / h)), so a
micro-batch of 8,192 tokens under a 128k vocabulary runs 32 chunks of 256 rows, and every chunk reads the whole
lm_head weight twice and reads and writes its fp32 gradient once: memory-bound GEMMs whose cost grows with the
vocabulary, not the tokens. lfa asks for chunks of at least MIN_ROWS rows (liger's chunk_mem_const), which keeps
the GEMMs compute-bound for a few hundred MB of logits; the memory model prices the chunk these functions give.
Pure functions, imported by the memory model and the plugin alike (no torch)."""

from __future__ import annotations

import math

from . import run_kernels

# a chunk's weight-gradient GEMM (fp32 accumulator, 8 B per weight) is compute-bound from about 1k rows
MIN_ROWS = run_kernels.KernelChoices().loss_chunk_min_rows


def chunk_mem_const(vocab: int, hidden: int, tokens: int, min_rows: int = MIN_ROWS) -> int:
    """The smallest liger chunk_mem_const whose chunks (of a micro-batch of `tokens`) have at least min_rows rows,
    or all the tokens; 1 (liger's own chunks) when min_rows is 0."""
    const = 1
    while min_rows > 0 and chunk_rows(vocab, hidden, tokens, const) < min(min_rows, tokens):
        const += 1  # rows grow with it; at ceil(V / h) one chunk takes every token
    return const


def chunk_rows(vocab: int, hidden: int, tokens: int, mem_const: int = 1) -> int:
    """Rows of one chunk over a micro-batch of `tokens` (liger 0.8.5, ops/fused_linear_cross_entropy.py):
    tokens / ceil(V / (mem_const x h)), up to a power of two, at most the tokens."""
    tokens = max(1, math.ceil(tokens))
    per_chunk = math.ceil(tokens / math.ceil(vocab / (mem_const * hidden)))
    return min(1 << max(0, per_chunk - 1).bit_length(), tokens)


def planned_chunk_rows(vocab: int, hidden: int, tokens: float) -> int:
    """Rows of one chunk as lfa's plugin runs liger: at least MIN_ROWS where the micro-batch has them (or as a
    measurement being repriced ran: run_kernels.measured_with)."""
    tokens = max(1, math.ceil(tokens))
    min_rows = run_kernels.priced().loss_chunk_min_rows
    return chunk_rows(vocab, hidden, tokens, chunk_mem_const(vocab, hidden, tokens, min_rows))


def min_rows_from_env(value: str | None) -> int:
    """LFA_LOSS_CHUNK_ROWS: unset -> MIN_ROWS, "0" -> liger's own chunks, N -> N; anything else -> MIN_ROWS."""
    if value is None or not value.strip():
        return MIN_ROWS
    try:
        return max(0, int(value))
    except ValueError:
        return MIN_ROWS


def _liger_takes_chunk_mem_const() -> bool:
    import inspect

    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    from liger_kernel.transformers import functional

    parameters = inspect.signature(functional.liger_fused_linear_cross_entropy).parameters
    return "chunk_mem_const" in parameters and bool(
        getattr(LigerFusedLinearCrossEntropyFunction, "supports_inner_impl_dispatch", False)
    )


def install(fp32_lm_head_gradient: bool = False) -> str | None:
    """Wrap liger's fixed_fused_linear_cross_entropy (which its LigerForCausalLMLoss calls by module name): chunks
    of at least LFA_LOSS_CHUNK_ROWS rows, and with fp32_lm_head_gradient (master weights: a 16-bit lm_head) the
    lm_head's gradient summed over the chunks in fp32, as over fp32 weights. What it did, for the log; None without
    liger."""
    import os

    try:
        from liger_kernel.transformers.model import loss_utils
    except ImportError:
        return None
    from . import contract

    original = loss_utils.fixed_fused_linear_cross_entropy
    original = getattr(original, "_lfa_original", original)  # a second trainer in the process wraps liger's own
    min_rows = min_rows_from_env(os.environ.get(contract.LOSS_CHUNK_ROWS))
    if min_rows and not _liger_takes_chunk_mem_const():
        min_rows = 0

    def fixed_fused_linear_cross_entropy(hidden_states, lm_head_weight, *args, accum_dtype=None, **kwargs):
        if fp32_lm_head_gradient and accum_dtype is None:
            import torch

            accum_dtype = torch.float32
        if min_rows and "chunk_mem_const" not in kwargs:
            hidden = hidden_states.shape[-1]
            kwargs["chunk_mem_const"] = chunk_mem_const(
                lm_head_weight.shape[0], hidden, hidden_states.numel() // hidden, min_rows
            )
        return original(hidden_states, lm_head_weight, *args, accum_dtype=accum_dtype, **kwargs)

    fixed_fused_linear_cross_entropy._lfa_original = original
    loss_utils.fixed_fused_linear_cross_entropy = fixed_fused_linear_cross_entropy
    chunks = f"chunks of at least {min_rows} rows" if min_rows else "liger's own chunks"
    return chunks + (", the lm_head gradient summed in fp32" if fp32_lm_head_gradient else "")
