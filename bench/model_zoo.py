"""Model zoo (device): random-weight models with the config.json shapes of public dense families, each trained on
lfa's default plan for the whole card (the H200, or the H100 when that is lent) and for the capped 31.73 GiB card
(fp16, the seed's card, on the same GPU's compute), a few steps each.
One row per (model, hardware): lfa's predicted peak reserved memory and tokens/s next to the measured ones, and
whether the plan fit on its first try. Rows accumulate in OUT/model_zoo.json (a later call adds its rows).

The tokenizer and data are the other benches' (make_assets.py: a 16k BPE, 800 pseudo2norm-shaped rows, cutoff
2048); every zoo vocabulary is larger than the tokenizer's, so the ids fit. Each model folder is deleted after its
runs (the device disk is 64 GiB).

usage: python bench/model_zoo.py ASSETS_DIR OUT_DIR [--only NAME,...] [--hardware whole,capped] [--steps 5] [--profile]
       python bench/model_zoo.py --table bench/results/model_zoo.json --reprice  # here: the table, priced again
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lf_adapter.measured import CACHE_DIR  # noqa: E402
from lf_adapter.plugin import contract, run_kernels  # noqa: E402
from seed_scenario import CAP_GIB, lfa, measure  # noqa: E402

# config.json shapes of the published checkpoints (the fields that set memory and speed; weights are random)
ZOO: dict[str, dict] = {
    "meta-llama/Llama-3.2-3B": dict(
        model_type="llama",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    "Qwen/Qwen2.5-Coder-3B": dict(
        model_type="qwen2",
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    ),
    "Qwen/Qwen3-1.7B": dict(
        model_type="qwen3",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
    ),
    "microsoft/Phi-3-mini-4k-instruct": dict(
        model_type="phi3",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32064,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        pad_token_id=2,
        sliding_window=2047,  # the hub config (rows of 2,048 tokens cross it; rows before session 32 ran without it)
    ),
    "google/gemma-2-2b": dict(
        model_type="gemma2",
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=256000,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        max_position_embeddings=8192,
    ),
    "bigcode/starcoder2-3b": dict(
        model_type="starcoder2",
        hidden_size=3072,
        intermediate_size=12288,
        num_hidden_layers=30,
        num_attention_heads=24,
        num_key_value_heads=2,
        vocab_size=49152,
        tie_word_embeddings=True,
        use_bias=True,
        hidden_act="gelu_pytorch_tanh",
        norm_epsilon=1e-5,
        rope_theta=999999.4420358813,
        sliding_window=4096,
        max_position_embeddings=16384,
    ),
}
# hardware label -> (lfa profile by the GPU the bench runs on, generate arguments, capped allocator); "h200" is
# the whole card's old label
HARDWARE = {
    "whole": ({"H100": "h100", "H200": "h200"}, [], False),
    "capped": ({"H100": "h100-capped-32g", "H200": "h200-capped-32g"}, ["--precision", "fp16"], True),
}
HARDWARE["h200"] = HARDWARE["whole"]


def gpu_kind() -> str:
    """H100 or H200: the lent card's profiles (the capped profile keeps the card's compute, 31.73 GiB of memory)."""
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    kind = next((k for k in ("H100", "H200") if k in name), None)
    if kind is None:
        raise SystemExit(f"model_zoo runs on an H100 or H200 (lfa has their profiles); this GPU is {name or 'none'}")
    return kind


def zoo_config(name: str, overrides: dict | None = None):
    """The transformers config of the zoo shape `name` (with `overrides` of its fields), with the bench tokenizer's
    <pad>, <bos>, <eos> ids."""
    from transformers import AutoConfig

    shape = {"pad_token_id": 2, **ZOO[name], **(overrides or {})}
    return AutoConfig.for_model(shape.pop("model_type"), **shape, bos_token_id=0, eos_token_id=1)


def build_model(assets: Path, name: str, overrides: dict | None = None, suffix: str = "") -> Path:
    """A random-weight bf16 checkpoint of the zoo shape `name` (with `overrides` of its config fields), beside the
    bench tokenizer (assets/model)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = assets / ("zoo_" + name.replace("/", "__") + suffix)
    if (folder / "config.json").exists():
        return folder
    config = zoo_config(name, overrides)
    config.dtype = torch.bfloat16
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    for tokenizer_file in (assets / "model").glob("tokenizer*"):
        shutil.copy(tokenizer_file, folder / tokenizer_file.name)
    for extra in ("special_tokens_map.json",):
        if (assets / "model" / extra).exists():
            shutil.copy(assets / "model" / extra, folder / extra)
    del model
    torch.cuda.empty_cache()
    return folder


def run_one(
    name: str,
    hardware: str,
    model_dir: Path,
    work: Path,
    out: Path,
    steps: int,
    plan_args: tuple[str, ...] = (),
    dataset: Path | None = None,
    key: str = "",
    kernel_profile: bool = False,
) -> dict:
    """lfa generate (the default plan, or the one plan_args pin) + lfa train on one zoo model; the row for
    model_zoo.json. Each run has its own lfa cache folder, so no run plans from another's measured peak."""
    from lf_adapter.model_spec import load_model_spec

    profiles, gen_args, capped = HARDWARE[hardware]
    profile = profiles[gpu_kind()]
    key = key or f"{name.split('/')[-1]}-{hardware}" + ("-pinned" if plan_args else "")
    folder, run_dir = work / key, work / "runs" / key
    env = {**os.environ, "DISABLE_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1", contract.BENCH_SKIP_FINAL_SAVE: "1"}
    env[CACHE_DIR] = str(work / "cache" / key)
    if capped:
        env[contract.EMULATE_VRAM_GIB] = str(CAP_GIB)
    if kernel_profile:  # the last step under the torch profiler, left out of the steady state
        env.update({contract.KERNEL_PROFILE: "1", contract.COMM_PROFILE_STEPS: f"{steps}-{steps}"})
    row = {"model": name, "model_type": ZOO[name]["model_type"], "hardware": profile}
    row[run_kernels.ROW_KEY] = run_kernels.record(env)
    row["used_for_fit"] = False  # set by hand when a coefficient is fitted on this row
    gen_rc = lfa(
        "generate", "--task", "pseudo2norm", "--model", str(model_dir),
        "--dataset", str(dataset or work.parent / "pseudo2norm.jsonl"), "--hardware", profile, *gen_args, *plan_args,
        "--set", f"max_steps={steps}", "--set", "save_strategy=no",
        "--save-steps", "100000", "--logging-steps", "1", "-o", str(folder), "--force",
        env=env, log=out / f"{key}.gen.log",
    )  # fmt: skip
    if gen_rc != 0:
        row.update(plan=None, first_try_fit=None, note=(out / f"{key}.gen.log").read_text()[-600:])
        return row
    started = time.time()
    rc = lfa("train", str(folder / "train.yaml"), "--run-dir", str(run_dir), "--max-attempts", "2", env=env,
             log=out / f"{key}.log")  # fmt: skip
    ledger = json.loads((run_dir / "ledger.json").read_text())
    attempts = ledger["attempts"]
    meta = json.loads(
        next(line[12:] for line in (folder / "train.yaml").read_text().splitlines() if line.startswith("# lfa-meta: "))
    )
    first = attempts[0] if attempts else {}
    row.update(
        plan=first.get("plan"),
        lfa_train_rc=rc,
        attempts=len(attempts),
        first_try_fit=bool(attempts) and first.get("failure") is None,
        first_failure=(first.get("failure") or {}).get("kind"),
        predicted_reserved_gib=meta.get("predicted_reserved_gib"),
        predicted_tokens_per_s=meta.get("predicted_tokens_per_s"),
        wall_s=round(time.time() - started, 1),
    )
    for i, attempt in enumerate(attempts, 1):
        shutil.copy(run_dir / attempt["log"], out / f"{key}-attempt-{i}.log")
    if (run_dir / "events.jsonl").exists():  # per-step wall times and tokens, the kernel profile's window
        shutil.copy(run_dir / "events.jsonl", out / f"{key}-events.jsonl")
    if attempts:
        measured = measure(
            folder / "train.yaml",
            (run_dir / attempts[-1]["log"]).read_text(errors="replace"),
            run_dir / "events.jsonl",
            load_model_spec(str(model_dir)),
        )
        row.update(
            peak_reserved_gib=measured.get("peak_reserved_gib"),
            peak_allocated_gib=measured.get("peak_allocated_gib"),
            steady_tokens_per_s=measured.get("steady_tokens_per_s"),
            mfu=measured.get("mfu"),
            oom=measured.get("oom"),
            alloc_retries=measured.get("alloc_retries"),
            micro_batches_per_step=measured.get("micro_batches_per_step"),
            largest_micro_batch_tokens=measured.get("largest_micro_batch_tokens"),
            inactive_split_gib=measured.get("inactive_split_gib"),
            kernel_profile=measured.get("kernel_profile"),
            **{
                k: measured.get(k)
                for k in (
                    "gc_frozen_objects",
                    "gc_pause_s",
                    "batch_collect_s",
                    "step_times_s",
                    "jit_compiles",
                    "steady_tokens_per_s_without_compiles",
                )
            },
            memory_items_gib=first.get("predicted", {}).get("memory_gib"),
        )
    for key_name, (p, m) in {"reserved_error": ("predicted_reserved_gib", "peak_reserved_gib"),
                             "speed_error": ("predicted_tokens_per_s", "steady_tokens_per_s")}.items():  # fmt: skip
        if row.get(p) and row.get(m):
            row[key_name] = round(row[m] / row[p] - 1.0, 4)  # measured over predicted, -1
    shutil.rmtree(folder / "saves", ignore_errors=True)
    return row


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    return f"{100 * value:+.1f}%" if fmt == "%" else format(value, fmt)


def markdown_table(rows: list[dict]) -> str:
    """The measured rows as bench/README.md's table (--markdown)."""
    lines = [
        "| model (model_type) | card | plan | run | 1st try | pred GiB | peak GiB | err | now GiB | err now | "
        "pred tok/s | tok/s | err | now tok/s | err now |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("peak_reserved_gib") or not r.get("plan"):
            continue
        gpu = "H100" if r["hardware"].startswith("h100") else "H200"
        card = ("capped" if gpu == "H200" else "capped H100") if "capped" in r["hardware"] else gpu
        fit = " **fit**" if r.get("used_for_fit") else ""
        lines.append(
            f"| {r['model'].split('/')[-1]} ({r['model_type']}){fit} | {card} | {r['plan']} | "
            f"{r.get('run', '-').replace('h200_', '')} | {'yes' if r.get('first_try_fit') else '**no**'} | "
            f"{_cell(r, 'predicted_reserved_gib', '.2f')} | {_cell(r, 'peak_reserved_gib', '.2f')} | "
            f"{_cell(r, 'reserved_error', '%')} | {_cell(r, 'repriced_reserved_gib', '.2f')} | "
            f"{_cell(r, 'repriced_error', '%')} | {_cell(r, 'predicted_tokens_per_s', ',.0f')} | "
            f"{_cell(r, 'steady_tokens_per_s', ',.0f')} | {_cell(r, 'speed_error', '%')} | "
            f"{_cell(r, 'repriced_tokens_per_s', ',.0f')} | {_cell(r, 'repriced_speed_error', '%')} |"
        )
    return "\n".join(lines)


# every zoo model trains on the bench's 800 rows through the bench tokenizer: 1,180,098 tokens per epoch after
# truncation at 2048 (lfa generate's data line, h100_session21 call 4), the mean row's share of cutoff_len
BENCH_MEAN_SEQ_FRACTION = 1_180_098 / (800 * 2048)
# and its row-length profile as lfa generate records it (lf_adapter.data.profile_dataset over make_assets.py's data
# and tokenizer, session 39: the same 1,180,098 tokens): what the throughput model prices padded micro-batches from
BENCH_LENGTH_QUANTILES = (
    0.0791, 0.1582, 0.2021, 0.2437, 0.2896, 0.3242, 0.3789, 0.4443, 0.48, 0.522, 0.5708, 0.6147, 0.6558, 0.6973,
    0.7241, 0.7759, 0.8105, 0.8486, 0.8833, 0.9214, 0.957, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
)  # fmt: skip


def reprice(rows: list[dict]) -> None:
    """Each measured row's plan priced again by the memory and throughput models as they are now
    (repriced_reserved_gib, repriced_tokens_per_s): how a refit does on rows it was not fitted on. The zoo shapes
    come from lfa's catalog (the same hub names), the cards from its hardware profiles."""
    from lf_adapter.hardware import load_profile
    from lf_adapter.memory import estimate
    from lf_adapter.model_spec import load_model_spec
    from lf_adapter.plan import Plan
    from lf_adapter.throughput import predict_tokens_per_s

    for r in rows:
        measured = r.get("peak_reserved_gib") and r.get("lfa_train_rc") == 0 and r.get("attempts") == 1
        ran_out = r.get("first_failure") == "cuda_oom"  # the plan that ran out: would today's model still plan it?
        if not r.get("plan") or not (measured or ran_out):
            continue
        plan = Plan.from_label(r["plan"], alloc_conf="expandable_segments:True")
        model, hardware = load_model_spec(r["model"]), load_profile(r["hardware"])
        with run_kernels.measured_with(run_kernels.of_row(r)):
            memory = estimate(model, plan, 2048, hardware.gpu.vram_gib)
            fraction = 1.0 if plan.packing else BENCH_MEAN_SEQ_FRACTION
            speed = predict_tokens_per_s(model, plan, hardware, 2048, fraction, BENCH_LENGTH_QUANTILES)
        r["repriced_reserved_gib"] = round(memory.reserved_gib, 2)
        if ran_out:
            r["repriced_fits"] = memory.fits
            continue
        r["repriced_error"] = round(r["peak_reserved_gib"] / r["repriced_reserved_gib"] - 1.0, 4)
        if r.get("steady_tokens_per_s"):
            r["repriced_tokens_per_s"] = round(speed)
            r["repriced_speed_error"] = round(r["steady_tokens_per_s"] / r["repriced_tokens_per_s"] - 1.0, 4)


# issue 31's targets on the rows not fitted on: peak reserved within 5% below / 3% above, tokens/s within 10%
MEMORY_BOUNDS = (-0.05, 0.03)
SPEED_BOUND = 0.10


def validation_summary(rows: list[dict]) -> str:
    """How many repriced rows that no coefficient was fitted on fall within the targets, and which do not."""
    held_out = [r for r in rows if not r.get("used_for_fit")]
    memory = [r for r in held_out if r.get("repriced_error") is not None]
    speed = [r for r in held_out if r.get("repriced_speed_error") is not None]
    memory_out = [r for r in memory if not MEMORY_BOUNDS[0] <= r["repriced_error"] <= MEMORY_BOUNDS[1]]
    speed_out = [r for r in speed if abs(r["repriced_speed_error"]) > SPEED_BOUND]

    def listed(out: list[dict], key: str) -> str:
        return "; ".join(
            f"{r['model'].split('/')[-1]} {r['hardware']} ({r.get('run', '-')}) {100 * r[key]:+.1f}%" for r in out
        )

    return (
        f"rows not fitted on, repriced: memory within -5%/+3%: {len(memory) - len(memory_out)} of {len(memory)}"
        f" (outside: {listed(memory_out, 'repriced_error') or 'none'})\n"
        f"speed within 10%: {len(speed) - len(speed_out)} of {len(speed)}"
        f" (outside: {listed(speed_out, 'repriced_speed_error') or 'none'})"
    )


def print_table(rows: list[dict]) -> None:
    print(
        f"{'model':34s} {'hardware':16s} {'plan':52s} {'fit1':>5s} {'pred GiB':>8s} {'peak GiB':>8s} {'err':>7s} "
        f"{'pred tok/s':>10s} {'tok/s':>8s} {'err':>7s} {'fit':>3s} {'now GiB':>8s} {'err':>7s} {'now tok/s':>9s} "
        f"{'err':>7s}"
    )
    for r in rows:
        print(
            f"{r['model']:34s} {r.get('hardware', '-'):16s} {str(r.get('plan'))[:52]:52s} "
            f"{str(r.get('first_try_fit'))[:5]:>5s} {_cell(r, 'predicted_reserved_gib', '.2f'):>8s} "
            f"{_cell(r, 'peak_reserved_gib', '.2f'):>8s} {_cell(r, 'reserved_error', '%'):>7s} "
            f"{_cell(r, 'predicted_tokens_per_s', ',.0f'):>10s} {_cell(r, 'steady_tokens_per_s', ',.0f'):>8s} "
            f"{_cell(r, 'speed_error', '%'):>7s} {'yes' if r.get('used_for_fit') else 'no':>3s} "
            f"{_cell(r, 'repriced_reserved_gib', '.2f'):>8s} {_cell(r, 'repriced_error', '%'):>7s} "
            f"{_cell(r, 'repriced_tokens_per_s', ',.0f'):>9s} {_cell(r, 'repriced_speed_error', '%'):>7s}"
        )
        if r.get("note"):
            print(f"    note: {r['note'][:300]}")
        if r.get("steady_tokens_per_s_without_compiles"):
            print(f"    steady steps without a Triton compile: {r['steady_tokens_per_s_without_compiles']:,} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("assets", type=Path, nargs="?")
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--only", default="", help="zoo names (or their last part), comma-separated")
    parser.add_argument("--hardware", default="whole,capped", help="whole (the card lfa runs on), capped")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="kernel profile of each run's last step")
    parser.add_argument("--pin", action="append", default=[], help="FIELD=VALUE for lfa generate (repeatable)")
    parser.add_argument("--table", type=Path, help="print the table of a model_zoo.json and exit")
    parser.add_argument("--reprice", action="store_true", help="with --table: price each row with today's model")
    parser.add_argument("--markdown", action="store_true", help="with --table: bench/README.md's table")
    args = parser.parse_args()
    if args.table:
        rows = json.loads(args.table.read_text())
        if args.reprice:
            reprice(rows)
            args.table.write_text(json.dumps(rows, indent=1))
        print(markdown_table(rows) if args.markdown else "", end="\n" if args.markdown else "")
        if not args.markdown:
            print_table(rows)
        if args.reprice:
            print(validation_summary(rows))
        return
    wanted = args.only.split(",") if args.only else [n.split("/")[-1] for n in ZOO]

    def named(short: str, name: str) -> bool:
        return short.lower() in (name.lower(), name.split("/")[-1].lower())

    names = [n for short in wanted for n in ZOO if named(short, n)]  # in the order asked
    unknown = [short for short in wanted if not any(named(short, n) for n in ZOO)]
    if unknown:  # a typo must not run nothing silently (session 23's call lost a model to 'qwen2.5-coder-3b')
        sys.exit(f"unknown zoo model(s): {', '.join(unknown)}; known: {', '.join(ZOO)}")
    work = args.assets / "zoo"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "model_zoo.json"
    rows = json.loads(results.read_text()) if results.exists() else []
    for name in names:
        started = time.time()
        try:
            model_dir = build_model(args.assets, name)
        except Exception as exc:  # a family this transformers cannot build: a row that says so
            rows.append({"model": name, "model_type": ZOO[name]["model_type"], "note": f"not built: {exc!r}"[:400]})
            results.write_text(json.dumps(rows, indent=1))
            continue
        print(f"BENCH built {name} in {time.time() - started:.0f}s", flush=True)
        for hardware in args.hardware.split(","):
            started = time.time()
            pins = tuple(a for pin in args.pin for a in ("--pin", pin))
            row = run_one(name, hardware, model_dir, work, args.out, args.steps, pins, kernel_profile=args.profile)
            if pins:
                row["pinned"] = args.pin
            rows.append(row)
            results.write_text(json.dumps(rows, indent=1))
            print(f"BENCH {name} {hardware} in {time.time() - started:.0f}s: {json.dumps(row)[:500]}", flush=True)
        shutil.rmtree(model_dir, ignore_errors=True)  # the device disk holds a few checkpoints at most
    print_table(rows)


if __name__ == "__main__":
    main()
