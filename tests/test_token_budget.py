"""Token-budget micro-batches are exact: a step cut into micro-batches by tokens has the padded step's loss and
gradients; every row is trained once per step; no micro-batch exceeds its budget."""

import pytest

torch = pytest.importorskip("torch")
from test_padding_free import _padded_batch, _tiny_model  # noqa: E402

from lf_adapter.plugin.padding_free import supported  # noqa: E402
from lf_adapter.plugin.token_budget import MICRO_BATCHES, group_rows, padded_width, split_step  # noqa: E402


@pytest.mark.parametrize("padding_free", [True, False])
def test_groups_cover_every_row_once_within_the_budget(padding_free):
    lengths = [17, 5, 11, 9, 30, 2, 2, 14, 40]
    budget = 32
    groups = group_rows(lengths, budget, padding_free)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        cost = sum(lengths[i] for i in group) if padding_free else len(group) * padded_width(longest, 40)
        assert cost <= budget or len(group) == 1  # a row longer than the budget goes alone
    assert [8] in groups  # the 40-token row
    # fewer micro-batches than rows, and first-fit packs at least as tightly as the padded grouping
    assert len(groups) < len(lengths)
    assert len(group_rows(lengths, budget, True)) <= len(group_rows(lengths, budget, False))


def test_padded_micro_batches_keep_widths_of_a_multiple_of_8_within_the_budget():
    assert [padded_width(n, 48) for n in (1, 8, 9, 17, 41, 48)] == [8, 8, 16, 24, 48, 48]
    assert padded_width(45, 45) == 45  # never wider than the step batch
    # 24 tokens: rows of 9 and 8 cost 2 x 16 at their padded width, over the budget, so the 9 goes alone
    assert group_rows([9, 8, 8], 24, padding_free=False, full_width=16) == [[0], [1, 2]]
    assert group_rows([9, 8, 8], 24, padding_free=False, full_width=9) == [[0, 1], [2]]  # 9 wide at most


def test_a_small_padded_micro_batch_is_evened_out_as_consecutive_rows():
    lengths = [8] * 11  # at 40 tokens: 5 + 5 + 1 rows, the last 8 tokens (under a quarter of the budget)
    groups = group_rows(lengths, 40, padding_free=False)
    assert [len(g) for g in groups] == [4, 4, 3]  # as many micro-batches, the largest 32 tokens
    assert [i for g in groups for i in g] == list(range(11))  # still consecutive, longest first
    # the smallest holding a quarter of the budget or more keeps the grouping at the budget
    assert [len(g) for g in group_rows([8] * 12, 40, padding_free=False)] == [5, 5, 2]
    # widths differ: 4 x 16, 4 x 16 and a 5-token row alone (8 wide) become three micro-batches of 48 tokens or less
    lengths = [16] * 8 + [5]
    groups = group_rows(lengths, 64, padding_free=False)
    assert [[lengths[i] for i in g] for g in groups] == [[16] * 3, [16] * 3, [16, 16, 5]]


def test_the_unaligned_padded_widths_stay_selectable_for_comparison(monkeypatch):
    from lf_adapter.plugin import contract

    batch = _padded_batch([17, 9, 3])  # 17 wide: at 32 tokens 17 and 9 go apart, then 9 and 3 fill 16 aligned
    aligned = split_step({k: v.clone() for k, v in batch.items()}, 32, padding_free=False, drop_mask=True)
    monkeypatch.setenv(contract.PADDED_WIDTH_ALIGNED, "0")
    before = split_step({k: v.clone() for k, v in batch.items()}, 32, padding_free=False, drop_mask=True)
    assert [tuple(m["input_ids"].shape) for m in aligned[MICRO_BATCHES]] == [(1, 17), (2, 16)]
    assert [tuple(m["input_ids"].shape) for m in before[MICRO_BATCHES]] == [(1, 17), (2, 9)]


def test_a_small_last_micro_batch_is_evened_out_with_the_others():
    lengths = [1000] * 9 + [300]  # first-fit at 3,000 tokens: three full micro-batches and 300 tokens alone
    groups = group_rows(lengths, 3000, padding_free=True)
    tokens = sorted(sum(lengths[i] for i in g) for g in groups)
    assert len(groups) == 4 and tokens == [2000, 2000, 2300, 3000]
    assert sorted(i for g in groups for i in g) == list(range(10))
    # a last micro-batch of a quarter of the budget or more keeps first-fit's full ones (the priced largest)
    full = group_rows([1000] * 9 + [800], 3000, padding_free=True)
    assert sorted(sum(([1000] * 9 + [800])[i] for i in g) for g in full) == [800, 3000, 3000, 3000]


@pytest.mark.skipif(not supported(), reason="padding-free needs transformers >= 4.53")
@pytest.mark.parametrize("padding_free,budget", [(True, 30), (True, 24), (False, 30)])
def test_a_step_cut_by_tokens_has_the_padded_steps_loss_and_gradients(padding_free, budget):
    from lf_adapter.plugin import padding_free as pf

    lengths = [17, 5, 11, 9, 23, 6]
    padded = _padded_batch(lengths)
    num_items = int((padded["labels"] != -100).sum())  # what transformers counts for the step
    model = _tiny_model()
    model.config._attn_implementation = "sdpa"
    model.zero_grad()
    out = model(**{k: v.clone() for k, v in padded.items()}, num_items_in_batch=num_items)
    out.loss.backward()
    loss_padded = out.loss.detach()
    grads_padded = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    step = split_step({k: v.clone() for k, v in padded.items()}, budget, padding_free=padding_free, drop_mask=True)
    micro_batches = step[MICRO_BATCHES]
    assert len(micro_batches) >= 3 and int(step["lfa_nonpad_tokens"]) == sum(lengths)
    if padding_free:
        pf.use_on(model)
        assert all(m["input_ids"].shape[0] == 1 and m["input_ids"].shape[1] <= budget for m in micro_batches)
        # at 24 tokens first-fit leaves 5 alone; evened out, the smallest holds 15
        assert min(m["input_ids"].shape[1] for m in micro_batches) == (14 if budget == 30 else 15)
    else:
        assert all(m["attention_mask"] is None and m["input_ids"].numel() <= 30 for m in micro_batches)
        # each as wide as its longest row rounded up to 8 (at most the step's 23): some wider than their longest
        longest = [int((m["input_ids"] != 0).sum(dim=1).max()) for m in micro_batches]
        widths = [m["input_ids"].shape[1] for m in micro_batches]
        assert widths == [padded_width(n, 23) for n in longest] and widths != longest
    model.zero_grad()
    total = 0.0
    for micro in micro_batches:
        loss = model(**micro, num_items_in_batch=num_items).loss
        loss.backward()  # gradients accumulate as the trainer's micro-batches do
        total += loss.detach()
    assert torch.allclose(total, loss_padded, atol=1e-6, rtol=1e-5)
    for name, grad in grads_padded.items():
        assert torch.allclose(model.get_parameter(name).grad, grad, atol=1e-6, rtol=1e-4), name


def test_batches_it_cannot_cut_by_tokens_run_as_the_recipes_fixed_micro_batches():
    from lf_adapter.plugin.token_budget import split_rows

    four_d = _padded_batch([4, 6, 5, 3, 7])
    four_d["attention_mask"] = four_d["attention_mask"][:, None, None, :]
    assert split_step(four_d, 8, True, True) is None
    micro_batches = split_rows(four_d, 2)[MICRO_BATCHES]  # never more rows than the fixed plan's 2
    assert [m["input_ids"].shape[0] for m in micro_batches] == [2, 2, 1]
    assert torch.equal(torch.cat([m["attention_mask"] for m in micro_batches]), four_d["attention_mask"])


def test_recompute_of_k_layers_runs_only_those_layers_forward_twice():
    from lf_adapter.plugin.hooks import checkpoint_first_layers

    model = _tiny_model()
    model.config.num_hidden_layers = 2
    model.train()
    assert checkpoint_first_layers(model, 1) is None  # checkpointing off: nothing to narrow
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpoint_first_layers(model, 1) == (1, 2)
    calls = [0, 0]
    for index, layer in enumerate(model.model.layers):  # forward hooks do not fire in the recompute: count calls
        forward = layer.mlp.forward

        def counted(*args, forward=forward, index=index, **kwargs):
            calls[index] += 1
            return forward(*args, **kwargs)

        layer.mlp.forward = counted
    batch = _padded_batch([9, 7])
    model(**batch).loss.backward()
    assert calls == [2, 1]  # the checkpointed layer recomputes its forward in the backward; the other keeps it


def test_through_the_real_trainer_a_token_budget_trains_the_padded_steps(cpu_recipe, tmp_path):
    """`--pin token_budget=N` with padding-free and recompute of one layer, end to end (lfa generate -> lfa train ->
    llamafactory-cli with the plugin): each step's rows, cut by tokens into however many micro-batches they need,
    train to the same losses as the padded recipe with fixed micro-batches."""
    import json

    from conftest import _events, _losses, run_lfa

    common = ("max_steps=3",)
    # both keep lfa's sorted-step row order: the same rows per step whichever way a step is cut (so a resume that
    # switches between them skips exactly the rows it trained)
    padded = cpu_recipe(*common, name="padded", extra=("--logging-steps", "1", "--pin", "micro_batch_size=8"))
    pins = ("token_budget=1024", "padding_free=true", "gradient_checkpointing=true", "checkpoint_layers=1")
    budget = cpu_recipe(
        *common, name="budget", extra=("--logging-steps", "1", *[x for p in pins for x in ("--pin", p)])
    )
    meta = json.loads(budget.read_text().split("# lfa-meta: ")[1].splitlines()[0])
    assert meta["plan"].endswith("/padfree/sorted/tb1024") and "/gc1/" in meta["plan"]
    launch = (budget.parent / "launch.sh").read_text()
    assert "LFA_TOKEN_BUDGET=1024" in launch and "LFA_CHECKPOINT_LAYERS=1" in launch
    for recipe in (padded, budget):
        result = run_lfa("train", recipe, "--run-dir", tmp_path / recipe.parent.name)
        assert result.returncode == 0, result.stdout + result.stderr
    steps = {name: [e for e in _events(tmp_path / name) if e["event"] == "step"] for name in ("padded", "budget")}
    rows = meta["effective_batch_size"]
    cut = [e["micro_batches"] for e in steps["budget"]]
    assert all(1 <= n < rows for n in cut), cut  # several rows share a micro-batch of at most 1024 tokens
    assert [e["flat_micro_batches"] for e in steps["budget"]] == cut
    largest = [e["largest_micro_batch_tokens"] for e in steps["budget"]]
    assert all(0 < n <= 1024 for n in largest), largest  # cutoff_len 512: a micro-batch stays in its budget
    assert max(e["largest_micro_batch_tokens"] for e in steps["padded"]) > max(largest), largest  # 8 padded rows
    assert [e["step_tokens"] for e in steps["budget"]] == [e["step_tokens"] for e in steps["padded"]]
    losses = {
        name: [r["loss"] for r in _losses(recipe.parent / "saves" / "pseudo2norm") if "loss" in r]
        for name, recipe in (("padded", padded), ("budget", budget))
    }
    assert len(losses["budget"]) == 3
    assert all(abs(a - b) < 1e-4 for a, b in zip(losses["budget"], losses["padded"])), losses
    log = (tmp_path / "budget" / "attempt-1.log").read_text()
    assert "lfa: token-budget micro-batches" in log and "lfa: recompute: the first 1 of" in log
