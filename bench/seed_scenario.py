"""The seed scenario on one GPU: DeepSeek-Coder-1.3B shape (random weights), pseudo2norm-shaped data, cutoff 2048,
a 31.73 GiB card emulated by capping the CUDA allocator (lfa plugin, LFA_EMULATE_VRAM_GIB).

Every run is measured the same way: the lfa plugin writes one event per optimizer step (wall time and the step's
non-pad tokens, counted on the device without a per-micro-batch sync), and the table reports steady-state
non-pad tokens/s over steps 2..N (step 1 carries CUDA/cuBLAS warm-up and optimizer-state allocation), next to
LLaMA-Factory's own effective_tokens_per_sec (whole run, warm-up included). Peak memory is torch's
max_memory_reserved in the trainer process.

Runs (pick with --only a,b):
  original        the paper's recipe as the seed author copied it (bf16 bs8 ga8), through `lfa train`: must OOM
                  at the cap and recover; reports the OOM line -> relaunch time
  seed_fix        the seed author's manual fix (fp16 bs1 ga16), plain llamafactory-cli, capped
  capped          lfa generate --hardware h200-capped-32g --precision fp16: lfa's plan for the card the bench
                  runs on (H200 compute, the seed card's 31.73 GiB and fp16); runs A-D called it "v100"
  capped_syncs    the same with the two per-micro-batch GPU syncs lfa removes put back
  capped_unsorted the same with --no-sorted-steps
  capped_no_expandable  the same with the default caching allocator (--pin alloc_conf=none)
  capped_packing  --allow-packing
  v100_golden     lfa's plan for a real V100 (compute-bound: mbs1, no checkpointing), run on the capped H200
  h200, h200_packing           lfa's plans for the whole H200 (uncapped): MFU
  h200_padfree, capped_padfree  the same with --pin padding_free=true (rows flattened, varlen attention, no padding)
  capped_fixed, h200_fixed      the default with --no-token-budget (fixed micro-batches of N rows)
  capped_padded, h200_padded    --no-padding-free --no-token-budget: the default plans of 2026-12-03 (sorted steps)
  h200_fullgc                   --no-token-budget, micro-batch 8, all 32 layers recomputed (the 6.7B's; 6.7B only)
  capped_tb                     --pin token_budget=16384
  h200_compile, capped_compile  the h200 / capped plan, each decoder layer under torch.compile and liger keeping only
                                its fused loss (LFA_COMPILE_LAYERS=1)
  h200_zero2_offload, h200_zero3, h200_zero3_offload  DeepSpeed on one GPU through FORCE_TORCHRUN=1 (--pin), vs the
                                                      h200 plan

--repeats N alternates the seed's fix and the capped plan N times (seed_fix, capped, seed_fix#2, capped#2, ...);
bench/summarize.py takes the median of their ratios. --profile runs each lfa plan's last step under the torch
profiler (LFA_KERNEL_PROFILE): GPU time by kernel kind; that step is left out of the steady state.

usage: python bench/seed_scenario.py ASSETS_DIR OUT_DIR [--steps 6] [--only v100,seed_fix] [--repeats 3] [--profile]
       [--pin FIELD=VALUE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from lf_adapter.model_spec import _from_config_dict, load_model_spec  # noqa: E402
from lf_adapter.plan import Plan  # noqa: E402
from lf_adapter.plugin import contract, run_kernels  # noqa: E402

CAP_GIB = 31.73
H200_PEAK = 989e12
SYNCS_BACK = ("include_num_input_tokens_seen=true", "logging_nan_inf_filter=true")
# label -> (profile, generate args, extra lfa-train --set, capped)
# (the bench keeps each run's disk use small: no checkpoints, and LFA_BENCH_SKIP_FINAL_SAVE skips the final save)
FP16 = ["--precision", "fp16"]
GENERATED = {
    "capped": ("h200-capped-32g", FP16, [], True),
    "capped_syncs": ("h200-capped-32g", FP16, list(SYNCS_BACK), True),
    "capped_unsorted": ("h200-capped-32g", FP16 + ["--no-sorted-steps"], [], True),
    "capped_no_expandable": ("h200-capped-32g", FP16 + ["--pin", "alloc_conf=none"], [], True),
    "capped_packing": ("h200-capped-32g", FP16 + ["--allow-packing"], [], True),
    "v100_golden": ("v100-32g", [], [], True),
    "h200": ("h200", [], [], False),
    "h200_packing": ("h200", ["--allow-packing"], [], False),
    "h200_padfree": ("h200", ["--pin", "padding_free=true"], [], False),
    "capped_padfree": ("h200-capped-32g", FP16 + ["--pin", "padding_free=true"], [], True),
    "capped_fixed": ("h200-capped-32g", FP16 + ["--no-token-budget"], [], True),
    "capped_padded": ("h200-capped-32g", FP16 + ["--no-padding-free", "--no-token-budget"], [], True),
    "h200_fixed": ("h200", ["--no-token-budget"], [], False),
    "h200_padded": ("h200", ["--no-padding-free", "--no-token-budget"], [], False),
    # within-call references: every layer recomputed at micro-batch 8 (the 6.7B default of 2026-12-03), and a token
    # budget pinned where the planner rates it a tie
    "h200_fullgc": (
        "h200",
        ["--no-token-budget", "--pin", "micro_batch_size=8", "--pin", "checkpoint_layers=32"],
        [],
        False,
    ),
    "capped_tb": ("h200-capped-32g", FP16 + ["--pin", "token_budget=16384"], [], True),
    "h200_zero2_offload": ("h200", ["--pin", "deepspeed=zero2", "--pin", "offload=optimizer"], [], False),
    "h200_zero3": ("h200", ["--pin", "deepspeed=zero3", "--pin", "offload=none"], [], False),
    "h200_zero3_offload": ("h200", ["--pin", "deepspeed=zero3", "--pin", "offload=all"], [], False),
    # bf16 weights in the model, fp32 masters in the optimizer: the planner's plan, and the default plan's shape
    # (pinned from the row of `h200` in the same table) with master weights on
    "h200_master": ("h200", ["--pin", "master_weights=true"], [], False),
    "h200_master_same": ("h200", ["--pin", "master_weights=true"], [], False),
    "h200_autocast": ("h200", ["--no-master-weights"], [], False),
    "capped_autocast": ("h200-capped-32g", FP16 + ["--no-master-weights"], [], True),
    "capped_master": ("h200-capped-32g", FP16 + ["--pin", "master_weights=true"], [], True),
    "capped_master_same": ("h200-capped-32g", FP16 + ["--pin", "master_weights=true"], [], True),
}
GENERATED["h200_compile"] = GENERATED["h200"]  # the same plan with each decoder layer under torch.compile
GENERATED["capped_compile"] = GENERATED["capped"]
GENERATED["h200_hook"] = GENERATED["h200"]  # the same plan, master gradients added by the hook (before session 40)
GENERATED["capped_hook"] = GENERATED["capped"]
GENERATED["h200_fused"] = GENERATED["h200"]  # session 40's first measurement, when the fused GEMM was asked for
GENERATED["capped_fused"] = GENERATED["capped"]
HOOK_ENV = {contract.FUSED_WEIGHT_GRADIENTS: "0"}
FUSED_ENV = {contract.FUSED_WEIGHT_GRADIENTS: "1"}
LABEL_ENV = {
    "h200_compile": {contract.COMPILE_LAYERS: "1"},
    "capped_compile": {contract.COMPILE_LAYERS: "1"},
    "h200_hook": HOOK_ENV,
    "capped_hook": HOOK_ENV,
    "h200_fused": FUSED_ENV,
    "capped_fused": FUSED_ENV,
}
SAME_PLAN_AS = {  # label -> the label whose plan it pins
    "h200_master_same": "h200",
    "capped_master_same": "capped",
    "h200_compile": "h200",
    "capped_compile": "capped",
    "h200_hook": "h200",
    "capped_hook": "capped",
    "h200_fused": "h200",
    "capped_fused": "capped",
}


def pins_of_plan(label: str) -> list[str]:
    """`lfa generate` pins that rebuild a plan label's shape (e.g. bf16/mbs8xga8x1/nogc/liger/sdpa/tb16384)."""
    plan = Plan.from_label(label)
    pins = {
        "micro_batch_size": plan.micro_batch_size,
        "liger": plan.liger,
        "padding_free": plan.padding_free,
        "attention": plan.attention,
        "gradient_checkpointing": plan.gradient_checkpointing,
        "token_budget": plan.token_budget,
    }
    if plan.checkpoint_layers is not None:
        pins["checkpoint_layers"] = plan.checkpoint_layers
    return [x for field, value in pins.items() for x in ("--pin", f"{field}={str(value).lower()}")]


def build_assets(assets: Path, model_dir: str) -> None:
    """Build ASSETS/model_dir with make_assets.py unless it is there (model: the 1.3B; model_SIZE: that size)."""
    if not (assets / model_dir / "config.json").exists():
        size = "1.3b" if model_dir == "model" else model_dir.removeprefix("model_")
        subprocess.run([sys.executable, str(REPO / "bench" / "make_assets.py"), str(assets), size], check=True)


@functools.cache
def catalog_spec(model_dir: str):
    """The shape of a bench model folder, for tables made where the folders are not: model is the 1.3B, model_6.7b
    the 6.7B (lfa's catalog), model_6.7b-12l the 6.7B's layers, 12 of its 32, model_350m make_assets.py's 350M."""
    if model_dir == "model_350m":
        return _from_config_dict(
            "350m",
            {
                "hidden_size": 1024,
                "num_hidden_layers": 24,
                "num_attention_heads": 16,
                "intermediate_size": 2816,
                "vocab_size": 32256,
                "model_type": "llama",
            },
        )
    big = load_model_spec("LLM4Binary/llm4decompile-6.7b-v2")
    return {
        "model": load_model_spec("LLM4Binary/llm4decompile-1.3b-v2"),
        "model_6.7b": big,
        "model_6.7b-12l": dataclasses.replace(big, name="llm4decompile-6.7b-v2, 12 of 32 layers", num_layers=12),
    }[model_dir]


def lfa(*args, env=None, log=None) -> int:
    command = [sys.executable, "-m", "lf_adapter.cli", *args]
    with open(log, "ab") if log else open(os.devnull, "wb") as out:
        return subprocess.call(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


def prepare_hand_recipe(name: str, work: Path, assets: Path, steps: int) -> Path:
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    text = (REPO / "bench" / "seed_scenario" / f"{name}.yaml").read_text()
    text = text.replace("MODEL", str(assets / "model")) + f"max_steps: {steps}\n"
    (folder / "train.yaml").write_text(text)
    info = json.loads((assets / "dataset_info.json").read_text())
    info["pseudo2norm"]["file_name"] = str(assets / "pseudo2norm.jsonl")
    (folder / "dataset_info.json").write_text(json.dumps(info))
    return folder / "train.yaml"


def steady_state(events_file: Path) -> dict:
    """Non-pad tokens/s over optimizer steps 2..N from the plugin's step events (without a profiled window), and the
    kernel profile when there is one."""
    if not events_file.exists():
        return {}
    events = [json.loads(line) for line in events_file.read_text().splitlines() if line.strip()]
    profiles = [e for e in events if e.get("event") == "kernels"]
    profiled = {s for p in profiles for s in range(p["first_step"], p["last_step"] + 1)}
    steps = [
        e for e in events if e.get("event") == "step" and e.get("step_tokens") and e["global_step"] not in profiled
    ]
    begin = [e for e in events if e.get("event") == "train_begin"]
    row = {
        "sampler": begin[-1].get("sampler") if begin else None,
        "steps_measured": max(0, len(steps) - 1),
        "alloc_retries": steps[-1].get("alloc_retries") if steps else None,
        "micro_batches_per_step": [e.get("micro_batches") for e in steps],
        "largest_micro_batch_tokens": max((e.get("largest_micro_batch_tokens") or 0 for e in steps), default=None),
        "inactive_split_gib": steps[-1].get("gpu_inactive_split_gib") if steps else None,
        "gc_frozen_objects": begin[-1].get("gc_frozen_objects") if begin else None,
    }
    if profiles:
        row["kernel_profile"] = profiles[-1]
    if len(steps) > 1:
        tokens, seconds = sum(s["step_tokens"] for s in steps[1:]), sum(s["step_time_s"] for s in steps[1:])
        row.update(
            steady_tokens_per_s=round(tokens / seconds),
            step_time_s=round(seconds / (len(steps) - 1), 3),
            tokens_per_step=round(tokens / (len(steps) - 1)),
            # where the host held the GPU up: garbage collections and fetching + cutting each step's batch
            gc_pause_s=round(sum(s.get("gc_pause_s") or 0 for s in steps[1:]), 4),
            batch_collect_s=round(sum(s.get("batch_collect_s") or 0 for s in steps[1:]), 4),
            step_times_s=[s["step_time_s"] for s in steps],
            # kernels Triton compiled during each step (plugin/jit_compiles.py; absent: no Triton cache)
            jit_compiles=[s.get("jit_compiles") for s in steps],
        )
        quiet = [s for s in steps[1:] if s.get("jit_compiles") == 0]
        if quiet and len(quiet) < len(steps) - 1:  # the steady steps in which nothing was compiled
            row["steady_tokens_per_s_without_compiles"] = round(
                sum(s["step_tokens"] for s in quiet) / sum(s["step_time_s"] for s in quiet)
            )
    return row


def measure(recipe: Path, log_text: str, events_file: Path, spec) -> dict:
    import yaml

    data = yaml.safe_load(recipe.read_text())
    out = recipe.parent / data["output_dir"]
    results_file = out / "train_results.json"
    res = json.loads(results_file.read_text()) if results_file.exists() else {}
    peaks = re.findall(r"LFA_PEAK allocated_gib=([\d.]+) reserved_gib=([\d.]+)", log_text)
    oom = re.search(r"CUDA out of memory\. Tried to allocate [^\n]*", log_text)
    row = {
        "precision": "bf16" if data.get("bf16") else "fp16" if data.get("fp16") else "fp32",
        "micro_batch": data.get("per_device_train_batch_size"),
        "grad_accum": data.get("gradient_accumulation_steps"),
        "peak_allocated_gib": float(peaks[-1][0]) if peaks else None,
        "peak_reserved_gib": float(peaks[-1][1]) if peaks else None,
        "lf_effective_tokens_per_s_incl_warmup": res.get("effective_tokens_per_sec"),
        "train_runtime_s": res.get("train_runtime"),
        "oom": oom.group(0)[:240] if oom else None,
    }
    row["effective_batch"] = (row["micro_batch"] or 0) * (row["grad_accum"] or 0)
    row.update(steady_state(events_file))
    if row.get("steady_tokens_per_s"):
        # MFU with 6N + attention at cutoff_len per token (the issue's accounting), against the H200's 989 TFLOP/s
        row["mfu"] = round(row["steady_tokens_per_s"] * spec.flops_per_token(2048) / H200_PEAK, 4)
    return row


def run_original(work: Path, assets: Path, out: Path, env: dict, spec) -> dict:
    recipe = prepare_hand_recipe("original", work, assets, 4)
    run_dir = work / "runs" / "original"
    rc = lfa("train", str(recipe), "--run-dir", str(run_dir), "--max-attempts", "3", env=env, log=out / "original.log")
    ledger = json.loads((run_dir / "ledger.json").read_text())
    attempts = ledger["attempts"]
    first_failure = attempts[0].get("failure") or {}
    row = {
        "lfa_train_rc": rc,
        "attempts": len(attempts),
        "first_attempt_failure": first_failure.get("kind"),
        "oom_evidence": first_failure.get("evidence"),
        "oom_details": first_failure.get("details"),
        "remedies": [a["remedy"]["why"] for a in attempts if a.get("remedy")],
    }
    if len(attempts) > 1 and attempts[0].get("live_stop"):
        row["oom_line_to_relaunch_s"] = round(attempts[1]["started_at"] - attempts[0]["live_stop"]["detected_at"], 3)
    for i, attempt in enumerate(attempts, 1):
        shutil.copy(run_dir / attempt["log"], out / f"original-attempt-{i}.log")
    last_log = (run_dir / attempts[-1]["log"]).read_text(errors="replace")
    row.update(measure(recipe, last_log, run_dir / "events.jsonl", spec))
    return row


def run_seed_fix(work: Path, assets: Path, out: Path, env: dict, spec, steps: int, key: str = "seed_fix") -> dict:
    recipe = prepare_hand_recipe("seed_fix", work, assets, steps)
    events = work / f"{key}.events.jsonl"
    boot = str(REPO / "lf_adapter" / "plugin" / "boot")
    run_env = {
        **env,
        contract.EVENTS_FILE: str(events),
        "PYTHONPATH": os.pathsep.join(filter(None, [boot, str(REPO), env.get("PYTHONPATH")])),
    }
    log = out / f"{key}.log"
    with open(log, "wb") as fh:
        subprocess.call(
            ["llamafactory-cli", "train", "train.yaml"],
            cwd=recipe.parent,
            env=run_env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    return measure(recipe, log.read_text(errors="replace"), events, spec)


def run_generated(
    label: str,
    work: Path,
    assets: Path,
    out: Path,
    env: dict,
    spec,
    steps: int,
    model_dir: str = "model",
    key: str | None = None,
    kernel_profile: bool = False,
    whole_profile: str = "h200",
    same_plan: str | None = None,
    pins: tuple[str, ...] = (),
) -> dict:
    profile, gen_args, train_sets, _ = GENERATED[label]
    profile = whole_profile if profile == "h200" else profile
    if same_plan:
        gen_args = [*gen_args, *pins_of_plan(same_plan)]
    gen_args = [*gen_args, *(x for pin in pins for x in ("--pin", pin))]
    key = key or label
    env = {**env, **LABEL_ENV.get(label, {})}
    if kernel_profile:  # the last step, left out of the steady state
        env = {**env, contract.KERNEL_PROFILE: "1", contract.COMM_PROFILE_STEPS: f"{steps}-{steps}"}
    folder, run_dir = work / key, work / "runs" / key
    lfa(
        "generate",
        "--task",
        "pseudo2norm",
        "--model",
        str(assets / model_dir),
        "--dataset",
        str(assets / "pseudo2norm.jsonl"),
        "--hardware",
        profile,
        *gen_args,
        "--set",
        f"max_steps={steps}",
        "--set",
        "save_strategy=no",
        "--save-steps",
        "100000",
        "--logging-steps",
        "1",
        "-o",
        str(folder),
        "--force",
        log=out / f"{key}.gen.log",
    )
    started = time.time()
    rc = lfa(
        "train",
        str(folder / "train.yaml"),
        "--run-dir",
        str(run_dir),
        "--max-attempts",
        "2",
        *[x for s in train_sets for x in ("--set", s)],
        env=env,
        log=out / f"{key}.log",
    )
    ledger = json.loads((run_dir / "ledger.json").read_text())
    attempts = ledger["attempts"]
    meta = json.loads(
        next(line[12:] for line in (folder / "train.yaml").read_text().splitlines() if line.startswith("# lfa-meta: "))
    )
    row = {
        "lfa_train_rc": rc,
        "attempts": len(attempts),
        "plan": attempts[0]["plan"],
        run_kernels.ROW_KEY: run_kernels.record(env),
        "first_try_fit": attempts[0].get("failure") is None,
        "wall_s": round(time.time() - started, 1),
        "predicted_reserved_gib": meta.get("predicted_reserved_gib"),
        "predicted_tokens_per_s": meta.get("predicted_tokens_per_s"),
    }
    if attempts[0].get("failure"):
        row["first_failure"] = attempts[0]["failure"]["kind"]
    for i, attempt in enumerate(attempts, 1):  # the trainer's own output, for failures
        shutil.copy(run_dir / attempt["log"], out / f"{key}-attempt-{i}.log")
    row.update(
        measure(
            folder / "train.yaml",
            (run_dir / attempts[-1]["log"]).read_text(errors="replace"),
            run_dir / "events.jsonl",
            spec,
        )
    )
    shutil.rmtree(folder / "saves", ignore_errors=True)
    return row


def print_table(table: dict) -> None:
    seed = (table.get("seed_fix") or {}).get("steady_tokens_per_s")
    print(
        f"{'run':20s} {'plan':48s} {'batch':>5s} {'peak res':>8s} {'headroom':>8s} {'steady tok/s':>12s} "
        f"{'x seed':>6s} {'MFU':>6s} {'LF eff tok/s':>12s}"
    )
    for label, row in table.items():
        tps = row.get("steady_tokens_per_s")
        ratio = f"{tps / seed:.2f}x" if tps and seed else "-"
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") else "-"
        capped = label in ("original", "seed_fix") or GENERATED.get(label, (None, None, None, False))[3]
        headroom = f"{1 - row['peak_reserved_gib'] / CAP_GIB:.1%}" if capped and row.get("peak_reserved_gib") else "-"
        print(
            f"{label:20s} {str(row.get('plan', '(hand-written)'))[:48]:48s} {row.get('effective_batch', 0):5d} "
            f"{row.get('peak_reserved_gib') or 0:8.2f} {headroom:>8s} {tps or 0:12,.0f} "
            f"{ratio:>6s} {mfu:>6s} "
            f"{row.get('lf_effective_tokens_per_s_incl_warmup') or 0:12,.0f}"
        )
    for label, row in table.items():  # where the GPU time of the profiled step went
        p = row.get("kernel_profile")
        if p:
            kinds = ", ".join(f"{k} {v / p['window_s']:.1%}" for k, v in p["kinds_s"].items())
            idle = p["gpu_idle_s"] / p["window_s"]
            print(f"profile {label}: step {p['last_step']} {p['window_s']:.2f} s, GPU idle {idle:.1%}; {kinds}")
    for label, row in table.items():  # what the host did between the GPU's work, step by step
        if row.get("step_times_s"):
            print(
                f"host {label}: step times {row['step_times_s']} s (the first is warm-up); over the steady steps "
                f"garbage collections {row.get('gc_pause_s')} s ({row.get('gc_frozen_objects')} objects frozen), "
                f"batch fetch + cut {row.get('batch_collect_s')} s; Triton compiles per step {row.get('jit_compiles')}"
                + (
                    f" (steady steps without a compile: {row['steady_tokens_per_s_without_compiles']:,} tok/s)"
                    if row.get("steady_tokens_per_s_without_compiles")
                    else ""
                )
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("assets", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps of 64 rows per lfa run")
    parser.add_argument("--seed-steps", type=int, default=10, help="steps of 16 rows for the seed fix")
    parser.add_argument("--only", default="")
    parser.add_argument("--repeats", type=int, default=1, help="alternate seed_fix and capped this many times")
    parser.add_argument("--profile", action="store_true", help="kernel profile of each lfa plan's last step")
    parser.add_argument("--whole-profile", default="h200", help="the hardware profile of the whole-card runs (h100)")
    parser.add_argument(
        "--model-dir",
        default="model",
        help="model folder under ASSETS_DIR for lfa's plans (model_6.7b: built by make_assets.py 6.7b)",
    )
    parser.add_argument(
        "--pin", action="append", default=[], help="FIELD=VALUE for every lfa plan of this invocation (repeatable)"
    )
    args = parser.parse_args()
    work = args.assets / "seed"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    build_assets(args.assets, args.model_dir)
    spec = load_model_spec(str(args.assets / args.model_dir))
    base_env = {**os.environ, "DISABLE_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1", contract.BENCH_SKIP_FINAL_SAVE: "1"}
    capped_env = {**base_env, contract.EMULATE_VRAM_GIB: str(CAP_GIB)}
    order = ["original", "seed_fix", *GENERATED]
    wanted = [name for name in args.only.split(",") if name in order] if args.only else order
    if args.repeats > 1:  # seed_fix, capped, seed_fix#2, capped#2, ...: the pair alternates, the rest follows
        pair = [name for name in ("seed_fix", "capped") if name in wanted]
        rest = [name for name in wanted if name not in pair]
        wanted = [f"{name}#{i}" if i > 1 else name for i in range(1, args.repeats + 1) for name in pair] + rest
    results_file = args.out / "seed_scenario.json"
    table = json.loads(results_file.read_text()) if results_file.exists() else {}
    suffix = "" if args.model_dir == "model" else "_" + args.model_dir.removeprefix("model_")  # h200 -> h200_6.7b
    for entry in wanted:
        started = time.time()
        name = entry.split("#")[0]
        if name == "original":  # the seed's own recipes always train assets/model
            key, table[name] = name, run_original(work, args.assets, args.out, capped_env, spec)
        elif name == "seed_fix":
            key = entry
            table[key] = run_seed_fix(work, args.assets, args.out, capped_env, spec, args.seed_steps, key)
        else:
            env = capped_env if GENERATED[name][3] else base_env
            key = name + suffix + entry[len(name) :]
            same = SAME_PLAN_AS.get(name)
            same_plan = (table.get(same + suffix) or {}).get("plan") if same else None
            if same and not same_plan:
                print(f"BENCH {key} skipped: no row of {same + suffix} to take its plan from", flush=True)
                continue
            table[key] = run_generated(
                name, work, args.assets, args.out, env, spec, args.steps, args.model_dir, key, args.profile,
                args.whole_profile, same_plan, tuple(args.pin),
            )  # fmt: skip
        print(
            f"BENCH {key} done in {time.time() - started:.0f}s: {json.dumps(table[key], default=str)[:400]}", flush=True
        )
        results_file.write_text(json.dumps(table, indent=1, default=str))
    print_table(table)


if __name__ == "__main__":
    main()
