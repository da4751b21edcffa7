"""Predicted (lf_adapter.memory) vs measured peak memory for every calibration point; prints a table, writes JSON.

usage: python bench/calibration_table.py [RUN.json ...] [--out table.json]
Points: the H200 calibration runs (bench/calibrate.py) and the shared anchor table (1.3B, accumulation 4-16).

Two errors per point. Allocated (what the memory model computes: tensors alive at the peak) is scored on every
point. Reserved (what the caching allocator holds, what an OOM is about) is scored against the allocator the run
used: lfa's GPU plans set expandable segments, where reserved is allocated plus a small constant; without them the
allocator's fragmentation varied from +1% to +49% of allocated here, which no shape-only model predicts, so those
points report the ratio instead of pretending to a fit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lf_adapter.memory import estimate  # noqa: E402
from lf_adapter.plan import Plan  # noqa: E402
from lf_adapter.plugin import run_kernels  # noqa: E402
from seed_scenario import catalog_spec  # noqa: E402

RUNS = ["bench/results/h200_calibration_run1.json", "bench/results/h200_session10/calibration.json"]
ANCHOR = [  # shared/reference/anchor README table: (precision, mbs, ga, gc, liger, allocated, reserved)
    ("bf16", 8, 8, True, False, 30.97, 32.56),
    ("fp16", 1, 16, True, False, 23.82, 25.39),
    ("fp16", 8, 8, True, True, 26.49, 27.25),
    ("fp16", 4, 4, True, True, 24.77, 25.93),
    ("bf16", 16, 4, True, True, 30.01, 31.55),
    ("bf16", 16, 4, False, True, 90.06, 92.78),
]
EXPANDABLE = "expandable_segments:True"
# seed-scenario runs of lfa's DeepSpeed plans on one H200 (1.3B, cutoff 2048, expandable segments)
DEEPSPEED_RUNS = {
    "bench/results/h200_session9/runD.json": ["h200_zero2_offload"],
    "bench/results/h200_session10/seed_deepspeed.json": ["h200_zero3", "h200_zero3_offload"],
}


def spec_for(size: str):
    """calibrate.py's size names (350m, 1.3b, 6.7b) to the bench model folders' shapes."""
    return catalog_spec("model" if size == "1.3b" else "model_" + size)


def load_points(runs: list[str]) -> list[dict]:
    points = []
    for run in runs:
        for r in json.loads(Path(run).read_text())["rows"]:
            if not r["liger"] and not r.get("isolated"):
                continue  # run 1 ran every config in one process: its no-liger points ran with liger's patches
            points.append(
                {
                    "source": Path(run).parent.name if "session" in run else "run1",
                    "model": r["size"],
                    "precision": r["precision"],
                    "mbs": r["mbs"],
                    "ga": r.get("ga", 1),
                    "gc": r["gc"],
                    "liger": r["liger"],
                    "alloc_conf": r.get("alloc_conf"),
                    "allocated": r["peak_allocated_gib"],
                    "reserved": r["peak_reserved_gib"],
                    **run_kernels.carried(r),
                }
            )
    for run, labels in DEEPSPEED_RUNS.items():
        table = json.loads(Path(run).read_text())
        for label in labels:
            r = table[label]
            points.append(
                {
                    "source": label,
                    "model": "1.3b",
                    "plan": Plan.from_label(r["plan"], alloc_conf=EXPANDABLE),
                    "allocated": r["peak_allocated_gib"],
                    "reserved": r["peak_reserved_gib"],
                    **run_kernels.carried(r),
                }
            )
    for precision, mbs, ga, gc, liger, allocated, reserved in ANCHOR:
        points.append(
            {
                "source": "anchor",
                "model": "1.3b",
                "precision": precision,
                "mbs": mbs,
                "ga": ga,
                "gc": gc,
                "liger": liger,
                "alloc_conf": None,
                "allocated": allocated,
                "reserved": reserved,
            }
        )
    return points


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="*", default=RUNS)
    parser.add_argument("--out", default="bench/results/calibration_table.json")
    args = parser.parse_args()
    rows = []
    print(
        f"{'source':18s} {'model':5s} {'prec':4s} {'mbs':>3s} {'ga':>3s} {'gc':>3s} {'liger':>5s} {'alloc.':>6s} "
        f"{'meas.alloc':>10s} {'pred.alloc':>10s} {'err':>7s} {'meas.res':>8s} {'pred.res':>8s} {'err':>7s}"
    )
    for p in load_points(args.runs):
        plan = p.pop("plan", None) or Plan(
            precision=p["precision"],
            micro_batch_size=p["mbs"],
            grad_accum=p["ga"],
            gradient_checkpointing=p["gc"],
            liger=p["liger"],
            alloc_conf=p["alloc_conf"],
        )
        p.update(
            precision=plan.precision,
            mbs=plan.micro_batch_size,
            ga=plan.grad_accum,
            gc=plan.gradient_checkpointing,
            liger=plan.liger,
            alloc_conf=plan.alloc_conf,
            deepspeed=plan.deepspeed and plan.deepspeed + ("" if plan.offload == "none" else "+off"),
        )
        with run_kernels.measured_with(run_kernels.of_row(p)):  # the kernels it ran (before session 28: liger's own)
            pred = estimate(spec_for(p["model"]), plan, 2048, None)
        expandable = p["alloc_conf"] == EXPANDABLE
        row = {
            **p,
            "predicted_allocated": round(pred.allocated_gib, 2),
            "predicted_reserved": round(pred.reserved_gib, 2),
            "allocated_error": round(pred.allocated_gib / p["allocated"] - 1, 4),
            "reserved_error": round(pred.reserved_gib / p["reserved"] - 1, 4),
            "reserved_over_allocated": round(p["reserved"] / p["allocated"], 3),
            "scored_reserved": expandable,
        }
        rows.append(row)
        print(
            f"{p['source']:18s} {p['model']:5s} {p['precision']:4s} {p['mbs']:3d} {p['ga']:3d} {int(p['gc']):3d} "
            f"{int(p['liger']):5d} {'expand' if expandable else 'default':>6s} {p['allocated']:10.2f} "
            f"{pred.allocated_gib:10.2f} {row['allocated_error']:+7.1%} {p['reserved']:8.2f} {pred.reserved_gib:8.2f} "
            f"{row['reserved_error']:+7.1%}{'' if expandable else ' (not scored)'}"
        )
    worst_alloc = max(abs(r["allocated_error"]) for r in rows)
    scored = [r for r in rows if r["scored_reserved"]]
    worst_reserved = max(abs(r["reserved_error"]) for r in scored)
    ratios = [r["reserved_over_allocated"] for r in rows if not r["scored_reserved"]]
    summary = {
        "points": len(rows),
        "worst_abs_allocated_error": worst_alloc,
        "expandable_points": len(scored),
        "worst_abs_reserved_error_expandable": worst_reserved,
        "default_allocator_reserved_over_allocated": {
            "min": min(ratios),
            "median": statistics.median(ratios),
            "max": max(ratios),
        },
    }
    print(f"allocated: worst |error| {worst_alloc:.1%} over {len(rows)} points")
    print(
        f"reserved with expandable segments (lfa's GPU plans): worst |error| {worst_reserved:.1%} over {len(scored)} "
        f"points"
    )
    print(
        f"reserved / allocated with the default allocator: min {min(ratios):.2f}, median "
        f"{statistics.median(ratios):.2f}, max {max(ratios):.2f} over {len(ratios)} points"
    )
    Path(args.out).write_text(json.dumps({**summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
