"""Token-budget micro-batches (LFA_TOKEN_BUDGET=N): every optimizer step keeps exactly its rows, and the trainer cuts
them into as many micro-batches as their tokens need, each at most N tokens.

The plugin hands the trainer one batch per optimizer step (per process: micro_batch_size x grad_accum rows, the
recipe's own numbers) with accumulation 1. Where the trainer collects it (get_batch_samples, training only; it has
counted the step's tokens on the padded rows, as for accumulation) the step's rows are grouped longest first:
padding-free, first-fit into micro-batches of at most N real tokens; padded, consecutive rows while rows x the
longest row (rounded up to a multiple of 8, as LLaMA-Factory pads) fit in N; either evened out where the smallest
micro-batch would be small. training_step runs them one after another (gradients exchanged across processes after
the last only), each loss normalized by the whole step's token count: the step's gradient is the padded step's sum
over the same tokens (tests/test_token_budget.py).
"""

from __future__ import annotations

import os

from . import run_kernels

MICRO_BATCHES = "lfa_micro_batches"  # the key of a step batch's list of micro-batches
# a last micro-batch below this share of the budget is bound by the CPU launching its layers, not by the GPU (the
# 1.3B's 99,039-token step cut at 32,768 ran 3.8% (H100, whole card) and 8.5% (capped, recompute) below its
# neighbours' rate: bench/README.md, session 35); steps that first-fit fills keep it: the largest stays the budget
SMALL_LAST_SHARE = 0.25
# padded micro-batches keep LLaMA-Factory's pad_to_multiple_of=8: eager attention's score GEMMs have the row width as
# their leading dimension, and at an odd width cuBLAS ran align1 kernels (3.0-5.6% of Gemma-2's H100 steps by their
# top twelve kernels, sessions 28-29: bench/README.md, session 36)
PAD_MULTIPLE = 8


def padded_width(longest: int, full_width: int, multiple: int = PAD_MULTIPLE) -> int:
    """Pure: a padded micro-batch's width: its longest row rounded up to `multiple`, never past the step batch's."""
    return min(full_width, -(-longest // multiple) * multiple)


def group_rows(
    lengths: list[int], budget: int, padding_free: bool, full_width: int | None = None, multiple: int = PAD_MULTIPLE
) -> list[list[int]]:
    """Pure: the row indices of each micro-batch, longest rows first. A row longer than the budget gets a
    micro-batch of its own. Padding-free: first-fit; where that leaves a small last micro-batch, as many micro-batches
    with their tokens evened out. Padded: consecutive rows, each micro-batch costing rows x padded_width (full_width:
    the step batch's width, the longest row's where not given), evened out the same way."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if padding_free:  # first-fit decreasing on real tokens
        groups: list[list[int]] = []
        room: list[int] = []
        for i in order:
            slot = next((g for g, free in enumerate(room) if lengths[i] <= free), None)
            if slot is None:
                groups.append([i])
                room.append(budget - lengths[i])
            else:
                groups[slot].append(i)
                room[slot] -= lengths[i]
        if len(groups) > 1 and budget - max(room) < budget * SMALL_LAST_SHARE:  # the emptiest one's tokens
            return even_out(order, lengths, budget, len(groups)) or groups
        return groups
    full_width = max(lengths) if full_width is None else full_width
    width = [padded_width(n, full_width, multiple) for n in lengths]
    groups = consecutive(order, width, budget)
    if len(groups) > 1 and min(len(g) * width[g[0]] for g in groups) < budget * SMALL_LAST_SHARE:
        return even_out_consecutive(order, width, budget, len(groups))
    return groups


def consecutive(order: list[int], width: list[int], cap: int) -> list[list[int]]:
    """Pure: the rows in order, consecutive ones together while rows x the first (widest) one's padded width fit in
    cap; a row wider than cap alone."""
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * width[groups[-1][0]] <= cap:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def even_out_consecutive(order: list[int], width: list[int], budget: int, count: int) -> list[list[int]]:
    """Pure: the consecutive grouping at the smallest cap that needs no more than `count` micro-batches: as many as
    at the budget (a smaller cap never needs fewer), their padded sizes evened out."""
    low, high = 1, budget
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if len(consecutive(order, width, mid)) <= count else (mid + 1, high)
    return consecutive(order, width, low)


def even_out(order: list[int], lengths: list[int], budget: int, count: int) -> list[list[int]] | None:
    """Pure: the rows (longest first) in `count` micro-batches of similar token counts, each row to the one with
    the fewest tokens so far; None where one would exceed the budget."""
    groups: list[list[int]] = [[] for _ in range(count)]
    tokens = [0] * count
    for i in order:
        slot = min(range(count), key=lambda g: (tokens[g], g))
        if tokens[slot] + lengths[i] > budget:
            return None
        groups[slot].append(i)
        tokens[slot] += lengths[i]
    return groups


def split_step(batch, budget: int, padding_free: bool, drop_mask: bool) -> dict | None:
    """One step's right-padded text batch [rows, L] -> {MICRO_BATCHES: [...], "lfa_nonpad_tokens": n}: each
    micro-batch trimmed to its longest row (padded: to padded_width), then flattened (padding_free) or without its
    padding mask (drop_mask).
    None when it is not a right-padded text batch (4D masks, packed rows, other keys)."""
    import torch

    from .padding_free import flatten_batch, right_padding_mask

    mask = right_padding_mask(batch)
    if mask is None or "labels" not in batch:
        return None
    lengths = mask.sum(dim=1).tolist()  # one read per optimizer step
    micro_batches = []
    full_width = mask.shape[1]
    multiple = PAD_MULTIPLE if run_kernels.from_env(os.environ).padded_width_aligned else 1
    for rows in group_rows(lengths, budget, padding_free, full_width, multiple):
        index = torch.tensor(rows, device=mask.device)
        longest = max(lengths[i] for i in rows)
        width = longest if padding_free else padded_width(longest, full_width, multiple)
        micro = {key: batch[key][index, :width] for key in ("input_ids", "attention_mask", "labels")}
        if padding_free and flatten_batch(micro, [lengths[i] for i in rows]):
            micro.pop("lfa_nonpad_tokens")
        elif drop_mask:  # right-padded: causal attention needs no mask (hooks.drop_right_padding_mask)
            micro["attention_mask"] = None
        micro_batches.append(micro)
    return {MICRO_BATCHES: micro_batches, "lfa_nonpad_tokens": mask.sum()}


def split_rows(batch, size: int) -> dict:
    """A step batch that split_step cannot cut (other keys, 4D masks) -> micro-batches of `size` rows, the recipe's
    fixed micro-batch: never more memory than LLaMA-Factory's own plan."""
    import torch

    rows = next(v.size(0) for v in batch.values() if torch.is_tensor(v) and v.dim() > 0)
    micro_batches = [
        {
            k: v[start : start + size] if torch.is_tensor(v) and v.dim() > 0 and v.size(0) == rows else v
            for k, v in batch.items()
        }
        for start in range(0, rows, size)
    ]
    return {MICRO_BATCHES: micro_batches}
