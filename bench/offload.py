"""Host memory and speed of DeepSpeed CPU offload on one H200 (issue 13): the trainer's peak RSS against lfa's host
memory model, and ZeRO-2 offload step time at accumulation 8 and 64 against the throughput model.

Each run is `lfa generate --hardware h200 --pin ...` + `lfa train` on the random-weight model of that shape
(bench/make_assets.py). Host memory is read two ways: a sampler here sums the RSS of the supervisor's whole process
tree every 0.25 s (torchrun, the trainer, DeepSpeed's threads, data workers), and the lfa plugin prints the
trainer's own ru_maxrss at exit (LFA_PEAK ... host_rss_gib). Pinned buffers are resident, so both count them.

usage (device):  python bench/offload.py ASSETS_DIR OUT_DIR --only plain_1.3b,z2off_1.3b [--steps 4]
usage (here):    python bench/offload.py --table bench/results/<run>/offload.json   # predicted vs measured
The trainer column (ru_maxrss) is what the model predicts per rank; the tree column sums RSS over every process,
which counts pages that forked data workers share with the trainer more than once (an upper bound).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from lf_adapter.plugin import contract, run_kernels  # noqa: E402
from seed_scenario import CAP_GIB, build_assets, catalog_spec, lfa, steady_state  # noqa: E402

# label -> (model folder under ASSETS, lfa generate --pin arguments)
RUNS = {
    "plain_1.3b": ("model", []),
    "z2off_1.3b": ("model", ["deepspeed=zero2", "offload=optimizer"]),
    "z2off_1.3b_ga8": ("model", ["deepspeed=zero2", "offload=optimizer", "micro_batch_size=8"]),
    "z3off_1.3b": ("model", ["deepspeed=zero3", "offload=all"]),
    "z3off_6.7b": ("model_6.7b", ["deepspeed=zero3", "offload=all", "micro_batch_size=8"]),
    "z2off_6.7b_ga8": ("model_6.7b", ["deepspeed=zero2", "offload=optimizer", "micro_batch_size=8"]),
    "z2off_6.7b_ga64": ("model_6.7b", ["deepspeed=zero2", "offload=optimizer", "micro_batch_size=1"]),
    # the 6.7B's width and layer shapes, 12 of its 32 layers (2.69 B parameters): the whole 6.7B's offloaded states
    # do not fit the H200 host's 128 GiB (session 11: killed), these do
    "z2off_6.7b-12l_ga8": ("model_6.7b-12l", ["deepspeed=zero2", "offload=optimizer", "micro_batch_size=8"]),
    "z2off_6.7b-12l_ga64": ("model_6.7b-12l", ["deepspeed=zero2", "offload=optimizer", "micro_batch_size=1"]),
    "z3off_6.7b-12l": ("model_6.7b-12l", ["deepspeed=zero3", "offload=all", "micro_batch_size=8"]),
    # ZeRO-3 NVMe offload (issue 25): optimizer states on the device's disk (--nvme-path under the work folder)
    "z3nvme_6.7b-12l": ("model_6.7b-12l", ["deepspeed=zero3", "offload=nvme-optimizer", "micro_batch_size=8"]),
    "z3nvme_1.3b": ("model", ["deepspeed=zero3", "offload=nvme-optimizer", "micro_batch_size=16"]),
    "z3nvme_6.7b-12l_ga64": ("model_6.7b-12l", ["deepspeed=zero3", "offload=nvme-optimizer", "micro_batch_size=1"]),
    # memory-light optimizers on the whole 6.7B in fp16 (the seed card's precision), micro-batch 1 with checkpointing,
    # 8 rows per step so 20 steps fit a device call, on the whole H200 so that each peak is measured rather than cut
    # off by the cap (none of them fits the seed card's 31.73 GiB at cutoff 2048: lfa says so); the capped BAdam run
    # is session 15's, which OOMed
    "opt_adamw_6.7b": ("model_6.7b", ["micro_batch_size=1", "gradient_checkpointing=true"]),
    "opt_adamw8bit_6.7b": ("model_6.7b", ["micro_batch_size=1", "gradient_checkpointing=true", "optimizer=adamw_8bit"]),
    "opt_badam_6.7b": ("model_6.7b", ["micro_batch_size=1", "gradient_checkpointing=true", "optimizer=badam"]),
    # BAdam does not run in fp16 (session 16: the loss scaler cannot unscale its bf16 gradients): bf16, beside AdamW
    "opt_badam_6.7b_bf16": ("model_6.7b", ["micro_batch_size=1", "gradient_checkpointing=true", "optimizer=badam"]),
    "opt_adamw_6.7b_bf16": ("model_6.7b", ["micro_batch_size=1", "gradient_checkpointing=true"]),
    "opt_badam_6.7b_capped": ("model_6.7b", ["micro_batch_size=1", "gradient_checkpointing=true", "optimizer=badam"]),
}


def optimizer_run_args(label: str) -> list[str]:
    """fp16 (the seed card's precision) unless the label ends in _bf16; 8 rows per step, one seed."""
    precision = "bf16" if label.endswith("_bf16") else "fp16"
    return ["--precision", precision, "--set", "effective_batch_size=8", "--set", "seed=42"]


class PeakSampler:
    """The peak of measure() (GiB), sampled in a thread until stop(); measure returns None when there is nothing
    left to measure."""

    def __init__(self, measure, period_s: float):
        self.measure, self.period_s, self.peak_gib, self._stop = measure, period_s, 0.0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            value = self.measure()
            if value is None:
                return
            self.peak_gib = max(self.peak_gib, value)
            time.sleep(self.period_s)

    def stop(self) -> float:
        self._stop.set()
        self.thread.join(timeout=5)
        return self.peak_gib


def folder_gib(folder: Path) -> float:
    """Bytes under a folder (the NVMe swap files)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total / 2**30


def tree_rss_gib(pid: int) -> float | None:
    """Summed RSS of a process and all its descendants (psutil); None once it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        total = 0
        for proc in [root, *root.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                pass
        return total / 2**30
    except psutil.Error:
        return None


def big_ram_profile(work: Path) -> Path:
    """The h200 profile with RAM lfa will not refuse: the runs must reach DeepSpeed to be measured."""
    import yaml

    from lf_adapter.hardware import builtin_profiles

    data = yaml.safe_load(builtin_profiles()["h200"].read_text())
    data.update(name="h200-bench-unbounded-ram", ram_gib=4096)
    path = work / "h200-bench.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_one(label: str, assets: Path, work: Path, out: Path, steps: int, timeout_s: float) -> dict:
    import signal
    import subprocess

    model_dir, pins = RUNS[label]
    folder, run_dir = work / label, work / "runs" / label
    env = {**os.environ, "DISABLE_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1", contract.BENCH_SKIP_FINAL_SAVE: "1"}
    optimizer_run = label.startswith("opt_")
    capped = label.endswith("_capped")
    if capped:
        env[contract.EMULATE_VRAM_GIB] = str(CAP_GIB)
    profile = "h200-capped-32g" if capped else str(big_ram_profile(work))
    (out / f"{label}.gen.log").unlink(missing_ok=True)
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
        *(optimizer_run_args(label) if optimizer_run else []),
        *[x for p in pins for x in ("--pin", p)],
        "--set",
        f"max_steps={20 if optimizer_run else steps}",
        "--set",
        "save_strategy=no",
        *(["--nvme-path", str(work / "swap" / label)] if any("nvme" in p for p in pins) else []),
        "--logging-steps",
        "1",
        "-o",
        str(folder),
        "--force",
        env=env,
        log=out / f"{label}.gen.log",
    )
    started = time.time()
    train = [
        sys.executable,
        "-m",
        "lf_adapter.cli",
        "train",
        str(folder / "train.yaml"),
        "--run-dir",
        str(run_dir),
        "--max-attempts",
        "1",
    ]
    with open(out / f"{label}.log", "wb") as log:
        process = subprocess.Popen(train, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        sampler = PeakSampler(lambda: tree_rss_gib(process.pid), 0.25)
        swap = PeakSampler(lambda: folder_gib(work / "swap" / label), 1.0)
        try:
            rc = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # lfa train stops the trainer's group on SIGINT
            process.send_signal(signal.SIGINT)
            rc = process.wait()
        tree_peak = sampler.stop()
        disk_peak = swap.stop()
    shutil.rmtree(work / "swap" / label, ignore_errors=True)  # the device's disk holds one run's swap at a time
    text = (out / f"{label}.log").read_text(errors="replace")
    attempt_logs = sorted(run_dir.glob("attempt-*.log"))
    trainer_text = attempt_logs[-1].read_text(errors="replace") if attempt_logs else ""
    for name in ("events.jsonl", "report.html"):  # per-step NVML utilization, SM clock and power; the run report
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, out / f"{label}-{name}")
    for attempt_log in attempt_logs:
        (out / f"{label}-{attempt_log.name}").write_text(attempt_log.read_text(errors="replace"))
    peaks = re.findall(r"LFA_PEAK allocated_gib=([\d.]+) reserved_gib=([\d.]+) host_rss_gib=([\d.]+)", trainer_text)
    meta = json.loads(
        next(line[12:] for line in (folder / "train.yaml").read_text().splitlines() if line.startswith("# lfa-meta: "))
    )
    ledger = json.loads((run_dir / "ledger.json").read_text()) if (run_dir / "ledger.json").exists() else {}
    attempts = ledger.get("attempts") or [{}]
    row = {
        "rc": rc,
        "plan": attempts[0].get("plan"),
        run_kernels.ROW_KEY: run_kernels.record(env),
        "model": model_dir,
        "wall_s": round(time.time() - started, 1),
        "failure": (attempts[0].get("failure") or {}).get("kind"),
        "tree_peak_rss_gib": round(tree_peak, 2),
        "trainer_peak_rss_gib": float(peaks[-1][2]) if peaks else None,
        "peak_reserved_gib": float(peaks[-1][1]) if peaks else None,
        "peak_allocated_gib": float(peaks[-1][0]) if peaks else None,
        "predicted_reserved_gib": meta.get("predicted_reserved_gib"),
        "predicted_host_gib": meta.get("predicted_host_gib"),
        "predicted_tokens_per_s": meta.get("predicted_tokens_per_s"),
        "peak_swap_gib": round(disk_peak, 2),
        "predicted_disk_gib": meta.get("predicted_disk_gib"),
        "killed": "SIGKILL" in text or "exitcode  : -9" in trainer_text,
    }
    row.update(steady_state(run_dir / "events.jsonl"))
    trainer_log = folder / "saves" / "pseudo2norm" / "trainer_log.jsonl"
    if optimizer_run and trainer_log.exists():
        records = [json.loads(line) for line in trainer_log.read_text().splitlines() if line.strip()]
        row["losses"] = [r["loss"] for r in records if r.get("loss") is not None]  # the last record is the summary
    return row


def table(results: dict) -> None:
    from lf_adapter.hardware import load_profile
    from lf_adapter.memory import disk_gib, estimate, host_memory
    from lf_adapter.plan import Plan
    from lf_adapter.throughput import predict_tokens_per_s

    hardware = load_profile("h200")
    print(
        f"{'run':16s} {'plan':50s} {'trainer':>7s} {'pred':>6s} {'err':>6s} {'tree':>6s} {'node':>6s} "
        f"{'tok/s':>7s} {'pred':>7s} {'err':>6s}"
    )
    for label, row in results.items():
        if not row.get("plan"):
            print(f"{label:16s} (no plan: rc {row.get('rc')})")
            continue
        spec = catalog_spec(row["model"])
        plan = Plan.from_label(row["plan"])
        host = host_memory(spec, plan, hardware)
        launcher = next(v for k, v in host.items.items() if k.startswith("launcher"))
        per_rank = host.total_gib - launcher  # one rank on this node
        trainer = row.get("trainer_peak_rss_gib")
        tps = row.get("steady_tokens_per_s") if (row.get("steps_measured") or 0) >= 3 else None
        with run_kernels.measured_with(run_kernels.of_row(row)):  # the kernels it ran (before session 28: liger's own)
            pred_tps = predict_tokens_per_s(spec, plan, hardware, 2048, 1475 / 2048)
            gpu = estimate(spec, plan.replace(alloc_conf="expandable_segments:True"), 2048, None).reserved_gib
        err = f"{per_rank / trainer - 1:+.1%}" if trainer else ("killed" if row.get("killed") else "-")
        terr = f"{pred_tps / tps - 1:+.1%}" if tps else "-"
        print(
            f"{label:16s} {row['plan'][:50]:50s} {trainer or 0:7.1f} {per_rank:6.1f} {err:>6s} "
            f"{row.get('tree_peak_rss_gib') or 0:6.1f} {host.total_gib:6.1f} {tps or 0:7,.0f} {pred_tps:7,.0f} "
            f"{terr:>6s}"
        )
        if row.get("peak_reserved_gib"):
            print(
                f"{'':16s} GPU reserved {row['peak_reserved_gib']:.2f} GiB, predicted {gpu:.2f} "
                f"({gpu / row['peak_reserved_gib'] - 1:+.1%})"
            )
        if plan.offloads_to_nvme and row.get("peak_swap_gib"):
            disk = disk_gib(spec, plan)
            print(
                f"{'':16s} NVMe swap {row['peak_swap_gib']:.2f} GiB, predicted {disk:.2f} "
                f"({disk / row['peak_swap_gib'] - 1:+.1%})"
            )


def loss_table(results: dict) -> None:
    """Each optimizer run's loss per step beside AdamW's from the same start (same seed, data order, weights)."""
    runs = {label: row["losses"] for label, row in results.items() if row.get("losses")}
    if not runs:
        return
    print("\nloss per optimizer step (same seed, rows and random initial weights; reported, not claimed equal)")
    print("step " + " ".join(f"{label:>20s}" for label in runs))
    for step in range(max(len(v) for v in runs.values())):
        print(
            f"{step + 1:4d} "
            + " ".join(
                f"{v[step]:20.4f}" if step < len(v) and v[step] is not None else f"{'-':>20s}" for v in runs.values()
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("assets", type=Path, nargs="?")
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--only", default=",".join(RUNS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--run-timeout-s", type=float, default=300)
    parser.add_argument("--deadline-s", type=float, default=540, help="start no run after this many seconds")
    parser.add_argument("--table", type=Path, help="print predicted vs measured for a results file, run nothing")
    args = parser.parse_args()
    if args.table:
        results = json.loads(args.table.read_text())
        table(results)
        loss_table(results)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.assets / "offload"
    work.mkdir(parents=True, exist_ok=True)
    begun = time.time()
    results_file = args.out / "offload.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    for label in [name for name in args.only.split(",") if name in RUNS]:
        build_assets(args.assets, RUNS[label][0])
        started = time.time()
        left = args.deadline_s - (started - begun)
        if left < 60:
            print(f"BENCH {label} skipped: {left:.0f}s left before the deadline", flush=True)
            continue
        results[label] = run_one(label, args.assets, work, args.out, args.steps, min(args.run_timeout_s, left))
        print(f"BENCH {label} done in {time.time() - started:.0f}s: {json.dumps(results[label])}", flush=True)
        results_file.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
