"""The throughput model: the layer width its rates scale with, and the zoo's measured speeds (bench/README.md)."""

import json
import sys

import pytest

from conftest import REPO
from lf_adapter.hardware import load_profile
from lf_adapter.model_spec import load_model_spec
from lf_adapter.plan import Plan
from lf_adapter.plugin import run_kernels
from lf_adapter.throughput import layer_width, predict_tokens_per_s, sub_cap_time_factor


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
    from model_zoo import SPEED_BOUND, reprice

    # outside, and why: StarCoder2's capped ZeRO-2 offload default of session 30 (+15.5%: its gc26 neighbour ran 8%
    # slower on other H100 hosts, whose CPU Adam and pinned copies the per-step term prices; one row, not refitted;
    # the same plan on session 38's H200 host: -2.6%); Gemma-2's eager master default on the H200 of session 30
    # (-10.3%): since the memory-bound share of a rate runs at the card's bandwidth (throughput.sub_cap_time_factor)
    # Gemma-2's H200 rows are priced 2-4% faster than before. Since the padding of sorted padded micro-batches is
    # built from the data's row lengths (throughput.sorted_step_padding, session 39), Gemma-2's 49k-token eager plan
    # (-17.1% -> -4.6%) and its capped ZeRO-2 plan of session 19 (-10.0% -> +2.0%) are inside
    known_outside = {
        ("bigcode/starcoder2-3b", "fp16/mbs8xga8x1/gc25/sdpa/zero2-offload-optimizer/padfree/sorted"),
        ("google/gemma-2-2b", "bf16/mbs4xga16x1/nogc/liger/eager/master/sorted/tb12288"),
    }
    rows = json.loads((REPO / "bench" / "results" / "model_zoo.json").read_text())
    reprice(rows)  # each row priced as it ran (its kernels), on the bench data's row lengths
    held_out = [r for r in rows if r.get("repriced_speed_error") is not None and not r.get("used_for_fit")]
    outside = {(r["model"], r["plan"]) for r in held_out if abs(r["repriced_speed_error"]) > SPEED_BOUND}
    assert outside == known_outside, [(r["model"], r["plan"], r["repriced_speed_error"]) for r in held_out]
    assert len(held_out) >= 80


def test_issue_33s_headline_rows_are_predicted_within_ten_percent():
    """Session 38's H200 calls: the 6.7B and 1.3B defaults on the whole card and the capped default's three
    alternated runs, each against the prediction for the kernels it ran (bench/model_check.py's pricing)."""
    sys.path.insert(0, str(REPO / "bench"))
    import model_check

    runs = sorted((REPO / "bench" / "results" / "h200_session38").glob("call*/seed_*/seed_scenario.json"))
    errors = {}
    for run in runs:
        for label, row in json.loads(run.read_text()).items():
            plan = None if label.startswith(("_", "seed_fix")) else model_check.plan_of(label, row)
            if plan is None:
                continue
            predicted = model_check.predicted_tokens_per_s(label, row, str(run), plan)
            errors[f"{run.parent.parent.name}/{run.parent.name}:{label}"] = row["steady_tokens_per_s"] / predicted - 1
    assert len(errors) == 6  # 6.7B, 1.3B twice, capped three times
    assert all(abs(error) <= 0.10 for error in errors.values()), {k: round(v, 3) for k, v in errors.items()}


def test_the_memory_bound_share_of_a_rate_runs_at_the_cards_bandwidth(monkeypatch):
    from lf_adapter.memory import coefficients

    h100, h200 = load_profile("h100"), load_profile("h200")
    cap = 989e12 * 0.55  # mfu_max: fixed shapes, GEMM-bound
    assert sub_cap_time_factor(cap, h200.gpu) == 1.0
    assert sub_cap_time_factor(0.8 * cap, h100.gpu) == pytest.approx(1.0, abs=1e-3)  # the reference card
    assert sub_cap_time_factor(0.8 * cap, h200.gpu) == pytest.approx(0.8 + 0.2 * 3.35 / 4.8, rel=1e-3)
    v100 = load_profile("v100-32g").gpu  # 139 FLOPs per byte, below the measured range: priced as the H200
    assert sub_cap_time_factor(0.8 * 125e12 * 0.55, v100) == pytest.approx(0.8 + 0.2 * 206.0 / 295.2, rel=1e-3)
    # the 6.7B's H200 default sits at the cap: its price does not depend on the reference; the 1.3B's does
    plans = (
        ("deepseek-ai/deepseek-coder-6.7b-base", "bf16/mbs2xga32x1/gc4/liger/sdpa/master/padfree/sorted/tb4096"),
        ("deepseek-ai/deepseek-coder-1.3b-base", "bf16/mbs32xga2x1/nogc/liger/sdpa/master/padfree/sorted/tb65536"),
    )
    priced = [predict_tokens_per_s(load_model_spec(n), Plan.from_label(p), h200, 2048, 0.72) for n, p in plans]
    monkeypatch.setitem(coefficients()["throughput"], "sub_cap_reference_flops_per_byte", 989.0 / 4.8)
    as_reference = [predict_tokens_per_s(load_model_spec(n), Plan.from_label(p), h200, 2048, 0.72) for n, p in plans]
    assert priced[0] == pytest.approx(as_reference[0])
    assert priced[1] / as_reference[1] == pytest.approx(1.05, abs=0.01)


def test_the_attention_row_copies_cost_what_the_squeeze_saved():
    """Session 30 against session 38, the 1.3B's H200 default (same plan, 93,315 tokens per step): the profiled
    step's copies, casts and elementwise fell from 0.131 to 0.055 s with the squeeze (attention_row_view); the
    copies priced for the indexed row are within 15% of that drop, and nothing is priced with the squeeze."""
    from lf_adapter.throughput import attention_row_copies_s

    results = REPO / "bench" / "results"
    before = json.loads((results / "h200_session30/call1/seed/seed_scenario.json").read_text())["h200"]
    after = json.loads((results / "h200_session38/call1/seed_3/seed_scenario.json").read_text())["h200"]
    kind = "copies, casts, other elementwise"
    drop = before["kernel_profile"]["kinds_s"][kind] - after["kernel_profile"]["kinds_s"][kind]
    model, plan = load_model_spec("deepseek-ai/deepseek-coder-1.3b-base"), Plan.from_label(after["plan"])
    assert before["tokens_per_step"] == after["tokens_per_step"]
    with run_kernels.measured_with(run_kernels.of_row(before)):
        priced = attention_row_copies_s(model, plan, before["tokens_per_step"], 4.8)
    assert priced == pytest.approx(drop, rel=0.15)
    with run_kernels.measured_with(run_kernels.of_row(after)):
        assert attention_row_copies_s(model, plan, after["tokens_per_step"], 4.8) == 0.0
    assert attention_row_copies_s(model, plan.replace(padding_free=False), 1e5, 4.8) == 0.0


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.2-3B", "Qwen/Qwen3-1.7B"])
def test_recompute_costs_what_the_same_budget_sweeps_measured(name):
    """Session 29, call 1: one budget per model, only the recomputed layers changed (Llama-3.2-3B 5 to 28 of 28,
    Qwen3-1.7B none to 17). The step time's change per recomputed layer, priced (each checkpointed layer's forward
    FLOPs again at the step's rate) against measured: within 25% (priced 20% and 18% steeper, not fitted: the
    recomputed forward runs faster than the step's average rate, and Llama's 28-layer plan is priced launch-bound,
    the CPU launch term growing with recompute)."""
    sys.path.insert(0, str(REPO / "bench"))
    from model_zoo import BENCH_LENGTH_QUANTILES, BENCH_MEAN_SEQ_FRACTION

    rows = json.loads((REPO / "bench" / "results" / "model_zoo.json").read_text())
    sweep = [r for r in rows if r.get("run") == "h100_session29 call 1" and r["model"] == name]
    model, hardware = load_model_spec(name), load_profile("h100")
    points = []
    for row in sweep:
        plan = Plan.from_label(row["plan"], alloc_conf="expandable_segments:True")
        recomputed = plan.checkpointed_layers(model.num_layers) if plan.gradient_checkpointing else 0
        with run_kernels.measured_with(run_kernels.of_row(row)):  # as it ran (its master gradients by the hook)
            fraction = BENCH_MEAN_SEQ_FRACTION
            predicted = predict_tokens_per_s(model, plan, hardware, 2048, fraction, BENCH_LENGTH_QUANTILES)
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


def test_fused_master_gradients_are_priced_at_what_wgrad_check_measured():
    """Session 38's bench/wgrad_check.py (the 6.7B's linears at 4,096 tokens, H200): adding the weight gradients into
    the fp32 masters inside the GEMM took 16.07 ms less per micro-batch than the hook path. The fused bytes per
    parameter were derived from that row (a check that the derivation and the linear weights counted agree, not a
    validation); runs that did not fuse (every row before session 40, LFA_FUSED_WGRAD=0) keep the hook's price."""
    import dataclasses

    from lf_adapter.throughput import master_accumulate_bytes, streaming_bytes_per_s

    measured = json.loads(next((REPO / "bench/results/h200_session38/call1").glob("wgrad_check_*.json")).read_text())
    saved_ms = measured["hook"]["ms_per_micro_batch"] - measured["fused"]["ms_per_micro_batch"]
    model = load_model_spec(measured["model"])
    fused_bytes = master_accumulate_bytes(model)
    with run_kernels.measured_with(dataclasses.replace(run_kernels.KernelChoices(), fused_weight_gradients=False)):
        hook_bytes = master_accumulate_bytes(model)
    assert hook_bytes == 10.0 * model.num_params
    with run_kernels.measured_with(run_kernels.of_row({})):  # a row from before the record: the hook
        assert master_accumulate_bytes(model) == hook_bytes
    priced_ms = (hook_bytes - fused_bytes) / streaming_bytes_per_s(4.8) * 1e3
    assert priced_ms == pytest.approx(saved_ms, rel=0.05)


def test_sorted_padded_micro_batches_pad_what_random_steps_of_the_same_rows_pad():
    """throughput.sorted_step_padding runs the plugin's grouping on one typical step built from the data's
    row-length profile; 300 random steps drawn from the rows themselves, cut by the same grouping, pad within 1.5
    points of it, from two rows per micro-batch to sixteen (where a fixed residual would price them all alike)."""
    import random

    from lf_adapter.data import length_quantiles
    from lf_adapter.plugin.token_budget import group_rows, padded_width
    from lf_adapter.throughput import sorted_step_padding

    rng = random.Random(0)
    lengths = [min(2048, int(rng.lognormvariate(7.2, 0.6))) for _ in range(800)]  # a long tail clipped at 2048
    quantiles = length_quantiles(lengths, 2048)
    priced = {}
    for label in ("bf16/mbs2xga32x1/sorted/tb4096", "bf16/mbs16xga4x1/sorted/tb49152", "bf16/mbs8xga8x1/sorted"):
        plan = Plan.from_label(label)
        rows = plan.micro_batch_size * plan.grad_accum
        padded = real = 0
        for _ in range(300):
            step = rng.sample(lengths, rows)
            full = padded_width(max(step), max(step))
            if plan.token_budget:
                groups = group_rows(step, plan.token_budget, False, full)
            else:
                order = sorted(range(rows), key=lambda i: -step[i])
                groups = [order[k : k + plan.micro_batch_size] for k in range(0, rows, plan.micro_batch_size)]
            padded += sum(padded_width(max(step[i] for i in g), full) * len(g) for g in groups)
            real += sum(step)
        padded_len, _ = sorted_step_padding(plan, quantiles, 2048)
        priced[label] = padded_len / (sum(lengths) / len(lengths)) - 1  # over the mean row, as the model counts
        assert priced[label] == pytest.approx(padded / real - 1, abs=0.015), label
    assert priced["bf16/mbs2xga32x1/sorted/tb4096"] < 0.05 < priced["bf16/mbs16xga4x1/sorted/tb49152"]


def test_a_recipe_header_gives_the_row_length_profile_only_when_it_is_one():
    from lf_adapter.data import QUANTILE_STEPS, length_quantiles, quantiles_from_meta

    profile = length_quantiles([100, 2048, 700, 1500, 2048], 2048)
    assert len(profile) == QUANTILE_STEPS + 1 and profile[0] == round(100 / 2048, 4) and profile[-1] == 1.0
    assert quantiles_from_meta({"length_quantiles": list(profile)}) == profile
    for hostile in ("0.5", [0.5] * 3, [0.5] * 32 + ["1"], [0.9] + [0.5] * 32, [0.0] * 33, [True] * 33, None):
        assert quantiles_from_meta({"length_quantiles": hostile}) == (), hostile


def test_the_typical_step_cuts_as_many_padded_micro_batches_as_the_runs_did():
    """Every zoo row of a padded plan whose steps the plugin cut by a token budget recorded its micro-batches per
    step: the typical step built from the bench data's row lengths cuts within half a micro-batch of their mean (the
    residual's count was 0.3-0.9 short at 3 to 26 per step)."""
    sys.path.insert(0, str(REPO / "bench"))
    from model_zoo import BENCH_LENGTH_QUANTILES

    from lf_adapter.throughput import sorted_step_padding

    rows = json.loads((REPO / "bench" / "results" / "model_zoo.json").read_text())
    padded = [r for r in rows if r.get("micro_batches_per_step") and "/tb" in r["plan"] and "/padfree" not in r["plan"]]
    assert len({r["plan"] for r in padded}) >= 5
    for row in padded:
        with run_kernels.measured_with(run_kernels.of_row(row)):
            _, cut = sorted_step_padding(Plan.from_label(row["plan"]), BENCH_LENGTH_QUANTILES, 2048)
        measured = row["micro_batches_per_step"]
        assert abs(cut - sum(measured) / len(measured)) <= 0.5, (row["plan"], measured)
