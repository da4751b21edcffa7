"""Padding-free training that keeps every row separate (LFA_PADDING_FREE=1).

Each micro-batch's rows are flattened into one sequence: no compute goes to padding in the linear layers, norms
and loss. Rows never see each other: position ids restart at 0 for every row, attention is limited to each row
through the sequence boundaries (cu_seq_lens, the varlen convention of flash-attn and transformers' flattening
collator), and the label of a row's first token is -100 so that no prediction crosses a row boundary. The loss is
the same sum over the same tokens, normalized by the step's token count as before, so a step's gradient equals
the padded step's (tests/test_padding_free.py checks it on CPU).

Attention runs through transformers' AttentionInterface under the name `lfa_varlen`: torch's own varlen flash
attention on CUDA (torch >= 2.10, no extra package), and on the CPU a reference path of one causal SDPA call per row.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import NamedTuple

from . import contract

ATTENTION_NAME = "lfa_varlen"
TEXT_KEYS = {"input_ids", "attention_mask", "labels"}


def right_padding_mask(batch):
    """The [B, L] attention mask of a right-padded text batch (only text keys, ones-then-zeros in every row), else
    None: 4D masks, packed or left-padded rows, other inputs."""
    import torch

    mask = batch.get("attention_mask")
    if not torch.is_tensor(mask) or mask.dim() != 2 or not set(batch.keys()) <= TEXT_KEYS:
        return None
    if mask.size(1) > 1 and not bool((mask[:, 1:] <= mask[:, :-1]).all()):
        return None
    return mask


def flatten_batch(batch, lengths: list[int] | None = None) -> bool:
    """Flatten a right-padded text batch in place: [B, L] -> [1, sum of row lengths]. False (batch unchanged)
    when it is not one (4D masks, packed rows, other keys). lengths: the rows' lengths when the caller knows them
    (no device sync to read them); new tensors are made on the batch's device."""
    import torch

    mask = right_padding_mask(batch)
    if mask is None or "labels" not in batch:
        return False
    device = mask.device
    if lengths is None:
        lengths = mask.sum(dim=1).tolist()
    lengths = [int(n) for n in lengths if n > 0]
    counts = torch.tensor(lengths, device=device)
    ends = torch.cumsum(counts, dim=0)
    starts = ends - counts
    keep = mask.bool()
    labels = batch["labels"][keep].clone()
    labels[starts] = -100  # the previous row's last token must not be trained to predict this row's first
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = ends.to(torch.int32)
    total = sum(lengths)
    batch["input_ids"] = batch["input_ids"][keep].unsqueeze(0)
    batch["labels"] = labels.unsqueeze(0)
    # positions restart at 0 for every row
    batch["position_ids"] = (
        torch.arange(total, device=device) - torch.repeat_interleave(starts, counts, output_size=total)
    ).unsqueeze(0)
    batch["attention_mask"] = None
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu
    batch["max_length_q"] = batch["max_length_k"] = max(lengths)
    batch["lfa_nonpad_tokens"] = counts.sum()
    return True


def _repeat_kv(x, groups: int):
    return x if groups == 1 else x.repeat_interleave(groups, dim=0)  # [kv_heads, T, D] -> [heads, T, D]


def _one_row():
    """How the attention takes the flattened micro-batch's one row of [1, H, T, D]: squeezed, so that autograd hands
    the gradients back as views (indexing zero-fills a gradient of that shape and copies into it, and liger's RoPE
    copies it back to the projection's layout); LFA_ATTENTION_ROW_VIEW=0 indexes, as before session 30, to compare."""
    if os.environ.get(contract.ATTENTION_ROW_VIEW) == "0":
        return lambda x: x[0]
    return lambda x: x.squeeze(0)


def _rows_reference(query, key, value, cu, scaling, window: int | None = None):
    """One causal SDPA call per row ([H, n, D] each): the exact reference, and the CPU path. window: each token
    sees itself and at most window - 1 earlier tokens (transformers' sliding_window_overlay)."""
    import torch
    import torch.nn.functional as F

    outputs = []
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = query[:, start:end], key[:, start:end], value[:, start:end]
        if window and end - start > window:
            seen = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device)
            seen = seen.tril().triu(-(window - 1))
            outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scaling))
        else:
            outputs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling))
    return torch.cat(outputs, dim=1)


def varlen_attention_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
):
    """transformers' attention signature: query/key/value [1, heads, tokens, dim] of one flattened micro-batch;
    returns ([1, tokens, heads, dim], None). Without sequence boundaries (generation, eval) it is plain SDPA."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = query.size(1) // key.size(1)
    row = _one_row()
    q, k, v = row(query), row(key), row(value)  # [heads or key-value heads, T, D]
    # the layer's sliding window where the family has one (Phi-3, Mistral, StarCoder2), as transformers passes it
    window = kwargs.get("sliding_window") or None
    if window and int(kwargs["max_length_q"]) <= window:
        window = None  # no row is longer than the window: plain causal attention
    kernel = _kernel_for(q)
    if kernel is not None and (window is None or kernel.takes_window):
        import torch

        if q.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
            # as SDPA does under autocast: the flash kernel takes 16-bit inputs (StarCoder2's reach it in fp32)
            dtype = torch.get_autocast_dtype("cuda")
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        # causal: see no later token; within a window: at most window - 1 earlier ones too
        extra = {"window_size": (window - 1 if window else -1, 0)} if kernel.takes_window else {"is_causal": True}
        if groups > 1 and kernel.takes_gqa:  # the kernel reads each key-value head for its group: no copies
            extra["enable_gqa"] = True
        else:
            k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        out = kernel.attend(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            cu,
            cu,
            int(kwargs["max_length_q"]),
            int(kwargs["max_length_k"]),
            scale=scaling,
            **extra,
        )  # [T, H, D]
        return out.unsqueeze(0), None
    if window and kernel is not None:
        _say_once(
            "lfa: padding-free: this torch's varlen kernel takes no sliding window: rows longer than the window "
            f"({window} tokens) take the exact per-row path, slower"
        )
    out = _rows_reference(q, _repeat_kv(k, groups), _repeat_kv(v, groups), cu, scaling, window)  # [H, T, D]
    return out.transpose(0, 1).unsqueeze(0), None


class VarlenKernel(NamedTuple):
    """torch.nn.attention.varlen.varlen_attn and the keywords this torch's version of it takes."""

    attend: Callable
    takes_window: bool  # window_size (torch 2.11+), else is_causal
    takes_gqa: bool  # enable_gqa: fewer key-value heads than query heads, read without repeating them


_VARLEN: dict = {}
_SAID: set = set()


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        print(message, flush=True)


def _torch_varlen() -> VarlenKernel | None:
    """torch's varlen attention with what its signature takes, or None before torch 2.10."""
    if "fn" not in _VARLEN:
        try:
            from torch.nn.attention.varlen import varlen_attn

            takes = inspect.signature(varlen_attn).parameters
            _VARLEN["fn"] = VarlenKernel(varlen_attn, "window_size" in takes, "enable_gqa" in takes)
        except ImportError:
            _VARLEN["fn"] = None
    return _VARLEN["fn"]


_FAST_ON: dict[int, bool] = {}  # device index -> fast_kernel_on, filled before training (read under torch.compile)


def fast_kernel_on(device_index: int) -> bool:
    """Whether torch's varlen flash attention runs on this CUDA device (torch >= 2.10, sm80+); a plain dict lookup
    once asked, so that a compiled layer traces through it."""
    if device_index not in _FAST_ON:
        _FAST_ON[device_index] = _torch_varlen() is not None and _flash_capable(device_index)
    return _FAST_ON[device_index]


def _kernel_for(q) -> VarlenKernel | None:
    """torch's varlen kernel for q's device, or None (the per-row path)."""
    return _VARLEN["fn"] if q.is_cuda and fast_kernel_on(q.device.index or 0) else None


def _flash_capable(device_index: int) -> bool:
    """torch's varlen attention is Flash Attention: sm80+ (a V100 takes the per-row SDPA path, exact and slower)."""
    import torch

    return torch.cuda.get_device_capability(device_index) >= (8, 0)


@functools.lru_cache(maxsize=1)
def supported() -> bool:
    """transformers' AttentionInterface and AttentionMaskInterface (4.53+): without them the rows would not be kept
    apart, so the collator must not flatten either."""
    try:
        from transformers import AttentionInterface  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401
    except ImportError:
        return False
    return True


def no_mask(*args, **kwargs):
    """The mask interface for lfa_varlen: rows are kept apart by the sequence boundaries, not by a mask."""
    return None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, varlen_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, no_mask)


def use_on(model) -> None:
    """Route the model's attention through lfa_varlen (its config and sub-configs)."""
    register()
    model.config._attn_implementation = ATTENTION_NAME
    kernel = "torch's varlen flash attention on sm80+ GPUs" if _torch_varlen() is not None else "no varlen kernel"
    print(
        f"lfa: padding-free: each micro-batch's rows flattened into one sequence, attention kept per row "
        f"({ATTENTION_NAME}: {kernel}; one causal SDPA call per row elsewhere)",
        flush=True,
    )
