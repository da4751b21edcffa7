"""The throughput features lfa's plugin adds inside LLaMA-Factory: sorted steps and training without a padding mask."""

import random

import pytest
import torch

from lf_adapter.plugin.hooks import drop_right_padding_mask
from lf_adapter.plugin.sampler import sorted_step_order


def test_sorted_steps_keep_each_steps_rows_and_sort_inside_the_step():
    rng = random.Random(1)
    lengths = [rng.randint(1, 2048) for _ in range(203)]
    order = sorted_step_order(lengths, block=16, seed=42, epoch=3)
    assert sorted(order) == list(range(203))
    plain = list(range(203))
    random.Random(42 * 1_000_003 + 3).shuffle(plain)
    for start in range(0, 203, 16):
        step = order[start : start + 16]
        assert set(step) == set(plain[start : start + 16])  # the rows a random sampler gives this step
        assert [lengths[i] for i in step] == sorted((lengths[i] for i in step), reverse=True)
    assert order == sorted_step_order(lengths, 16, 42, 3)  # resume skips the same rows
    assert order != sorted_step_order(lengths, 16, 42, 4)


def test_token_budget_steps_deal_the_same_rows_round_robin_to_processes():
    rng = random.Random(2)
    lengths = [rng.randint(1, 2048) for _ in range(64)]
    fixed = sorted_step_order(lengths, block=32, seed=7, epoch=0)
    dealt = sorted_step_order(lengths, block=32, seed=7, epoch=0, deal=2)
    for start in (0, 32):  # each step: the same rows as with fixed micro-batches
        assert set(dealt[start : start + 32]) == set(fixed[start : start + 32])
        rank0, rank1 = dealt[start : start + 16], dealt[start + 16 : start + 32]  # each process's batch
        assert rank0 == fixed[start : start + 32 : 2] and rank1 == fixed[start + 1 : start + 32 : 2]
        tokens = [sum(lengths[i] for i in r) for r in (rank0, rank1)]
        assert tokens[0] >= tokens[1] and tokens[1] > 0.8 * tokens[0]  # long and short rows on both


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_dropping_the_padding_mask_of_a_right_padded_batch_changes_nothing(attention):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            attn_implementation=attention,
        )
    )
    ids = torch.randint(3, 50, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    mask[2, 10:] = 0
    batch = {
        "input_ids": ids.masked_fill(mask == 0, 2),
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, -100),
    }
    reference = model(**batch).loss
    reference.backward()
    reference_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert drop_right_padding_mask(batch) and batch["attention_mask"] is None
    assert int(batch.pop("lfa_nonpad_tokens")) == int(mask.sum())
    loss = model(**batch).loss
    loss.backward()
    assert torch.equal(loss, reference)
    assert all(torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(model.parameters(), reference_grads))


def test_left_padded_or_multimodal_batches_keep_their_mask():
    left = {
        "input_ids": torch.ones(2, 4, dtype=torch.long),
        "attention_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]),
    }
    assert not drop_right_padding_mask(left) and left["attention_mask"] is not None
    vision = {
        "input_ids": torch.ones(1, 4, dtype=torch.long),
        "attention_mask": torch.ones(1, 4, dtype=torch.long),
        "pixel_values": torch.zeros(1, 3),
    }
    assert not drop_right_padding_mask(vision)
