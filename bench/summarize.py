"""The headline numbers of one H200 run: capped plan vs the seed's fix (same run), MFU of the 1.3B and 6.7B default
plans, and whether every default plan is exact (no packing). Writes bench/results/summary.json.

usage: python bench/summarize.py [RUN]   (a results folder holding seed_scenario.json, or one run's JSON such as
results/h200_session9/runD.json; default: the newest bench/results/h200_session*/seed_scenario.json); ratios are
only ever taken between rows of that one run. Figures a run did not measure are null, never borrowed from another
run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# row labels of bench/seed_scenario.py; "v100" is what runs A-D of session 9 called the capped plan
CAPPED = ("capped", "v100")
H200_13B = ("h200",)
H200_67B = ("h200_6.7b",)


def newest_run() -> Path:
    runs = [p.parent for p in RESULTS.glob("h200_session*/seed_scenario.json")]
    runs += [p.parent for p in RESULTS.glob("h200_session*/**/seed_scenario.json")]
    if not runs:
        raise SystemExit("no bench/results/h200_session*/seed_scenario.json: run bench/device_run.sh seed first")
    return max(
        runs, key=lambda p: (int(p.name.split("session")[-1]) if p.name.split("session")[-1].isdigit() else -1, str(p))
    )


def _first(rows: dict, labels: tuple[str, ...]) -> dict | None:
    return next((rows[label] for label in labels if label in rows), None)


def summarize(run: Path) -> dict:
    rows = json.loads((run if run.is_file() else run / "seed_scenario.json").read_text())
    seed, capped = rows.get("seed_fix"), _first(rows, CAPPED)
    h13, h67 = _first(rows, H200_13B), _first(rows, H200_67B)
    defaults = [r for label, r in rows.items() if label in CAPPED + H200_13B + H200_67B]

    def x_seed(row: dict | None) -> float | None:
        if seed and row and seed.get("steady_tokens_per_s") and row.get("steady_tokens_per_s"):
            return round(row["steady_tokens_per_s"] / seed["steady_tokens_per_s"], 2)
        return None

    return {
        "capped_x_seed_fix": x_seed(capped),
        "capped_padfree_x_seed_fix": x_seed(rows.get("capped_padfree")),  # --pin padding_free=true
        "h200_1.3b_mfu": h13.get("mfu") if h13 else None,
        "h200_6.7b_mfu": h67.get("mfu") if h67 else None,
        "default_plans_exact": bool(defaults) and all("packing" not in str(r.get("plan", "")) for r in defaults),
        "run": str(run.relative_to(RESULTS.parent.parent)),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        raise SystemExit(__doc__)
    run = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else newest_run()
    if not (run.is_file() or (run / "seed_scenario.json").is_file()):
        raise SystemExit(f"{sys.argv[1]}: neither a run's JSON nor a folder holding seed_scenario.json")
    summary = summarize(run)
    print(f"{'figure':22s} value")
    for key, value in summary.items():
        print(f"{key:22s} {value}")
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {RESULTS / 'summary.json'}")


if __name__ == "__main__":
    main()
