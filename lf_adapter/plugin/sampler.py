"""Length-sorted micro-batches inside each optimizer step, without changing what a step trains on. Token-budget
steps use the same permutation, so a run that switches between them and fixed micro-batches on resume skips exactly
the rows it trained.

A plain random permutation is cut into blocks of one optimizer step's rows (micro-batch x accumulation x world
size, in the order accelerate hands batches to ranks); inside a block the rows are ordered longest first. Every
step therefore sees exactly the rows the random sampler would have given it, and since transformers normalizes
the loss by the step's token count (num_items_in_batch), the step's gradient is the same sum; only the split into
micro-batches changes, so rows of similar length share a micro-batch and less compute goes to padding.
"""

from __future__ import annotations

import random

LENGTH_CHUNK = 10_000  # rows read per arrow slice when measuring lengths


def sorted_step_order(lengths: list[int], block: int, seed: int, epoch: int, deal: int = 1) -> list[int]:
    """Pure: a seeded permutation of range(len(lengths)), each block of `block` indices sorted longest first.
    deal > 1: token-budget steps, where each of `deal` processes takes one contiguous share of the block: the sorted
    rows are dealt round-robin so that every process gets long and short ones (the block's rows stay the same)."""
    order = list(range(len(lengths)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    result = []
    for start in range(0, len(order), block):
        rows = sorted(order[start : start + block], key=lambda i: -lengths[i])
        result += [i for rank in range(deal) for i in rows[rank::deal]] if len(rows) == block else rows
    return result


class SortedStepSampler:
    """torch Sampler protocol (iter/len/set_epoch); deterministic per (seed, epoch), so resume skips the same rows."""

    def __init__(self, lengths: list[int], block: int, seed: int, deal: int = 1):
        self.lengths, self.block, self.seed, self.epoch, self.deal = lengths, max(1, block), seed, 0, deal

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(sorted_step_order(self.lengths, self.block, self.seed, self.epoch, self.deal))

    def __len__(self) -> int:
        return len(self.lengths)


def row_lengths(dataset) -> list[int] | None:
    """Token count of every row of a tokenized datasets.Dataset, read column-wise through arrow."""
    try:
        import pyarrow.compute as pc

        columns = dataset.column_names
    except (ImportError, AttributeError):
        return None
    if "input_ids" not in columns:
        return None
    table = dataset.select_columns(["input_ids"]).with_format("arrow")
    lengths: list[int] = []
    for start in range(0, len(dataset), LENGTH_CHUNK):
        lengths += pc.list_value_length(table[start : start + LENGTH_CHUNK]["input_ids"]).to_pylist()
    return lengths
