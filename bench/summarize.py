"""The headline figures: capped plan vs the seed's fix, MFU of the 1.3B and 6.7B default h200 plans, and whether the
default plans are exact (no packing). Writes bench/results/summary.json from every run; named runs are only
printed, so that a look at one run does not replace the headline file with its figures.

usage: python bench/summarize.py [RUN ...]   (results folders holding seed_scenario.json, or runs' JSON files;
default: every bench/results/h200_session*/**/seed*.json). Each figure comes from the newest run that measured it
(session number, then path) and names that run. The ratio to the seed's fix is only taken within one run: the
median over its alternated repeats (seed_fix, capped, seed_fix#2, capped#2, ...; seed_scenario.py --repeats).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# row labels of bench/seed_scenario.py; "v100" is what runs A-D of session 9 called the capped plan
CAPPED = ("capped", "v100")
H200_13B = "h200"
H200_67B = "h200_6.7b"
DEFAULT_ROWS = (*CAPPED, H200_13B, H200_67B)


def run_files(paths: list[Path] | None = None) -> list[Path]:
    """Results files, oldest first (session number, then path)."""
    if paths:
        files = [p / "seed_scenario.json" if p.is_dir() else p for p in paths]
    else:
        files = sorted(RESULTS.glob("h200_session*/**/seed*.json"))  # seed_scenario.py tables, some renamed
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise SystemExit(f"not a run's JSON or a folder holding seed_scenario.json: {', '.join(missing)}")

    def session(path: Path) -> tuple[int, str]:
        match = re.search(r"session(\d+)", str(path))
        return (int(match[1]) if match else -1, str(path))

    return sorted(files, key=session)


def repeat_pairs(rows: dict) -> list[tuple[dict, dict]]:
    """(seed_fix, capped) rows of each alternated pair in one run (repeat i pairs seed_fix#i with capped#i)."""
    pairs = []
    for suffix in [""] + [f"#{i}" for i in range(2, 100)]:
        seed = rows.get("seed_fix" + suffix)
        capped = next((rows[c + suffix] for c in CAPPED if c + suffix in rows), None)
        if seed is None or capped is None:
            if suffix:
                break
            continue
        if seed.get("steady_tokens_per_s") and capped.get("steady_tokens_per_s"):
            pairs.append((seed, capped))
    return pairs


def figures_of(rows: dict) -> dict:
    """The figures one run measured (absent when it did not)."""
    out = {}
    pairs = repeat_pairs(rows)
    if pairs:
        ratios = [capped["steady_tokens_per_s"] / seed["steady_tokens_per_s"] for seed, capped in pairs]
        out["capped_x_seed_fix"] = {
            "value": round(statistics.median(ratios), 2),
            "repeats": [round(r, 2) for r in ratios],
            # the seed's fix is bound by the host launching its kernels, so the ratio depends on the host
            "seed_fix_tokens_per_s": [seed["steady_tokens_per_s"] for seed, _ in pairs],
            "capped_tokens_per_s": [capped["steady_tokens_per_s"] for _, capped in pairs],
        }
    for figure, label in (("h200_1.3b_mfu", H200_13B), ("h200_6.7b_mfu", H200_67B)):
        if rows.get(label, {}).get("mfu"):
            out[figure] = {"value": rows[label]["mfu"], "plan": rows[label].get("plan")}
            compiles = rows[label].get("jit_compiles")
            if compiles:  # kernels Triton compiled during the measured steps (0: a warm cache; seed_scenario.py)
                out[figure]["jit_compiles_in_measured_steps"] = sum(c or 0 for c in compiles[1:])
    defaults = [r for label, r in rows.items() if label.split("#")[0] in DEFAULT_ROWS and r.get("plan")]
    if defaults:
        out["default_plans_exact"] = {"value": all("packing" not in str(r["plan"]) for r in defaults)}
    return out


def summarize(files: list[Path]) -> dict:
    summary = {}
    for path in files:  # oldest first: a newer run's figure replaces an older one
        for figure, entry in figures_of(json.loads(path.read_text())).items():
            summary[figure] = {**entry, "run": str(path.relative_to(RESULTS.parent.parent))}
    return summary


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        raise SystemExit(__doc__)
    files = run_files([Path(a).resolve() for a in sys.argv[1:]])
    if not files:
        raise SystemExit("no bench/results/h200_session*/seed_scenario.json: run bench/device_run.sh seed first")
    summary = summarize(files)
    print(f"{'figure':20s} {'value':>7s}  run")
    for figure, entry in summary.items():
        extra = (
            f" (median of {entry['repeats']}; the seed's fix ran {entry['seed_fix_tokens_per_s']} tok/s)"
            if "repeats" in entry
            else ""
        )
        print(f"{figure:20s} {entry['value']!s:>7s}  {entry['run']}{extra}")
    if len(sys.argv) > 1:
        print(f"named runs: {RESULTS / 'summary.json'} left as it is (it summarizes every run)")
        return
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {RESULTS / 'summary.json'}")


if __name__ == "__main__":
    main()
