"""Memory probe (device): peak GPU memory of pinned DeepSpeed plans at exact token counts, to separate the terms of
lfa's memory model that the zoo's default plans mix (model_zoo.py measures those plans; this varies one thing at a
time). Every row of the probe's data is longer than cutoff_len, so each micro-batch holds exactly mbs x cutoff_len
tokens. One process per configuration (lfa generate with pins + lfa train, 2 steps), the whole H200 (no cap: the
memory a plan needs, not whether it fits), fp16 like the capped card. Rows go to OUT/memory_probe.json with lfa's
predicted items; `--table` prints them priced again with today's model.

usage: python bench/memory_probe.py ASSETS_DIR OUT_DIR [--only LABEL,...] [--deadline-s 500]
       python bench/memory_probe.py --table bench/results/memory_probe.json  # here
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_zoo import build_model, run_one  # noqa: E402

CUTOFF = 2048
SMALL_VOCAB = 32256  # the DeepSeek-Coder vocabulary: the same shape with a 4.7x smaller lm_head


@dataclass(frozen=True)
class Probe:
    label: str
    model: str
    micro_batch: int
    accumulation: int
    checkpoint_layers: int  # the first k decoder layers recompute; 0: checkpointing off
    sharding: str = "zero2"
    offload: str = "optimizer"
    vocab: int | None = None  # None: the zoo shape's


QWEN3 = "Qwen/Qwen3-1.7B"  # 28 layers, hidden 2048, ffn 6144, vocabulary 151,936 (tied)
ALL = 28
PROBES = [
    Probe("q3-mbs1-ga1-gc", QWEN3, 1, 1, ALL),
    Probe("q3-mbs8-ga1-gc", QWEN3, 8, 1, ALL),
    Probe("q3-mbs16-ga1-gc", QWEN3, 16, 1, ALL),
    Probe("q3-mbs8-ga4-gc", QWEN3, 8, 4, ALL),
    Probe("q3-mbs8-ga1-gc14", QWEN3, 8, 1, 14),
    Probe("q3v32k-mbs8-ga1-gc", QWEN3, 8, 1, ALL, vocab=SMALL_VOCAB),
    Probe("q3v32k-mbs16-ga1-gc", QWEN3, 16, 1, ALL, vocab=SMALL_VOCAB),
    Probe("q3-mbs8-ga1-gc-zero2", QWEN3, 8, 1, ALL, offload="none"),
]


def plan_args(probe: Probe) -> tuple[str, ...]:
    pins = {
        "micro_batch_size": probe.micro_batch,
        "sharding": probe.sharding,
        "offload": probe.offload,
        "liger": "true",
        "gradient_checkpointing": "true" if probe.checkpoint_layers else "false",
    }
    if probe.checkpoint_layers:
        pins["checkpoint_layers"] = probe.checkpoint_layers
    args = ["--effective-batch", str(probe.micro_batch * probe.accumulation), "--no-token-budget"]
    for field, value in pins.items():
        args += ["--pin", f"{field}={value}"]
    return ("--precision", "fp16", *args)


def long_rows(assets: Path) -> Path:
    """The bench rows joined three at a time, kept where the bench tokenizer makes the prompt and the answer each
    longer than cutoff_len: truncation then cuts every row to exactly cutoff_len tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets / "model")
    rows = [json.loads(line) for line in (assets / "pseudo2norm.jsonl").read_text().splitlines()]
    path = assets / "probe_long.jsonl"
    kept = 0
    with path.open("w") as out:
        for i in range(0, len(rows) - 2, 3):
            joined = {key: "\n".join(r[key] for r in rows[i : i + 3]) for key in ("instruction", "input", "output")}
            if min(len(tokenizer(joined[key])["input_ids"]) for key in ("input", "output")) > CUTOFF:
                out.write(json.dumps(joined) + "\n")
                kept += 1
    print(f"BENCH probe data: {kept} rows, each longer than {CUTOFF} tokens", flush=True)
    return path


def reprice(rows: list[dict]) -> None:
    """Each measured row priced by today's memory model (the probe's model folders are gone: the shape is the zoo's
    catalog entry, with the probe's vocabulary)."""
    from dataclasses import replace

    from lf_adapter.memory import estimate
    from lf_adapter.model_spec import load_model_spec
    from lf_adapter.plan import Plan
    from lf_adapter.plugin import run_kernels

    for r in rows:
        if not (r.get("plan") and r.get("peak_allocated_gib")):
            continue
        spec = load_model_spec(r["model"])
        if r.get("vocab"):
            spec = replace(spec, vocab_size=r["vocab"])
        plan = Plan.from_label(r["plan"], alloc_conf="expandable_segments:True")
        with run_kernels.measured_with(run_kernels.of_row(r)):  # the kernels it ran (before session 28: liger's own)
            est = estimate(spec, plan, CUTOFF, None)
        r["now_allocated_gib"] = round(est.allocated_gib, 2)
        r["now_items_gib"] = {k: round(v, 2) for k, v in est.items.items()}
        r["now_error"] = round(r["peak_allocated_gib"] / est.allocated_gib - 1.0, 4)


def print_table(rows: list[dict]) -> None:
    print(f"{'label':24s} {'plan':60s} {'meas alloc':>10s} {'pred now':>9s} {'err':>7s}")
    for r in rows:
        err = f"{100 * r['now_error']:+.1f}%" if r.get("now_error") is not None else "-"
        print(
            f"{r['label']:24s} {str(r.get('plan'))[:60]:60s} {r.get('peak_allocated_gib') or 0:10.2f} "
            f"{r.get('now_allocated_gib') or 0:9.2f} {err:>7s}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("assets", type=Path, nargs="?")
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--only", default="")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--deadline-s", type=float, default=500.0, help="start no new run after this many seconds")
    parser.add_argument("--table", type=Path)
    args = parser.parse_args()
    if args.table:
        rows = json.loads(args.table.read_text())
        reprice(rows)
        args.table.write_text(json.dumps(rows, indent=1))
        print_table(rows)
        return
    started = time.time()
    dataset = long_rows(args.assets)
    work = args.assets / "probe"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "memory_probe.json"
    rows: list[dict] = []
    for probe in [p for p in PROBES if not args.only or p.label in args.only.split(",")]:
        if time.time() - started > args.deadline_s:
            rows.append({"label": probe.label, "note": "not run: the call's deadline passed"})
            continue
        overrides = {"vocab_size": probe.vocab} if probe.vocab else None
        model_dir = build_model(args.assets, probe.model, overrides, suffix=f"_v{probe.vocab}" if probe.vocab else "")
        run_started = time.time()
        row = run_one(
            probe.model, "h200", model_dir, work, args.out, args.steps, plan_args(probe), dataset, probe.label
        )
        row.update(label=probe.label, vocab=probe.vocab, run_s=round(time.time() - run_started, 1))
        rows.append(row)
        results.write_text(json.dumps(rows, indent=1))
        print(f"BENCH {probe.label} in {row['run_s']:.0f}s: {json.dumps(row)[:400]}", flush=True)
    print_table(rows)


if __name__ == "__main__":
    main()
