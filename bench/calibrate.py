"""Calibrate lfa's memory and throughput models against real LLaMA-Factory steps on a GPU.

Runs a matrix (model sizes x micro-batch 1/4/8 x checkpointing on/off x liger on/off) of short full-SFT runs
in one process (LLaMA-Factory's run_exp, with lfa's plugin installed), records peak allocated/reserved memory and
steady-state step times, and prints predicted vs measured. Writes JSON for bench/fit_calibration.py.

usage: python bench/calibrate.py ASSETS_DIR OUT.json [--sizes 350m,1.3b] [--quick]
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lf_adapter.memory import estimate  # noqa: E402
from lf_adapter.model_spec import load_model_spec  # noqa: E402
from lf_adapter.plan import Plan  # noqa: E402


def run_config(assets: Path, model_dir: Path, mbs: int, gc_on: bool, liger: bool, precision: str, steps: int,
               events: Path, cutoff: int) -> dict:
    import torch
    from llamafactory.train.tuner import run_exp

    args = {
        "model_name_or_path": str(model_dir), "stage": "sft", "do_train": True, "finetuning_type": "full",
        "dataset": "pseudo2norm", "dataset_dir": str(assets), "template": "sk2decompile", "cutoff_len": cutoff,
        "tokenized_path": str(assets / f"tokenized_{model_dir.name}_{cutoff}"),
        "preprocessing_num_workers": 8, "dataloader_num_workers": 2,
        "output_dir": str(assets / "out" / "calib"), "overwrite_output_dir": True, "save_strategy": "no",
        "report_to": "none", "logging_steps": 1, "per_device_train_batch_size": mbs, "gradient_accumulation_steps": 1,
        "learning_rate": 3.0e-6, "max_steps": steps, "lr_scheduler_type": "constant",
        **({precision: True} if precision in ("bf16", "fp16") else {}),
        "flash_attn": "sdpa", "enable_liger_kernel": liger, "disable_gradient_checkpointing": not gc_on,
        "include_num_input_tokens_seen": "non_padding", "disable_tqdm": True,
    }
    if events.exists():
        events.unlink()
    os.environ["LFA_EVENTS_FILE"] = str(events)
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
    result = {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
              "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
              "wall_s": time.time() - started,
              "error": error}
    steps_seen = [json.loads(l) for l in events.read_text().splitlines() if '"event": "step"' in l] if events.exists() else []
    steady = steps_seen[1:]  # the first step carries CUDA/cuBLAS warm-up and optimizer-state allocation
    if steady:
        seconds = sum(s["step_time_s"] for s in steady)
        tokens = steady[-1]["num_input_tokens_seen"] - steps_seen[0]["num_input_tokens_seen"]
        result.update(step_time_s=seconds / len(steady), tokens_per_s=tokens / seconds if seconds else None,
                      real_tokens_per_step=tokens / len(steady))
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("assets", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--sizes", default="350m,1.3b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cutoff", type=int, default=2048)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--mbs", default="1,4,8")
    parser.add_argument("--no-liger", action="store_true", help="CPU smoke runs: liger needs a GPU")
    args = parser.parse_args()

    from lf_adapter.plugin import hooks

    hooks.install()
    import torch

    cuda = torch.cuda.is_available()
    vram = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None
    rows = []
    for size in args.sizes.split(","):
        model_dir = args.assets / ("model" if size == "1.3b" else f"model_{size}")
        spec = load_model_spec(str(model_dir))
        for mbs, gc_on, liger in itertools.product([int(m) for m in args.mbs.split(",")], [True, False],
                                                 [False] if args.no_liger else [True, False]):
            plan = Plan(precision=args.precision, micro_batch_size=mbs, grad_accum=1, gradient_checkpointing=gc_on,
                        liger=liger, attention="sdpa")
            predicted = estimate(spec, plan, args.cutoff, vram)
            measured = run_config(args.assets, model_dir, mbs, gc_on, liger, args.precision, args.steps,
                                  args.out.with_suffix(".events.jsonl"), args.cutoff)
            row = {"size": size, "params": spec.num_params, "hidden": spec.hidden_size, "ffn": spec.intermediate_size,
                   "layers": spec.num_layers, "vocab": spec.vocab_size, "mbs": mbs, "gc": gc_on, "liger": liger,
                   "precision": args.precision, "seq": args.cutoff, "predicted_reserved_gib": predicted.reserved_gib,
                   "predicted_items_gib": predicted.items, **measured}
            rows.append(row)
            err = (predicted.reserved_gib / row["peak_reserved_gib"] - 1) * 100 if row["peak_reserved_gib"] else 0.0
            print(f"CALIB {size:5s} mbs{mbs} gc={int(gc_on)} liger={int(liger)}  measured {row['peak_reserved_gib']:6.2f}"
                  f" GiB  predicted {predicted.reserved_gib:6.2f} ({err:+5.1f}%)  step {row.get('step_time_s', 0):.3f}s"
                  f"  {row.get('tokens_per_s') or 0:9.0f} tok/s  {row['error'] or ''}", flush=True)
            args.out.write_text(json.dumps({"vram_gib": vram, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                                            "rows": rows},
                                           indent=1))


if __name__ == "__main__":
    main()
