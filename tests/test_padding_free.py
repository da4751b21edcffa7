"""Padding-free training is exact: one step's loss and gradients equal the padded step's, and no row sees another."""

import pytest

torch = pytest.importorskip("torch")
from lf_adapter.plugin.padding_free import supported  # noqa: E402

pytestmark = pytest.mark.skipif(not supported(), reason="padding-free needs transformers >= 4.53")


def _tiny_model(kv_heads=4, sliding_window=None):
    """A tiny Llama, or with a sliding window the Mistral of the same shape."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    shape = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
    )
    if sliding_window:
        return MistralForCausalLM(MistralConfig(**shape, sliding_window=sliding_window)).float()
    return LlamaForCausalLM(LlamaConfig(**shape)).float()


def _padded_batch(lengths, vocab=97, prompt=3):
    torch.manual_seed(1)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.full((len(lengths), width), -100)
    for row, n in enumerate(lengths):
        input_ids[row, :n] = torch.randint(1, vocab, (n,))
        mask[row, :n] = 1
        labels[row, prompt:n] = input_ids[row, prompt:n]  # the prompt is not trained on, as LLaMA-Factory does
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _loss_and_grads(model, batch, num_items):
    model.zero_grad()
    out = model(**batch, num_items_in_batch=num_items)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _gqa_kernel(seen_kv_heads: list):
    """A stand-in for torch's varlen_attn that takes enable_gqa (the CPU has no flash kernel): it notes how many
    key-value heads reach it and attends as the per-row reference does."""
    from lf_adapter.plugin import padding_free

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, 0), enable_gqa=False):
        seen_kv_heads.append(k.size(1))
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [heads, T, D], as the per-row path takes them
        if enable_gqa:
            groups = q.size(0) // k.size(0)
            k, v = padding_free._repeat_kv(k, groups), padding_free._repeat_kv(v, groups)
        window = window_size[0] + 1 if window_size[0] >= 0 else None
        return padding_free._rows_reference(q, k, v, cu_q, scale, window).transpose(0, 1)

    return padding_free.VarlenKernel(attend, takes_window=True, takes_gqa=True)


# full attention heads, grouped-query attention, and a sliding window shorter than the rows (Phi-3-mini-4k's 2,047
# at cutoff 2,048): lfa's attention keeps the window that transformers' padded path masks; on the CPU's per-row
# path and through a kernel that reads grouped key-value heads without copies (enable_gqa)
@pytest.mark.parametrize("kernel", ["per-row", "gqa"])
@pytest.mark.parametrize("kv_heads,window", [(4, None), (2, None), (2, 6)])
def test_a_flattened_step_equals_the_padded_step(kv_heads, window, kernel, monkeypatch):
    from lf_adapter.plugin import padding_free

    seen_kv_heads = []
    if kernel == "gqa":
        monkeypatch.setattr(padding_free, "_kernel_for", lambda q: _gqa_kernel(seen_kv_heads))

    lengths = [17, 5, 11, 9]
    padded = _padded_batch(lengths)
    num_items = int((padded["labels"][:, 1:] != -100).sum())
    model = _tiny_model(kv_heads, sliding_window=window)
    model.config._attn_implementation = "sdpa"
    loss_padded, grads_padded = _loss_and_grads(model, {k: v.clone() for k, v in padded.items()}, num_items)
    flat = {k: v.clone() for k, v in padded.items()}
    assert padding_free.flatten_batch(flat)
    assert flat["input_ids"].shape == (1, sum(lengths)) and flat["lfa_nonpad_tokens"] == sum(lengths)
    assert flat["cu_seq_lens_q"].tolist() == [0, 17, 22, 33, 42] and flat["max_length_q"] == 17
    assert flat["position_ids"][0, 17:22].tolist() == [0, 1, 2, 3, 4]  # positions restart with every row
    flat.pop("lfa_nonpad_tokens")
    padding_free.use_on(model)
    loss_flat, grads_flat = _loss_and_grads(model, flat, num_items)
    assert torch.allclose(loss_flat, loss_padded, atol=1e-6, rtol=1e-5)
    for name, grad in grads_padded.items():
        assert torch.allclose(grads_flat[name], grad, atol=1e-6, rtol=1e-4), name
    if kernel == "gqa":  # each layer's keys reach the kernel with the model's key-value heads, not repeated
        assert seen_kv_heads == [kv_heads] * model.config.num_hidden_layers
    if window:  # the window matters: without it the rows of 9-17 tokens train otherwise
        model.config.sliding_window = None
        assert not torch.allclose(_loss_and_grads(model, dict(flat), num_items)[0], loss_flat, atol=1e-4)


def test_no_row_sees_another_and_no_label_crosses_a_boundary():
    from lf_adapter.plugin import padding_free

    model = _tiny_model()
    padding_free.use_on(model)
    batch = _padded_batch([9, 7, 8])
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0, :9] = (changed["input_ids"][0, :9] % 96) + 1  # another first row
    logits = []
    for b in (batch, changed):
        flat = {k: v.clone() for k, v in b.items()}
        padding_free.flatten_batch(flat)
        flat.pop("lfa_nonpad_tokens")
        labels = flat["labels"][0]
        assert labels[9] == -100 and labels[16] == -100  # each row's first token is no target
        with torch.no_grad():
            logits.append(
                model(
                    input_ids=flat["input_ids"],
                    position_ids=flat["position_ids"],
                    cu_seq_lens_q=flat["cu_seq_lens_q"],
                    cu_seq_lens_k=flat["cu_seq_lens_k"],
                    max_length_q=flat["max_length_q"],
                    max_length_k=flat["max_length_k"],
                ).logits[0]
            )
    assert not torch.allclose(logits[0][:9], logits[1][:9])  # the changed row changed
    assert torch.equal(logits[0][9:], logits[1][9:])  # the other rows did not see it
    # and without the boundaries (plain causal attention over the flat sequence) they would have
    flat = {k: v.clone() for k, v in changed.items()}
    padding_free.flatten_batch(flat)
    with torch.no_grad():
        leaky = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"]).logits[0]
    assert not torch.allclose(leaky[9:], logits[1][9:])


@pytest.mark.parametrize("row_view", ["", "0"])  # lfa's default, and indexing (LFA_ATTENTION_ROW_VIEW=0) to compare
def test_the_attention_hands_its_input_gradients_back_as_views(row_view, monkeypatch):
    """transformers passes q/k/v as [1, heads, tokens, dim] views of [1, tokens, heads, dim] projections; taking the
    single row by indexing makes autograd zero-fill a gradient of that shape and copy into it (a strided copy per
    tensor and layer, then liger's RoPE copies it back to the projection's layout); squeezing keeps them views."""
    from lf_adapter.plugin import contract, padding_free

    monkeypatch.setenv(contract.ATTENTION_ROW_VIEW, row_view)

    projections = [torch.randn(1, 12, 4, 8, requires_grad=True) for _ in range(3)]
    query, key, value = (p.transpose(1, 2) for p in projections)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out, _ = padding_free.varlen_attention_forward(
        None, query, key, value, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7
    )
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    assert any(type(node).__name__.startswith("SelectBackward") for node in seen) == (row_view == "0")
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.shape == (1, 12, 4, 8) for p in projections)


def test_batches_it_cannot_flatten_are_left_alone():
    from lf_adapter.plugin import padding_free

    left_padded = _padded_batch([4, 6])
    left_padded["attention_mask"] = left_padded["attention_mask"].flip(1)
    assert not padding_free.flatten_batch(left_padded) and left_padded["input_ids"].shape == (2, 6)
    four_d = _padded_batch([4, 6])
    four_d["attention_mask"] = four_d["attention_mask"][:, None, None, :]
    assert not padding_free.flatten_batch(four_d)


def test_through_the_real_trainer_padding_free_trains_the_same_steps_as_padded(cpu_recipe, tmp_path):
    """`--pin padding_free=true` end to end (lfa generate -> lfa train -> llamafactory-cli with the plugin): the
    same rows per step as the padded recipe (both with LLaMA-Factory's random sampler), every micro-batch
    flattened, and the logged losses equal."""
    import json

    from conftest import _events, _losses, run_lfa

    common = ("max_steps=4",)
    extra = ("--logging-steps", "1", "--pin", "micro_batch_size=4")
    padded = cpu_recipe(*common, name="padded", extra=extra + ("--no-sorted-steps",))
    flat = cpu_recipe(*common, name="flat", extra=extra + ("--no-sorted-steps", "--pin", "padding_free=true"))
    assert "/padfree" in json.loads(flat.read_text().split("# lfa-meta: ")[1].splitlines()[0])["plan"]
    assert "LFA_PADDING_FREE=1" in (flat.parent / "launch.sh").read_text()
    for recipe in (padded, flat):
        result = run_lfa("train", recipe, "--run-dir", tmp_path / recipe.parent.name)
        assert result.returncode == 0, result.stdout + result.stderr
    steps = {name: [e for e in _events(tmp_path / name) if e["event"] == "step"] for name in ("padded", "flat")}
    assert [e["flat_micro_batches"] for e in steps["flat"]] == [2, 2, 2, 2]  # 8 rows per step, 4 per micro-batch
    assert [e["flat_micro_batches"] for e in steps["padded"]] == [0, 0, 0, 0]
    assert [e["step_tokens"] for e in steps["flat"]] == [e["step_tokens"] for e in steps["padded"]]
    losses = {
        name: [r["loss"] for r in _losses(recipe.parent / "saves" / "pseudo2norm") if "loss" in r]
        for name, recipe in (("padded", padded), ("flat", flat))
    }
    assert len(losses["flat"]) == 4
    assert all(abs(a - b) < 1e-4 for a, b in zip(losses["flat"], losses["padded"])), losses
    assert "lfa: padding-free" in (tmp_path / "flat" / "attempt-1.log").read_text()
