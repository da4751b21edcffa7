"""Calibrate lfa's memory and throughput models against real LLaMA-Factory steps on a GPU.

Runs a matrix (model sizes x micro-batch 1/4/8 x checkpointing on/off x liger on/off) of short full-SFT runs,
each in its own process (LLaMA-Factory's run_exp, with lfa's plugin installed): liger patches transformers'
modules process-wide, so a no-liger run after a liger run in one process measures liger again. Records peak
allocated/reserved memory and steady-state step times, prints predicted vs measured, writes JSON
(bench/calibration_table.py reads it).

usage: python bench/calibrate.py ASSETS_DIR OUT.json [--sizes 350m,1.3b] [--mbs 1,4,8] [--liger on,off]
                                 [--gc on,off] [--ga 1] [--deadline-s 500]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lf_adapter.memory import estimate  # noqa: E402
from lf_adapter.model_spec import load_model_spec  # noqa: E402
from lf_adapter.plan import Plan  # noqa: E402
from lf_adapter.plugin import contract, run_kernels  # noqa: E402


def run_config(
    assets: Path,
    model_dir: Path,
    mbs: int,
    gc_on: bool,
    liger: bool,
    precision: str,
    steps: int,
    events: Path,
    cutoff: int,
    ga: int = 1,
) -> dict:
    from lf_adapter.plugin import hooks

    hooks.install()  # import hooks: before LLaMA-Factory's modules load
    import torch
    from llamafactory.train.tuner import run_exp

    args = {
        "model_name_or_path": str(model_dir),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "full",
        "dataset": "pseudo2norm",
        "dataset_dir": str(assets),
        "template": "sk2decompile",
        "cutoff_len": cutoff,
        "tokenized_path": str(assets / f"tokenized_{model_dir.name}_{cutoff}"),
        "preprocessing_num_workers": 8,
        "dataloader_num_workers": 2,
        "output_dir": str(assets / "out" / "calib"),
        "overwrite_output_dir": True,
        "save_strategy": "no",
        "report_to": "none",
        "logging_steps": 1,
        "per_device_train_batch_size": mbs,
        "gradient_accumulation_steps": ga,
        "learning_rate": 3.0e-6,
        "max_steps": steps,
        "lr_scheduler_type": "constant",
        **({precision: True} if precision in ("bf16", "fp16") else {}),
        "flash_attn": "sdpa",
        "enable_liger_kernel": liger,
        "disable_gradient_checkpointing": not gc_on,
        "disable_tqdm": True,
    }
    if events.exists():
        events.unlink()
    os.environ[contract.EVENTS_FILE] = str(events)
    os.environ[contract.BENCH_SKIP_FINAL_SAVE] = "1"  # a 6.7B final save filled the device's disk
    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.time()
    error = None
    try:
        run_exp(args)
    except torch.OutOfMemoryError as exc:
        error = "OOM: " + str(exc)[:200]
    except Exception as exc:  # record and continue with the matrix
        error = f"{exc.__class__.__name__}: {str(exc)[:300]}"
    result = {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
        "wall_s": time.time() - started,
        "error": error,
    }
    lines = events.read_text().splitlines() if events.exists() else []
    events_seen = [json.loads(line) for line in lines if line.strip()]
    steady = [e for e in events_seen if e.get("event") == "step" and e.get("step_tokens")][1:]
    # step 1 carries CUDA/cuBLAS warm-up and the optimizer-state allocation
    if steady:
        seconds = sum(s["step_time_s"] for s in steady)
        tokens = sum(s["step_tokens"] for s in steady)
        result.update(
            step_time_s=seconds / len(steady),
            tokens_per_s=tokens / seconds if seconds else None,
            real_tokens_per_step=tokens / len(steady),
        )
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def run_isolated(config: dict, events: Path, alloc_conf: str | None) -> dict:
    """One configuration in a fresh interpreter; its result comes back as the last stdout line."""
    env = {**os.environ, **({"PYTORCH_CUDA_ALLOC_CONF": alloc_conf} if alloc_conf else {})}
    proc = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps({**config, "events": str(events)})],
        capture_output=True,
        text=True,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][len("RESULT ") :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {
        "peak_allocated_gib": 0.0,
        "peak_reserved_gib": 0.0,
        "wall_s": 0.0,
        "error": f"exit {proc.returncode}: " + " | ".join(tail)[:300],
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        c = json.loads(sys.argv[2])
        result = run_config(
            Path(c["assets"]),
            Path(c["model_dir"]),
            c["mbs"],
            c["gc"],
            c["liger"],
            c["precision"],
            c["steps"],
            Path(c["events"]),
            c["cutoff"],
            c["ga"],
        )
        print("RESULT " + json.dumps(result), flush=True)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("assets", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--sizes", default="350m,1.3b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cutoff", type=int, default=2048)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--mbs", default="1,4,8")
    parser.add_argument("--gc", default="on,off")
    parser.add_argument("--liger", default="on,off", help="off only on CPU: liger needs a GPU")
    parser.add_argument("--ga", default="1", help="gradient accumulation values")
    parser.add_argument("--expandable", action="store_true", help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    parser.add_argument("--deadline-s", type=float, default=0, help="start no new run after this many seconds")
    args = parser.parse_args()
    started = time.time()
    import torch

    cuda = torch.cuda.is_available()
    vram = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    on_off = {"on": True, "off": False}
    alloc_conf = "expandable_segments:True" if args.expandable else None
    rows = json.loads(args.out.read_text())["rows"] if args.out.exists() else []
    for size in args.sizes.split(","):
        model_dir = args.assets / ("model" if size == "1.3b" else f"model_{size}")
        spec = load_model_spec(str(model_dir))
        for mbs, gc_on, liger, ga in itertools.product(
            [int(m) for m in args.mbs.split(",")],
            [on_off[g] for g in args.gc.split(",")],
            [on_off[g] for g in args.liger.split(",")],
            [int(g) for g in args.ga.split(",")],
        ):
            if args.deadline_s and time.time() - started > args.deadline_s:
                print(f"CALIB deadline: skipped {size} mbs{mbs} gc={int(gc_on)} liger={int(liger)} ga{ga}", flush=True)
                continue
            plan = Plan(
                precision=args.precision,
                micro_batch_size=mbs,
                grad_accum=ga,
                gradient_checkpointing=gc_on,
                liger=liger,
                attention="sdpa",
                alloc_conf=alloc_conf,
            )
            predicted = estimate(spec, plan, args.cutoff, vram)
            config = {
                "assets": str(args.assets),
                "model_dir": str(model_dir),
                "mbs": mbs,
                "gc": gc_on,
                "liger": liger,
                "precision": args.precision,
                "steps": args.steps,
                "cutoff": args.cutoff,
                "ga": ga,
            }
            measured = run_isolated(config, args.out.with_suffix(".events.jsonl"), alloc_conf)
            row = {
                "size": size,
                "params": spec.num_params,
                "hidden": spec.hidden_size,
                "ffn": spec.intermediate_size,
                "layers": spec.num_layers,
                "vocab": spec.vocab_size,
                "mbs": mbs,
                "ga": ga,
                "gc": gc_on,
                "liger": liger,
                "isolated": True,
                "alloc_conf": alloc_conf,
                "precision": args.precision,
                "seq": args.cutoff,
                "predicted_reserved_gib": predicted.reserved_gib,
                "predicted_items_gib": predicted.items,
                run_kernels.ROW_KEY: run_kernels.record(os.environ),  # the knobs run_isolated's process inherits
                **measured,
            }
            rows.append(row)
            err = (predicted.reserved_gib / row["peak_reserved_gib"] - 1) * 100 if row["peak_reserved_gib"] else 0.0
            print(
                f"CALIB {size:5s} mbs{mbs} ga{ga} gc={int(gc_on)} liger={int(liger)} exp={int(bool(alloc_conf))}"
                "  measured "
                f"{row['peak_reserved_gib']:6.2f} GiB (alloc {row['peak_allocated_gib']:6.2f})  predicted "
                f"{predicted.reserved_gib:6.2f} ({err:+5.1f}%)  step {row.get('step_time_s', 0):.3f}s"
                f"  {row.get('tokens_per_s') or 0:9.0f} tok/s  {row['wall_s']:.0f}s  {row['error'] or ''}",
                flush=True,
            )
            args.out.write_text(json.dumps({"vram_gib": vram, "device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
