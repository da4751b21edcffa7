"""The seed scenario on one GPU: DeepSeek-Coder-1.3B shape (random weights), pseudo2norm-shaped data, cutoff 2048,
a 31.73 GiB card emulated by capping the CUDA allocator (lfa plugin, LFA_EMULATE_VRAM_GIB).

Compared in one run: the original recipe (must OOM; run through `lfa train`, which must recover in one retry),
the seed's manual fix (fp16, bs1, ga16; plain llamafactory-cli), lfa's recipes for the v100-32g profile (default,
and with --allow-packing), and lfa's recipes for the full h200 profile (MFU). Prints a table, writes JSON.

usage: python bench/seed_scenario.py ASSETS_DIR OUT_DIR [--steps 6]
"""
from __future__ import annotations

import argparse
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
from lf_adapter.model_spec import load_model_spec  # noqa: E402

CAP_GIB = "31.73"
H200_PEAK = 989e12


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


def results(recipe: Path, log: Path, spec, seq: int) -> dict:
    import yaml

    data = yaml.safe_load(recipe.read_text())
    out = recipe.parent / data["output_dir"]
    res = json.loads((out / "train_results.json").read_text()) if (out / "train_results.json").exists() else {}
    text = log.read_text(errors="replace") if log.exists() else ""
    peaks = re.findall(r"LFA_PEAK allocated_gib=([\d.]+) reserved_gib=([\d.]+)", text)
    oom = re.search(r"CUDA out of memory\. Tried to allocate [^\n]*", text)
    row = {"effective_tokens_per_s": res.get("effective_tokens_per_sec"), "train_runtime_s": res.get("train_runtime"),
           "peak_allocated_gib": float(peaks[-1][0]) if peaks else None,
           "peak_reserved_gib": float(peaks[-1][1]) if peaks else None, "oom": oom.group(0)[:240] if oom else None,
           "micro_batch": data.get("per_device_train_batch_size"), "grad_accum": data.get("gradient_accumulation_steps"),
           "precision": "bf16" if data.get("bf16") else "fp16" if data.get("fp16") else "fp32"}
    row["effective_batch"] = (row["micro_batch"] or 0) * (row["grad_accum"] or 0)
    events = recipe.parent.parent / "runs" / recipe.parent.name / "events.jsonl"
    if events.exists() and res.get("effective_tokens_per_sec") and res.get("train_runtime"):
        steps = [json.loads(l) for l in events.read_text().splitlines() if '"event": "step"' in l]
        if len(steps) > 2:
            total_eff = res["effective_tokens_per_sec"] * res["train_runtime"]
            per_step = total_eff / len(steps)
            steady = sum(s["step_time_s"] for s in steps[1:])
            row["steady_effective_tokens_per_s"] = per_step * (len(steps) - 1) / steady
            row["steady_mfu"] = row["steady_effective_tokens_per_s"] * spec.flops_per_token(seq) / H200_PEAK
    if row["effective_tokens_per_s"]:
        row["mfu_incl_warmup"] = row["effective_tokens_per_s"] * spec.flops_per_token(seq) / H200_PEAK
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("assets", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    work = args.assets / "seed"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    spec = load_model_spec(str(args.assets / "model"))
    base_env = {**os.environ, "DISABLE_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1"}
    capped = {**base_env, "LFA_EMULATE_VRAM_GIB": CAP_GIB}
    table = {}
    only = set(filter(None, args.only.split(",")))

    def wanted(name):
        return not only or name in only

    # 1. the original recipe through lfa train: a real OOM at 31.73 GiB, then lfa's retry
    if wanted("original"):
        recipe = prepare_hand_recipe("original", work, args.assets, 4)
        log = args.out / "original.log"
        rc = lfa("train", str(recipe), "--run-dir", str(work / "runs" / "original"), "--max-attempts", "3",
                 env=capped, log=log)
        ledger = json.loads((work / "runs" / "original" / "ledger.json").read_text())
        attempts = ledger["attempts"]
        row = {"lfa_train_rc": rc, "attempts": len(attempts),
               "first_attempt_failure": (attempts[0].get("failure") or {}).get("kind"),
               "oom_evidence": (attempts[0].get("failure") or {}).get("evidence"),
               "oom_details": (attempts[0].get("failure") or {}).get("details"),
               "remedies": [a.get("remedy", {}).get("why") for a in attempts if a.get("remedy")]}
        if len(attempts) > 1 and attempts[0].get("live_stop"):
            row["oom_line_to_relaunch_s"] = round(attempts[1]["started_at"] - attempts[0]["live_stop"]["detected_at"], 3)
        for i, a in enumerate(attempts, 1):
            shutil.copy(work / "runs" / "original" / a["log"], args.out / f"original-attempt-{i}.log")
        row.update(results(recipe, work / "runs" / "original" / attempts[-1]["log"], spec, 2048))
        row["resolved_recipe"] = ledger.get("resolved_recipe")
        shutil.rmtree(recipe.parent / "saves", ignore_errors=True)
        table["original (bf16 bs8 ga8) -> lfa train retry"] = row

    # 2. the seed's manual fix, launched the way the seed author did
    if wanted("seed_fix"):
        recipe = prepare_hand_recipe("seed_fix", work, args.assets, 12)
        log = args.out / "seed_fix.log"
        env = {**capped, "PYTHONPATH": str(REPO / "lf_adapter" / "plugin" / "boot") + os.pathsep + base_env.get("PYTHONPATH", "")}
        with open(log, "wb") as out:
            subprocess.call(["llamafactory-cli", "train", "train.yaml"], cwd=recipe.parent, env=env, stdout=out,
                            stderr=subprocess.STDOUT)
        table["seed fix (fp16 bs1 ga16)"] = results(recipe, log, spec, 2048)
        shutil.rmtree(recipe.parent / "saves", ignore_errors=True)

    # 3. lfa's generated recipes
    generated = [("lfa v100-32g", "v100-32g", [], capped), ("lfa v100-32g --allow-packing", "v100-32g", ["--allow-packing"], capped),
                 ("lfa h200", "h200", [], base_env), ("lfa h200 --allow-packing", "h200", ["--allow-packing"], base_env)]
    for label, profile, extra, env in generated:
        key = label.replace(" ", "_").replace("--", "")
        if not wanted(key):
            continue
        folder = work / key
        lfa("generate", "--task", "pseudo2norm", "--model", str(args.assets / "model"), "--dataset",
            str(args.assets / "pseudo2norm.jsonl"), "--hardware", profile, *extra, "--set", f"max_steps={args.steps}",
            "--save-steps", "100000", "--logging-steps", "1", "-o", str(folder), "--force", log=args.out / f"{key}.gen.log")
        rc = lfa("train", str(folder / "train.yaml"), "--run-dir", str(work / "runs" / key), "--max-attempts", "2",
                 env=env, log=args.out / f"{key}.log")
        ledger = json.loads((work / "runs" / key / "ledger.json").read_text())
        row = {"lfa_train_rc": rc, "attempts": len(ledger["attempts"]), "plan": ledger["attempts"][0]["plan"],
               "first_try_fit": ledger["attempts"][0].get("failure") is None}
        meta = [l for l in (folder / "train.yaml").read_text().splitlines() if l.startswith("# lfa-meta: ")]
        if meta:
            m = json.loads(meta[0][12:])
            row.update(predicted_reserved_gib=m.get("predicted_reserved_gib"), predicted_tokens_per_s=m.get("predicted_tokens_per_s"))
        row.update(results(folder / "train.yaml", work / "runs" / key / ledger["attempts"][-1]["log"], spec, 2048))
        shutil.rmtree(folder / "saves", ignore_errors=True)  # a 1.3B fp32 save is 5 GiB; the device disk is small
        if env is capped and row.get("peak_reserved_gib"):
            row["headroom_vs_cap"] = round(1 - row["peak_reserved_gib"] / float(CAP_GIB), 3)
        table[label] = row

    seed = (table.get("seed fix (fp16 bs1 ga16)") or {}).get("effective_tokens_per_s")
    print(f"{'run':42s} {'eff.batch':>9s} {'peak res GiB':>12s} {'eff tok/s':>10s} {'x seed':>7s} {'steady MFU':>10s}")
    for label, row in table.items():
        tps = row.get("effective_tokens_per_s")
        ratio = f"{tps / seed:.2f}x" if tps and seed else "-"
        mfu = f"{row['steady_mfu']:.1%}" if row.get("steady_mfu") else "-"
        print(f"{label:42s} {row.get('effective_batch', 0):9d} {row.get('peak_reserved_gib') or 0:12.2f} "
              f"{tps or 0:10,.0f} {ratio:>7s} {mfu:>10s}")
    (args.out / "seed_scenario.json").write_text(json.dumps(table, indent=1, default=str))


if __name__ == "__main__":
    main()
