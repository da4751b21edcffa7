"""Master weights (lfa plugin, LFA_MASTER_WEIGHTS=1): the model trains bf16 weights, the optimizer fp32 masters. Each
optimizer step's master gradient is the fp32 sum of the micro-batches' bf16 gradients, AdamW steps the masters as it
would step fp32 weights with those gradients, the model gets their bf16 rounding, and checkpoints hold the masters."""

import copy

import pytest

torch = pytest.importorskip("torch")
from test_padding_free import _padded_batch, _tiny_model  # noqa: E402

from conftest import _events, _ledger, run_lfa  # noqa: E402
from lf_adapter.plugin.master_weights import MasterWeights  # noqa: E402


def _micro_batches():
    return [_padded_batch(lengths) for lengths in ([9, 5, 7], [11, 4], [6, 6, 8])]


def test_master_gradients_are_the_fp32_sum_of_the_micro_batches_bf16_gradients():
    model = _tiny_model()
    fp32_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = MasterWeights(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for (name, param), master in zip(model.named_parameters(), weights.masters):
        assert master.dtype == torch.float32 and torch.equal(master, fp32_weights[name])  # nothing rounded away
        assert torch.equal(param, fp32_weights[name].to(torch.bfloat16))
    reference = copy.deepcopy(model)  # the same bf16 model without the hooks
    expected = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in reference.named_parameters()}
    for batch in _micro_batches():
        model(**batch).loss.backward()
        reference.zero_grad()
        reference(**batch).loss.backward()
        for n, p in reference.named_parameters():
            expected[n] += p.grad.float()
    assert all(p.grad is None for p in model.parameters())  # the bf16 gradients are freed as they are added
    for (name, _), master in zip(model.named_parameters(), weights.masters):
        assert master.grad.dtype == torch.float32
        assert torch.equal(master.grad, expected[name]), name


def _qwen2_with_biases():
    """A tiny Qwen2: biases on q, k and v, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    return Qwen2ForCausalLM(Qwen2Config(**shape, num_key_value_heads=2, tie_word_embeddings=True)).float()


@pytest.mark.parametrize("build", [_tiny_model, _qwen2_with_biases])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_layers_add_their_weight_gradients_into_the_masters_as_the_hook_does(build, dtype):
    """The fused path (the default; LFA_FUSED_WGRAD=0 keeps the hook): each decoder linear's backward adds its weight
    gradient into the master's, the output embedding left to the hook. On the CPU, which has no fp32-output GEMM, it
    adds the 16-bit product as the hook does, so the masters' gradients are bit-equal over three micro-batches, with
    recompute too."""
    from lf_adapter.plugin import master_weights

    hooked, fused = build(), build()
    by_hook = MasterWeights(hooked, dtype)
    by_gemm = MasterWeights(fused, dtype, fused_weight_gradients=True)
    assert by_hook.fused_linears == 0 and by_gemm.fused_linears == 7 * 2  # q, k, v, o, gate, up, down per layer
    assert not master_weights._fp32_output_gemm("cpu", dtype)
    fused.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    fused.train()
    for batch in _micro_batches():
        hooked(**batch).loss.backward()
        fused(**batch).loss.backward()
    assert all(p.grad is None for p in fused.parameters())
    for (name, _), expected, got in zip(hooked.named_parameters(), by_hook.masters, by_gemm.masters):
        assert torch.equal(got.grad, expected.grad), name


def test_the_fp32_output_gemm_branch_sums_the_micro_batches_in_fp32(monkeypatch):
    """Where torch has the fp32-output GEMM (CUDA), the first micro-batch's weight gradient is created by it and the
    next ones are added into that tensor in place. The CPU has no such GEMM, so torch's mm/addmm are stood in by
    fp32 matmuls here: the master's gradient is the fp32 sum of the products, not of their 16-bit roundings."""
    from lf_adapter.plugin import master_weights

    calls = []

    def mm(a, b, out_dtype=None):
        calls.append("mm")
        assert out_dtype is torch.float32 and a.dtype == b.dtype == torch.bfloat16
        return a.float() @ b.float()

    def addmm(c, a, b, out_dtype=None, out=None):
        calls.append("addmm")
        assert out_dtype is torch.float32 and out is c and c.dtype == torch.float32
        return out.add_(a.float() @ b.float())

    torch.manual_seed(0)
    pairs = [(torch.randn(40, 6).bfloat16(), torch.randn(40, 5).bfloat16()) for _ in range(3)]  # (grad_out, input)
    master = torch.nn.Parameter(torch.zeros(6, 5))
    monkeypatch.setattr(master_weights, "_fp32_output_gemm", lambda device, dtype: True)
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    for index, (grad_out, inputs) in enumerate(pairs):
        master_weights._weight_gradient_into(master, grad_out, inputs)
        if index == 0:
            first = master.grad
    monkeypatch.undo()
    assert calls == ["mm", "addmm", "addmm"] and master.grad is first and master.grad.dtype == torch.float32
    exact = sum(g.double().t() @ x.double() for g, x in pairs)
    rounded = sum((g.t() @ x).double() for g, x in pairs)  # the hook's: each product rounded to bf16
    assert torch.allclose(master.grad.double(), exact, rtol=1e-6, atol=1e-5)
    assert (master.grad.double() - exact).abs().max() < (rounded - exact).abs().max() / 10


def test_the_optimizer_steps_the_masters_and_the_model_gets_their_bf16_rounding():
    model = _tiny_model()
    weights = MasterWeights(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    weights.take_over(optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # wraps optimizer.step, as the trainer's
    for batch in _micro_batches():
        model(**batch).loss.backward()
    fp32 = [torch.nn.Parameter(m.detach().clone()) for m in weights.masters]
    for p, m in zip(fp32, weights.masters):
        p.grad = m.grad.clone()
    reference = torch.optim.AdamW(fp32, lr=1e-2, weight_decay=0.1)
    optimizer.step()
    schedule.step()
    reference.step()
    for master, expected in zip(weights.masters, fp32):
        assert torch.equal(master, expected)
        assert master.grad is None  # cleared for the next step's accumulation
    for param, master in weights.pairs:
        assert param.dtype == torch.bfloat16 and torch.equal(param, master.to(torch.bfloat16))


def test_checkpoints_save_and_load_the_fp32_masters():
    model = _tiny_model()
    weights = MasterWeights(model)
    with weights.masters_in_model():
        state = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(v.dtype == torch.float32 for v in state.values())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    loaded = {k: v + 1e-3 for k, v in state.items()}  # a checkpoint whose values bf16 cannot hold
    with weights.masters_in_model():
        model.load_state_dict(loaded)
    for (name, param), master in zip(model.named_parameters(), weights.masters):
        assert torch.equal(master, loaded[name])
        assert param.dtype == torch.bfloat16 and torch.equal(param, loaded[name].to(torch.bfloat16))


def _train(tmp_path, demo_assets, name, *extra, precision="bf16"):
    model, data = demo_assets
    out = tmp_path / name
    result = run_lfa(
        "generate", "--task", "pseudo2norm", "--model", model, "--dataset", data, "--hardware", "cpu",
        "--precision", precision, "--pin", "micro_batch_size=2", "--set", "effective_batch_size=8",
        "--set", "learning_rate=1.0e-3", "--set", "cutoff_len=256", "--set", "max_steps=4",
        "--save-steps", "2", "--logging-steps", "1", *extra, "-o", out,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    result = run_lfa("train", out / "train.yaml", "--run-dir", out / "run")
    return out, result


def _logged(run_dir, key):
    return {e["global_step"]: e[key] for e in _events(run_dir) if e.get("event") == "log" and key in e}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_recipe_with_master_weights_trains_as_the_autocast_recipe_does(tmp_path, demo_assets, precision):
    """Through the real llamafactory-cli on the CPU in 16 bits (fp16 with its loss scaler): the plugin turns master
    weights on, the losses and gradient norms follow the autocast run's (16-bit residual stream: close, not equal),
    the saved model is fp32."""
    from safetensors import safe_open

    master, result = _train(tmp_path, demo_assets, "master", "--pin", "master_weights=true", precision=precision)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "export LFA_MASTER_WEIGHTS=1" in (master / "launch.sh").read_text()
    log = (master / "run" / _ledger(master / "run")["attempts"][0]["log"]).read_text()
    assert f"lfa: master weights: 21 {'bfloat16' if precision == 'bf16' else 'float16'} weights" in log
    # the fused default, on a CPU without an fp32-output GEMM: the 16-bit products, added by the layers themselves
    assert "linear layers add their 16-bit weight gradients (no fp32-output GEMM on cpu)" in log
    autocast, result = _train(tmp_path, demo_assets, "autocast", precision=precision)
    assert result.returncode == 0, result.stdout + result.stderr
    for key, tolerance in (("loss", 1e-3), ("grad_norm", 1e-2)):
        ours, theirs = _logged(master / "run", key), _logged(autocast / "run", key)
        assert sorted(ours) == [1, 2, 3, 4]
        assert all(abs(ours[s] - theirs[s]) <= tolerance * abs(theirs[s]) for s in ours), (key, ours, theirs)
    with safe_open(str(master / "saves" / "pseudo2norm" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


def test_master_weights_are_refused_where_they_cannot_run(tmp_path, demo_assets):
    model, data = demo_assets
    result = run_lfa(
        "generate", "--task", "pseudo2norm", "--model", model, "--dataset", data, "--hardware", "cpu",
        "--pin", "master_weights=true", "-o", tmp_path / "fp32",
    )  # fmt: skip
    assert result.returncode != 0
    assert "master_weights_on_one_process" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_a_resumed_run_loads_the_fp32_masters_and_trains_the_same_steps(tmp_path, demo_assets):
    out, result = _train(tmp_path, demo_assets, "master", "--pin", "master_weights=true")
    assert result.returncode == 0, result.stdout + result.stderr
    checkpoint = out / "saves" / "pseudo2norm" / "checkpoint-2"
    resumed = run_lfa(
        "train", out / "train.yaml", "--run-dir", out / "resumed", "--set", f"resume_from_checkpoint={checkpoint}",
        "--set", "output_dir=saves/resumed",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    again = _logged(out / "resumed", "loss")
    assert sorted(again) == [3, 4]
    first = _logged(out / "run", "loss")
    assert all(again[s] == first[s] for s in again), (again, first)  # bf16-rounded masters would drift


def test_a_model_already_in_16_bits_trains_as_it_is_with_a_message():
    from types import SimpleNamespace

    from lf_adapter.plugin.master_weights import why_not

    args = SimpleNamespace(bf16=True, fp16=False, deepspeed=None, fsdp=None, world_size=1)
    assert why_not(SimpleNamespace(args=args, model=_tiny_model())) is None
    reason = why_not(SimpleNamespace(args=args, model=_tiny_model().to(torch.bfloat16)))
    assert "16-bit already" in reason
    assert "one process" in why_not(
        SimpleNamespace(args=SimpleNamespace(**{**vars(args), "world_size": 2}), model=None)
    )
    assert "16-bit mixed precision" in why_not(
        SimpleNamespace(args=SimpleNamespace(**{**vars(args), "bf16": False}), model=None)
    )
