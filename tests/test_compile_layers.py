"""LFA_COMPILE_LAYERS (a bench experiment, issue 33): liger keeps only its fused loss, and the decoder layers compile
whole, with the padding-free attention inside them, on micro-batches of changing length."""

import types

import pytest

torch = pytest.importorskip("torch")
from lf_adapter.plugin import hooks, padding_free  # noqa: E402

pytestmark = pytest.mark.skipif(not padding_free.supported(), reason="padding-free needs transformers >= 4.53")


def test_liger_keeps_its_fused_loss_and_leaves_the_layers_kernels_off():
    calls = []

    def apply_liger_kernel_to_llama(
        rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None
    ):
        calls.append(
            dict(
                rope=rope,
                cross_entropy=cross_entropy,
                fused=fused_linear_cross_entropy,
                rms_norm=rms_norm,
                swiglu=swiglu,
            )
        )

    def apply_liger_kernel_to_starcoder2(layer_norm=True, fused_linear_cross_entropy=True):
        calls.append(dict(layer_norm=layer_norm, fused=fused_linear_cross_entropy))

    module = types.ModuleType("monkey_patch")
    module.apply_liger_kernel_to_llama = apply_liger_kernel_to_llama
    module.apply_liger_kernel_to_starcoder2 = apply_liger_kernel_to_starcoder2
    module.LigerRMSNorm = object
    hooks._liger_loss_only(module)
    module.apply_liger_kernel_to_llama(rope=True, fused_linear_cross_entropy=False, cross_entropy=True)
    module.apply_liger_kernel_to_starcoder2()
    assert calls == [
        dict(rope=False, cross_entropy=True, fused=False, rms_norm=False, swiglu=False),
        dict(layer_norm=False, fused=True),
    ]
    assert module.LigerRMSNorm is object


def _rows(q, k, v, cu, scale, window):
    """[T, H, D] in and out: lfa's per-row reference attention."""
    out = padding_free._rows_reference(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu, scale, window or None
    )
    return out.transpose(0, 1)


@torch.library.custom_op("lfa_test::varlen_rows", mutates_args=())
def _varlen_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float, window: int
) -> torch.Tensor:
    return _rows(q, k, v, cu, scale, window).contiguous()


@_varlen_rows.register_fake
def _(q, k, v, cu, scale, window):
    return torch.empty_like(q)


@torch.library.custom_op("lfa_test::varlen_rows_backward", mutates_args=())
def _varlen_rows_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, grad: torch.Tensor, scale: float, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention's backward row by row, by hand (autograd does not record inside a custom op)."""
    gq, gk, gv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        rq, rk, rv, rg = (t[start:end].transpose(0, 1) for t in (q, k, v, grad))  # [H, n, D]
        n = end - start
        seen = torch.ones(n, n, dtype=torch.bool).tril()
        if window:
            seen = seen.triu(-(window - 1))
        p = (rq @ rk.transpose(1, 2) * scale).masked_fill(~seen, float("-inf")).softmax(-1)
        dp = rg @ rv.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        gq[start:end] = (ds @ rk * scale).transpose(0, 1)
        gk[start:end] = (ds.transpose(1, 2) @ rq * scale).transpose(0, 1)
        gv[start:end] = (p.transpose(1, 2) @ rg).transpose(0, 1)
    return gq, gk, gv


@_varlen_rows_backward.register_fake
def _(q, k, v, cu, grad, scale, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save(ctx, inputs, output):
    q, k, v, cu, scale, window = inputs
    ctx.save_for_backward(q, k, v, cu)
    ctx.scale, ctx.window = scale, window


def _backward(ctx, grad):
    q, k, v, cu = ctx.saved_tensors
    return (*_varlen_rows_backward(q, k, v, cu, grad, ctx.scale, ctx.window), None, None, None)


_varlen_rows.register_autograd(_backward, setup_context=_save)


def _cpu_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, 0), enable_gqa=False):
    """torch's varlen_attn as one opaque op, on the CPU: the kernel a GPU run compiles around."""
    if enable_gqa:  # [T, heads, D] from [T, key-value heads, D]
        k, v = (x.repeat_interleave(q.size(1) // x.size(1), dim=1) for x in (k, v))
    return _varlen_rows(q, k, v, cu_q, scale or q.size(-1) ** -0.5, window_size[0] + 1 if window_size[0] >= 0 else 0)


@pytest.mark.parametrize("recompute", [False, True])  # LLaMA-Factory's checkpointing is reentrant
def test_compiled_layers_trace_whole_and_train_the_eager_step(monkeypatch, recompute):
    from test_padding_free import _loss_and_grads, _padded_batch, _tiny_model
    from torch._dynamo.testing import CompileCounterWithBackend

    kernel = padding_free.VarlenKernel(_cpu_varlen, takes_window=True, takes_gqa=True)
    monkeypatch.setattr(padding_free, "_kernel_for", lambda q: kernel)
    eager, compiled = _tiny_model(2), _tiny_model(2)
    for model in (eager, compiled):
        model.config.use_cache = False
        padding_free.use_on(model)
        if recompute:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
            model.enable_input_require_grads()
            model.train()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    assert hooks.compile_decoder_layers(compiled, counter) == 2
    from torch._dynamo.utils import counters

    counters.clear()
    frames = []
    for lengths in ([17, 5, 11, 9], [30, 3, 8], [12, 12, 20, 4, 7]):  # a new total length every micro-batch
        batch = _padded_batch(lengths)
        num_items = int((batch["labels"][:, 1:] != -100).sum())
        assert padding_free.flatten_batch(batch)
        batch.pop("lfa_nonpad_tokens")
        loss, grads = _loss_and_grads(eager, dict(batch), num_items)
        loss_compiled, grads_compiled = _loss_and_grads(compiled, dict(batch), num_items)
        assert torch.allclose(loss_compiled, loss, atol=1e-6, rtol=1e-5)
        for name, grad in grads.items():
            assert torch.allclose(grads_compiled[name], grad, atol=1e-6, rtol=1e-4), name
        frames.append(counter.frame_count)
    # the layers' code traced whole (no graph break), once: no recompile for another layer or a new length
    assert not counters["graph_break"] and frames[0] == frames[-1]
