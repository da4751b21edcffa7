"""Predicted (lf_adapter.throughput.predict_tokens_per_s) vs measured steady-state tokens/s for the H200 bench runs.

usage: python bench/model_check.py [bench/results/h200_session9/runD.json ...]
The measured mean row length (1,475 tokens of 2,048 after truncation, bench/README.md) is given to the model, so
this checks the throughput model alone, not lfa's length estimate from characters.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_zoo import BENCH_LENGTH_QUANTILES as LENGTH_QUANTILES  # noqa: E402

from lf_adapter.hardware import load_profile  # noqa: E402
from lf_adapter.memory import coefficients  # noqa: E402
from lf_adapter.plan import Plan  # noqa: E402
from lf_adapter.plugin import run_kernels  # noqa: E402
from lf_adapter.throughput import predict_tokens_per_s  # noqa: E402
from seed_scenario import catalog_spec  # noqa: E402

MEAN_FRACTION = 1475 / 2048


def profile_of(label: str, run: str = "") -> str:
    """The card a run ran on, by its folder (h100_session*: an H100; seed_scenario.py --whole-profile h100 for the
    whole-card plans), the H200 by default; capped (the seed's card, emulated by the capped allocator) for the seed
    fix and the capped plans, which seed_scenario.py plans for h200-capped-32g on either card."""
    card = "h100" if "h100_session" in run else "h200"
    return f"{card}-capped-32g" if label.startswith(("seed_fix", "capped", "v100")) else card


def spec_of(label: str, row: dict):
    """The 1.3B shape unless the row names another: the offload bench's model folder, or a label suffix
    (seed_scenario --model-dir model_6.7b labels h200_6.7b)."""
    if row.get("model"):
        return catalog_spec(row["model"])
    return catalog_spec(
        next(
            (
                folder
                for folder in ("model_6.7b", "model_6.7b-12l", "model_350m")
                if label.endswith(folder.removeprefix("model"))
            ),
            "model",
        )
    )


def plan_of(label: str, row: dict) -> Plan | None:
    if (
        label.split("#")[0] == "seed_fix"
    ):  # the seed author's recipe: fp16, bs1 ga16, checkpointing on, no liger, auto -> sdpa
        return Plan("fp16", 1, 16, gradient_checkpointing=True, liger=False, attention="sdpa")
    text = row.get("plan")
    if not text or not row.get("steady_tokens_per_s"):
        return None
    return Plan.from_label(text)


def predicted_tokens_per_s(label: str, row: dict, run: str, plan: Plan) -> float:
    """The throughput model's figure for one row of a seed run (its plan: plan_of), priced on the card it ran on with
    the kernels it ran (before session 28: liger's own chunks)."""
    with run_kernels.measured_with(run_kernels.of_row(row)):
        return predict_tokens_per_s(
            spec_of(label, row), plan, load_profile(profile_of(label, run)), 2048, MEAN_FRACTION, LENGTH_QUANTILES
        )


def main() -> None:
    runs = sys.argv[1:] or [
        *sorted(str(p) for p in Path("bench/results/h200_session9").glob("run[CD].json")),
        "bench/results/h200_session10/seed_deepspeed.json",
        *sorted(str(p) for p in Path("bench/results/h200_session11").glob("offload_run*.json")),
        *sorted(str(p) for p in Path("bench/results/h200_session13").glob("*.json")),
        *sorted(str(p) for p in Path("bench/results/h200_session14").glob("*.json")),
        *sorted(str(p) for p in Path("bench/results/h200_session17").glob("seed*.json")),
        # session 26: master weights (call 1's same-plan pair fitted autocast_residual_bytes; the rest validate)
        *sorted(str(p) for p in Path("bench/results").glob("h*_session26/**/seed_scenario.json")),
    ]
    worst = 0.0
    print(f"{'run':36s} {'plan':52s} {'measured':>9s} {'predicted':>9s} {'error':>7s}")
    for run in runs:
        for label, row in json.loads(Path(run).read_text()).items():
            if label.startswith("_"):  # a note on where the rows come from
                continue
            plan = plan_of(label, row)
            if plan is None or (row.get("steps_measured") or 9) < 3:
                continue
            predicted = predicted_tokens_per_s(label, row, run, plan)
            measured = row["steady_tokens_per_s"]
            error = predicted / measured - 1
            worst = max(worst, abs(error))
            name = Path(run).stem if "session26" not in run else "/".join(Path(run).parts[2:4])
            print(f"{name + ':' + label:36s} {plan.label():52s} {measured:9,d} {predicted:9,.0f} {error:+7.1%}")
    print(f"worst |error|: {worst:.1%}")
    width_check()


def width_check() -> None:
    """The width term below the fitted hidden size: calibrate.py's bf16 rows of the 350M (hidden 1024) against the
    1.3B's (2048) of the same run. Those step times are noisy (3 steady steps; the first configuration of a size runs
    4-7x slow, bench/README.md), so each size gets the median error, compared only within one run."""
    from calibration_table import RUNS, spec_for

    t = coefficients()["throughput"]
    h200 = load_profile("h200")
    print(
        f"\nwidth term on calibrate.py's short runs (median error per size; "
        f"x{(1024 / t['fitted_hidden_size']) ** t['width_rate_exponent']:.2f} at 1024)"
    )
    for run in RUNS:
        errors: dict[str, list[float]] = {}
        for r in json.loads(Path(run).read_text())["rows"]:
            if r["precision"] != "bf16" or not r.get("tokens_per_s"):
                continue
            mean_fraction = r["real_tokens_per_step"] / (r["mbs"] * r.get("ga", 1) * r["seq"])
            plan = Plan(
                "bf16", r["mbs"], r.get("ga", 1), gradient_checkpointing=r["gc"], liger=r["liger"], attention="sdpa"
            )
            with run_kernels.measured_with(run_kernels.of_row(r)):  # the kernels it ran (before session 28: liger's)
                predicted = predict_tokens_per_s(spec_for(r["size"]), plan, h200, r["seq"], mean_fraction)
            errors.setdefault(r["size"], []).append(predicted / r["tokens_per_s"] - 1)
        print(
            f"{Path(run).parent.name + '/' + Path(run).name:52s} "
            + "  ".join(f"{size} {statistics.median(e):+6.1%} (n={len(e)})" for size, e in errors.items())
        )


if __name__ == "__main__":
    main()
