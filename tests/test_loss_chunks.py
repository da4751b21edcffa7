"""Liger's fused loss in chunks of at least 2,048 rows (plugin/loss_chunks.py): the rule that picks liger's
chunk_mem_const, the memory model pricing the same chunk, and the wrapper that passes it (liger's kernels need a
GPU, so the wrapper is checked against a stand-in for liger's loss_utils module)."""

import sys
import types

import pytest

from lf_adapter.memory import estimate, liger_loss_chunk_rows
from lf_adapter.model_spec import load_model_spec
from lf_adapter.plan import Plan
from lf_adapter.plugin import contract, loss_chunks, run_kernels


def test_liger_s_own_chunks_follow_its_formula():
    # liger's comment: BT = 4096*4, V = 32000, H = 4096 ==> inc_factor = 8, chunk_size = 2048
    assert loss_chunks.chunk_rows(32000, 4096, 4096 * 4) == 2048
    # a 128k vocabulary at hidden 3072 (Llama-3.2-3B): 8,192 tokens in chunks of 256
    assert loss_chunks.chunk_rows(128256, 3072, 8192) == 256
    assert loss_chunks.chunk_rows(128256, 3072, 100) == 4  # 100 / 42, up to a power of two
    assert loss_chunks.chunk_rows(32000, 4096, 1000, mem_const=8) == 1000  # never more than the tokens


@pytest.mark.parametrize(
    "vocab, hidden", [(128256, 3072), (151936, 2048), (32064, 3072), (256000, 2304), (49152, 3072), (32256, 2048)]
)
@pytest.mark.parametrize("tokens", [700, 2048, 6144, 8192, 16384, 32768, 49152])
def test_lfa_asks_for_the_smallest_chunks_of_at_least_2048_rows(vocab, hidden, tokens):
    const = loss_chunks.chunk_mem_const(vocab, hidden, tokens)
    rows = loss_chunks.chunk_rows(vocab, hidden, tokens, const)
    assert rows >= min(loss_chunks.MIN_ROWS, tokens)
    assert const == 1 or loss_chunks.chunk_rows(vocab, hidden, tokens, const - 1) < min(2048, tokens)
    assert rows >= loss_chunks.chunk_rows(vocab, hidden, tokens)  # never smaller than liger's own
    assert loss_chunks.chunk_mem_const(vocab, hidden, tokens, min_rows=0) == 1


def test_the_memory_model_prices_the_chunk_the_plugin_asks_for():
    llama = load_model_spec("meta-llama/Llama-3.2-3B")
    assert liger_loss_chunk_rows(llama, 8192) == 2048  # liger's own: 256
    plan = Plan.from_label("bf16/mbs4xga16x1/gc12/liger/sdpa/master/padfree/sorted/tb8192")
    items = estimate(llama, plan, 2048, 80.0).items
    logits = next(v for k, v in items.items() if k.startswith("logits"))
    # the fp32 lm_head gradient, the hidden states' gradient and one 2,048-row chunk of 16-bit logits
    expected = 4 * llama.vocab_size * llama.hidden_size + 2 * 8192 * llama.hidden_size + 2 * 2048 * llama.vocab_size
    assert logits == pytest.approx(expected / 2**30, rel=1e-6)
    # a measurement made with liger's own chunks is repriced with them
    with run_kernels.measured_with(run_kernels.BEFORE):
        assert liger_loss_chunk_rows(llama, 8192) == 256
    assert liger_loss_chunk_rows(llama, 8192) == 2048


def test_bench_rows_record_the_kernels_they_ran():
    assert run_kernels.of_row({}) == run_kernels.BEFORE  # a row from before session 28
    env = {contract.LOSS_CHUNK_ROWS: "0"}
    row = {run_kernels.ROW_KEY: run_kernels.record(env)}
    assert run_kernels.of_row(row) == run_kernels.KernelChoices(loss_chunk_min_rows=0, fused_gate_up=True)
    assert run_kernels.from_env({}) == run_kernels.KernelChoices()
    assert not run_kernels.from_env({contract.FUSED_GATE_UP: "0"}).fused_gate_up
    assert not run_kernels.from_env({contract.ATTENTION_ROW_VIEW: "0"}).attention_row_view
    assert run_kernels.from_env({contract.FUSED_WEIGHT_GRADIENTS: "1"}).fused_weight_gradients
    assert not run_kernels.from_env({contract.FUSED_WEIGHT_GRADIENTS: "0"}).fused_weight_gradients


@pytest.mark.parametrize("value, rows", [(None, 2048), ("", 2048), ("0", 0), ("4096", 4096), ("x", 2048)])
def test_the_environment_knob(value, rows):
    assert loss_chunks.min_rows_from_env(value) == rows


@pytest.fixture
def stand_in_liger(monkeypatch):
    """liger_kernel's module tree as far as install() reads it; the loss records what it was called with."""
    calls = []

    def fixed_fused_linear_cross_entropy(hidden_states, lm_head_weight, *args, **kwargs):
        calls.append(kwargs)
        return "loss"

    def liger_fused_linear_cross_entropy(input, weight, target, accum_dtype=None, chunk_mem_const=1):
        raise AssertionError("not called here")

    class LigerFusedLinearCrossEntropyFunction:
        supports_inner_impl_dispatch = True

    modules = {
        "liger_kernel": types.ModuleType("liger_kernel"),
        "liger_kernel.transformers": types.ModuleType("liger_kernel.transformers"),
        "liger_kernel.transformers.model": types.ModuleType("liger_kernel.transformers.model"),
        "liger_kernel.transformers.model.loss_utils": types.SimpleNamespace(
            fixed_fused_linear_cross_entropy=fixed_fused_linear_cross_entropy
        ),
        "liger_kernel.transformers.functional": types.SimpleNamespace(
            liger_fused_linear_cross_entropy=liger_fused_linear_cross_entropy
        ),
        "liger_kernel.ops": types.ModuleType("liger_kernel.ops"),
        "liger_kernel.ops.fused_linear_cross_entropy": types.SimpleNamespace(
            LigerFusedLinearCrossEntropyFunction=LigerFusedLinearCrossEntropyFunction
        ),
    }
    modules["liger_kernel.transformers"].model = modules["liger_kernel.transformers.model"]
    modules["liger_kernel.transformers"].functional = modules["liger_kernel.transformers.functional"]
    modules["liger_kernel.transformers.model"].loss_utils = modules["liger_kernel.transformers.model.loss_utils"]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules["liger_kernel.transformers.model.loss_utils"], calls


def test_the_wrapper_passes_the_chunk_and_the_fp32_gradient(stand_in_liger, monkeypatch):
    torch = pytest.importorskip("torch")
    loss_utils, calls = stand_in_liger
    monkeypatch.delenv(contract.LOSS_CHUNK_ROWS, raising=False)
    hidden, weight = torch.zeros(2, 4096, 3072), torch.zeros(128256, 3072)  # 8,192 tokens of Llama-3.2-3B's width
    assert loss_chunks.install(fp32_lm_head_gradient=True) == (
        "chunks of at least 2048 rows, the lm_head gradient summed in fp32"
    )
    assert loss_utils.fixed_fused_linear_cross_entropy(hidden, weight, None) == "loss"
    assert calls[-1] == {"accum_dtype": torch.float32, "chunk_mem_const": 6}
    assert loss_chunks.chunk_rows(128256, 3072, 8192, 6) == 2048
    # a second trainer in the process wraps liger's own function again, not the wrapper
    monkeypatch.setenv(contract.LOSS_CHUNK_ROWS, "0")
    assert loss_chunks.install() == "liger's own chunks"
    loss_utils.fixed_fused_linear_cross_entropy(hidden, weight, None)
    assert calls[-1] == {"accum_dtype": None} and len(calls) == 2


def test_an_older_liger_keeps_its_chunks(stand_in_liger, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.delattr(
        sys.modules["liger_kernel.ops.fused_linear_cross_entropy"].LigerFusedLinearCrossEntropyFunction,
        "supports_inner_impl_dispatch",
    )
    assert loss_chunks.install() == "liger's own chunks"


def test_a_derived_row_carries_the_record_only_where_there_is_one():
    row = {run_kernels.ROW_KEY: run_kernels.record({})}
    assert run_kernels.of_row({**run_kernels.carried(row)}) == run_kernels.KernelChoices()
    assert run_kernels.carried({"plan": "x"}) == {}
