"""The throughput model: the layer width its rates scale with, and the zoo's measured speeds (bench/README.md)."""

import json
import sys

import pytest

from conftest import REPO
from lf_adapter.hardware import load_profile
from lf_adapter.model_spec import load_model_spec
from lf_adapter.plan import Plan
from lf_adapter.plugin import run_kernels
from lf_adapter.throughput import layer_width, predict_tokens_per_s


def test_the_layer_width_is_the_hidden_size_on_the_fitted_shapes_and_grows_with_the_mlp():
    for size, hidden in (("1.3b", 2048), ("6.7b", 4096)):
        name = f"deepseek-ai/deepseek-coder-{size}-base"
        assert layer_width(load_model_spec(name)) == pytest.approx(hidden, rel=0.005)
    qwen25, qwen3 = load_model_spec("Qwen/Qwen2.5-Coder-3B"), load_model_spec("Qwen/Qwen3-1.7B")
    assert qwen25.hidden_size == qwen3.hidden_size == 2048
    assert layer_width(qwen25) == pytest.approx(2534, abs=1)  # MLP 5.4 x hidden, two key-value heads
    assert layer_width(qwen3) == pytest.approx(2048, rel=0.005)


def test_the_zoo_rows_not_fitted_on_are_predicted_within_ten_percent():
    sys.path.insert(0, str(REPO / "bench"))
    from model_zoo import BENCH_MEAN_SEQ_FRACTION

    # outside, and why: a 64-row micro-batch plan lfa no longer makes (its memory is priced over the card); Gemma-2's
    # eager 49k-token plan of session 27 (-17.1%, liger's 512-row chunks, not rerun); StarCoder2's capped ZeRO-2
    # offload default of session 30 (+14.6%: its gc26 neighbour ran 8% slower on other H100 hosts, whose CPU Adam and
    # pinned copies the per-step term prices; one row, not refitted) and its H200 master default (+11.3%: StarCoder2
    # without liger runs faster than the DeepSeek-fitted no-liger rate says on the H200, +9.3% on session 18's
    # autocast row; its H100 rows are -0.3..+7.1%). The Llama-3.2-3B small-budget rows (-10.3..-11.0% with the
    # master accumulation priced at the datasheet bandwidth) are inside since it is priced at the streaming rate.
    known_outside = {
        ("bigcode/starcoder2-3b", "bf16/mbs8xga8x1/nogc/sdpa/master/padfree/sorted/tb16384"),
        ("bigcode/starcoder2-3b", "fp16/mbs8xga8x1/gc25/sdpa/zero2-offload-optimizer/padfree/sorted"),
        ("Qwen/Qwen3-1.7B", "fp16/mbs64xga1x1/gc/liger/sdpa/zero2-offload-optimizer/padfree/sorted"),
        ("google/gemma-2-2b", "bf16/mbs16xga4x1/gc25/liger/eager/master/sorted/tb49152"),
    }
    rows = json.loads((REPO / "bench" / "results" / "model_zoo.json").read_text())
    errors = {}
    for row in rows:
        if not row.get("steady_tokens_per_s") or row.get("used_for_fit") or row.get("attempts") != 1:
            continue
        plan = Plan.from_label(row["plan"], alloc_conf="expandable_segments:True")
        model, hardware = load_model_spec(row["model"]), load_profile(row["hardware"])
        with run_kernels.measured_with(run_kernels.of_row(row)):  # the kernels it ran (before session 28: liger's own)
            predicted = predict_tokens_per_s(model, plan, hardware, 2048, BENCH_MEAN_SEQ_FRACTION)
        errors[(row["model"], row["plan"], row["run"])] = row["steady_tokens_per_s"] / predicted - 1
    outside = {(model, plan) for (model, plan, _), error in errors.items() if abs(error) > 0.10}
    assert outside == known_outside, {k: round(v, 3) for k, v in errors.items() if abs(v) > 0.10}
    assert len(errors) >= 20


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.2-3B", "Qwen/Qwen3-1.7B"])
def test_recompute_costs_what_the_same_budget_sweeps_measured(name):
    """Session 29, call 1: one budget per model, only the recomputed layers changed (Llama-3.2-3B 5 to 28 of 28,
    Qwen3-1.7B none to 17). The step time's change per recomputed layer, priced (each checkpointed layer's forward
    FLOPs again at the step's rate) against measured: within 25% (priced 20% and 18% steeper, not fitted: the
    recomputed forward runs faster than the step's average rate, and Llama's 28-layer plan is priced launch-bound,
    the CPU launch term growing with recompute)."""
    sys.path.insert(0, str(REPO / "bench"))
    from model_zoo import BENCH_MEAN_SEQ_FRACTION

    rows = json.loads((REPO / "bench" / "results" / "model_zoo.json").read_text())
    sweep = [r for r in rows if r.get("run") == "h100_session29 call 1" and r["model"] == name]
    model, hardware = load_model_spec(name), load_profile("h100")
    points = []
    for row in sweep:
        plan = Plan.from_label(row["plan"], alloc_conf="expandable_segments:True")
        recomputed = plan.checkpointed_layers(model.num_layers) if plan.gradient_checkpointing else 0
        predicted = predict_tokens_per_s(model, plan, hardware, 2048, BENCH_MEAN_SEQ_FRACTION)
        points.append((recomputed, 1.0 / row["steady_tokens_per_s"], 1.0 / predicted))
    (low, measured_low, priced_low), *_, (high, measured_high, priced_high) = sorted(points)
    assert len(points) >= 2 and high > low
    ratio = (priced_high - priced_low) / (measured_high - measured_low)
    assert ratio == pytest.approx(1.0, abs=0.25)


def test_fused_projections_cost_their_copies():
    from lf_adapter.throughput import fused_projection_copies_s

    phi3, llama = load_model_spec("microsoft/Phi-3-mini-4k-instruct"), load_model_spec("meta-llama/Llama-3.2-3B")
    plan = Plan.from_label("bf16/mbs4xga16x1/gc29/liger/sdpa/master/padfree/sorted/tb8192")
    assert fused_projection_copies_s(llama, plan, 8192, 0.5, 3.35) == 0.0  # separate q, k, v, gate and up
    fused = fused_projection_copies_s(phi3, plan, 8192, 0.5, 3.35)
    with run_kernels.measured_with(run_kernels.BEFORE):  # liger's chunked SwiGLU: its copies and concatenation
        chunked = fused_projection_copies_s(phi3, plan, 8192, 0.5, 3.35)
    h, inter = phi3.hidden_size, phi3.intermediate_size
    qkv_bytes = 4 * 2 * h * 1.5 + 22 * 3 * h  # RoPE's q/k copies (forward and recompute); the slices' gradients
    streaming = 3.35e12 * 0.6
    assert fused == pytest.approx(8192 * phi3.num_layers * qkv_bytes / streaming)
    assert chunked - fused == pytest.approx(8192 * phi3.num_layers * (8 * inter * 1.5 + 8 * inter) / streaming)
    assert fused_projection_copies_s(phi3, plan.replace(liger=False), 8192, 0.5, 3.35) == 0.0


def test_the_loss_chunks_cost_what_call_1_of_session_28_measured():
    """Same plan, same call: liger's own 256-row chunks against lfa's 2,048-row ones; the kernel profiles' GEMM time
    per micro-batch moved by what fused_loss_walk_s prices (each chunk's GEMMs at the longer of FLOPs and bytes)."""
    from lf_adapter.memory import coefficients
    from lf_adapter.throughput import fused_loss_walk_s

    rows = json.loads((REPO / "bench" / "results" / "model_zoo.json").read_text())
    pair = [r for r in rows if r.get("run") == "h100_session28 call 1" and "/gc12/" in r["plan"]]
    assert [run_kernels.of_row(r).loss_chunk_min_rows for r in pair] == [0, 2048]
    own, lfa = (r["kernel_profile"]["kinds_s"]["GEMMs"] for r in pair)
    # the profiled step (the 6th) is not in micro_batches_per_step (steps 1-5): 11, as call 2's Phi-3 events recorded
    # for the same rows under the same 8,192-token budget
    measured_s = (own - lfa) / 11
    llama, hardware = load_model_spec("meta-llama/Llama-3.2-3B"), load_profile("h100")
    plan = Plan.from_label(pair[0]["plan"])
    rate = hardware.gpu.peak_tflops_16bit * 1e12 * coefficients()["throughput"]["mfu_max"]
    with run_kernels.measured_with(run_kernels.BEFORE):
        liger_s = fused_loss_walk_s(llama, plan, 7851, rate, hardware.gpu.hbm_tbps)
    lfa_s = fused_loss_walk_s(llama, plan, 7851, rate, hardware.gpu.hbm_tbps)
    assert lfa_s == 0.0  # 2,048-row chunks: compute-bound GEMMs
    assert liger_s == pytest.approx(measured_s, rel=0.25)
