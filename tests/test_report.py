"""lfa report, the summary block, lfa status's table: on synthetic run folders (fast) and on real runs (the demo)."""

import json
import os
import re
import time
from pathlib import Path

import pytest

from conftest import _events, run_lfa
from lf_adapter.run.control import run_status
from lf_adapter.run.ledger import AttemptRecord, RunLedger, read_ledger, write_ledger
from lf_adapter.run.process import process_record
from lf_adapter.run.report import FIGURES, collect, summary_lines, write_report


def _png_is_a_picture(path: Path) -> None:
    """The file decodes as a PNG and is not blank: many colours, not one flat area."""
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 300 and image.size[1] > 150
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50
    assert max(count for count, _ in colours) < 0.97 * sum(count for count, _ in colours)


def _run_folder(tmp_path: Path, *, status="failed", supervisor_pid=None, steps=(1, 2, 3, 4, 5, 6, 7, 8)) -> Path:
    """A run of two attempts: the first OOMs after step 4, the second resumes from checkpoint-4 and finishes."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    t0 = time.time() - 100
    first = AttemptRecord(
        n=1,
        started="2026-12-03T10:00:00",
        plan="fp16/mbs8xga1x1/nogc/sdpa",
        started_at=t0,
        ended_at=t0 + 30,
        duration_s=30.0,
        first_step=1,
        last_step=4,
        returncode=1,
        status="failed",
        failure={
            "kind": "cuda_oom",
            "retriable": True,
            "evidence": ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.79 GiB"],
        },
        remedy={"action": "replan", "why": "ZeRO-2 optimizer offload fits", "decided_at": t0 + 30},
        predicted={
            "tokens_per_s": 3000,
            "reserved_gib": 40.0,
            "budget_gib": 31.73,
            "memory_gib": {"weights (fp16)": 2.6},
            "host_gib": 20.0,
        },
    )
    second = AttemptRecord(
        n=2,
        started="2026-12-03T10:01:00",
        plan="fp16/mbs4xga2x1/nogc/sdpa",
        started_at=t0 + 40,
        resumed_from=str(tmp_path / "saves" / "checkpoint-4"),
        overrides={"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
        predicted={
            "tokens_per_s": 2500,
            "reserved_gib": 25.0,
            "budget_gib": 31.73,
            "memory_gib": {"weights (fp16)": 2.6, "activations": 10.0},
            "host_gib": 20.0,
            "flops_per_token": 9.0e9,
            "peak_tflops": 125.0,
        },
    )
    if status == "succeeded":
        second.status, second.first_step, second.last_step, second.ended_at = "succeeded", 5, 8, t0 + 90
    ledger = RunLedger(recipe="", attempts=[first, second], status=status, supervisor_pid=supervisor_pid)
    if supervisor_pid:  # as the supervisor records itself: pid, start time, command line
        ledger.supervisor_process = process_record(supervisor_pid).to_dict()
    write_ledger(run_dir, ledger)
    events = []
    for step in steps:
        n = 1 if step <= 4 else 2
        t = t0 + (step * 5 if n == 1 else 40 + (step - 4) * 5)
        events.append(
            {
                "event": "step",
                "global_step": step,
                "max_steps": 8,
                "step_time_s": 1.0 + 0.1 * step,
                "step_tokens": 2800 + 10 * step,
                "gpu_reserved_gib": 20.0 + step,
                "gpu_allocated_gib": 18.0,
                "gpu_util_pct": 90 + step % 3,
                "gpu_util_min": 40,
                "gpu_util_max": 100,
                "gpu_sm_clock_mhz": 1380,
                "gpu_sampling": "nvml sample buffer",
                "gpu_power_w": 250.0 + step,
                "host_rss_gib": 9.5,
                "time": t,
                "attempt": n,
            }
        )
        events.append(
            {
                "event": "log",
                "global_step": step,
                "loss": 5.0 - 0.3 * step,
                "grad_norm": 1.0 + 0.05 * step,
                "learning_rate": 1e-4 * (1 - step / 10),
                "time": t,
                "attempt": n,
            }
        )
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "st')
    return run_dir


def test_report_marks_attempts_failures_and_resume_points_and_embeds_every_plot(tmp_path):
    run_dir = _run_folder(tmp_path, status="succeeded")
    report, page = write_report(run_dir)
    assert report.state == "succeeded" and [s.steps for s in report.series.values()] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    for name in FIGURES:
        _png_is_a_picture(run_dir / f"{name}.png")
    text = page.read_text()
    assert len(re.findall(r"src='data:image/png;base64,", text)) == len(FIGURES)
    assert not re.search(r"(src|href)=['\"]https?:", text)  # opens offline
    for cell in (
        "cuda_oom",
        "Tried to allocate 1.79 GiB",
        "replan: ZeRO-2 optimizer offload fits",
        "checkpoint-4",
        "1-4",
        "5-8",
        "per_device_train_batch_size",
    ):
        assert cell in text, cell
    # the markers are drawn on the per-step axes: attempt boundary, resume point, the failure's label
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lf_adapter.run.figures import _mark_attempts

    fig, ax = plt.subplots()
    _mark_attempts(ax, report)
    labels = [t.get_text() for t in ax.texts]
    positions = sorted(line.get_xdata()[0] for line in ax.lines)
    plt.close(fig)
    assert "OOM" in labels and "attempt 2" in labels and positions == [4, 4, 4]


def test_summary_compares_speed_and_memory_with_the_prediction(tmp_path):
    report = collect(_run_folder(tmp_path, status="succeeded"))
    lines = "\n".join(summary_lines(report, tmp_path / "report.html"))
    assert "attempts     1: failed (OOM), 2: succeeded" in lines
    steady = (2800 + 80) / 1.8  # attempt 2's steps 5-8 less 3 warm-up steps: step 8 alone
    assert f"{steady:,.0f} steady (predicted 2,500, -36%)" in lines
    assert "28.00 GiB reserved (predicted 25.00" in lines and "card 31.7 GiB" in lines
    assert "final loss   2.6000 at step 8" in lines and str(tmp_path / "report.html") in lines
    # utilization: the mean of the steps after warm-up (step 8 alone here: 90 + 8 % 3), and the MFU beside it
    assert "GPU busy     92% of the time (NVML, nvml sample buffer" in lines
    assert f"MFU {steady * 9.0e9 / 125e12:.1%}" in lines


def test_report_of_a_run_killed_before_its_first_step_and_of_a_running_one(tmp_path):
    dead = _run_folder(tmp_path, status="running", supervisor_pid=2**22 + 12345, steps=())
    report, page = write_report(dead)
    assert report.state == "dead" and "killed?" in page.read_text()
    for name in FIGURES:
        _png_is_a_picture(dead / f"{name}.png")  # a picture that says there is nothing yet, not an empty canvas
    running = _run_folder(tmp_path / "second", status="running", supervisor_pid=os.getpid(), steps=(1, 2, 3))
    report, page = write_report(running, tmp_path / "elsewhere")
    assert report.state == "running" and "still running" in page.read_text()
    assert (tmp_path / "elsewhere" / "loss.png").is_file() and not (running / "loss.png").exists()


def test_ledger_round_trips_and_a_damaged_one_is_one_message(tmp_path):
    run_dir = _run_folder(tmp_path)
    ledger = read_ledger(run_dir)
    assert ledger.attempts[0].failure["kind"] == "cuda_oom" and ledger.last.resumed_from.endswith("checkpoint-4")
    data = json.loads((run_dir / "ledger.json").read_text())
    data["attempts"][0]["from_a_newer_lfa"] = 1  # unknown keys are skipped, not fatal
    (run_dir / "ledger.json").write_text(json.dumps(data))
    assert read_ledger(run_dir).attempts[0].n == 1
    (run_dir / "ledger.json").write_text('{"attempts": [3]}')
    result = run_lfa("report", run_dir)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "ledger.json" in result.stderr
    assert "Traceback" not in result.stderr


def test_report_cli_bad_input(tmp_path):
    missing = run_lfa("report", tmp_path / "nope")
    assert missing.returncode == 2 and "no run" in missing.stderr and "Traceback" not in missing.stderr
    run_dir = _run_folder(tmp_path)
    (tmp_path / "file").write_text("x")
    not_a_dir = run_lfa("report", run_dir, "--out", tmp_path / "file")
    assert not_a_dir.returncode == 2 and "Traceback" not in not_a_dir.stderr
    ok = run_lfa("report", run_dir)
    assert ok.returncode == 0 and "report" in ok.stdout and (run_dir / "report.html").is_file()


def test_status_is_a_table_with_eta_and_start(tmp_path):
    run_dir = _run_folder(tmp_path, status="running", supervisor_pid=os.getpid(), steps=(1, 2, 3))
    result = run_lfa("status", run_dir)
    header, row = result.stdout.splitlines()[:2]
    assert header.split()[:6] == ["run", "state", "attempt", "step", "loss", "tok/s"] and "ETA" in header
    cells = row.split()
    assert cells[:4] == ["run", "running", "2", "3/8"]
    # 5 steps left at the smoothed step time (1.1, 1.2, 1.3 s)
    assert "0:00:06" in row and "2026-12-03 10:00:00" in row
    [as_json] = json.loads(run_lfa("status", run_dir, "--json").stdout)
    assert as_json["eta_s"] == pytest.approx(5 * (0.7 * (0.7 * 1.1 + 0.3 * 1.2) + 0.3 * 1.3))


def test_demo_ends_with_a_summary_and_writes_its_report(tmp_path):
    result = run_lfa("demo", "--dir", tmp_path / "demo", "--rows", "48", "--max-steps", "6", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"attempts     1: succeeded", out) and "steady" in out and "final loss" in out
    page = tmp_path / "demo" / "run" / "report.html"
    assert f"report       {page}" in out.replace(str(tmp_path.resolve()), str(tmp_path)) or str(page.name) in out
    text = page.read_text()
    assert len(re.findall(r"data:image/png;base64,", text)) == len(FIGURES) and "<th>plan</th>" in text
    for name in FIGURES:
        _png_is_a_picture(tmp_path / "demo" / "run" / f"{name}.png")
    ledger = read_ledger(tmp_path / "demo" / "run")
    assert ledger.attempts[0].predicted["speed_basis"].startswith("CPU")


def test_events_that_are_not_steps_are_left_out_and_said(tmp_path):
    run_dir = _run_folder(tmp_path, status="succeeded")
    with (run_dir / "events.jsonl").open("a") as fh:  # after the cut line _run_folder leaves
        fh.write('\n{"event": "step", "global_step": "7b", "attempt": 2}\n[1, 2]\n')
        fh.write('{"event": "log", "loss": "low"}\n')
        fh.write('{"event": "step", "max_steps": [], "step_tokens": "x", "step_time_s": 0}\n')
    report, page = write_report(run_dir)
    text = page.read_text()
    assert "2 line(s) that are not events and 2 step event(s) without an integer step" in text
    assert sorted(report.series[2].steps) == [5, 6, 7, 8]
    status = run_status(run_dir)  # `lfa status` reads the same tail: nothing of the wrong type is shown
    assert status.step is None and status.total_steps is None and isinstance(status.loss, (float, type(None)))


def test_the_page_escapes_what_runs_and_recipes_put_in_it(tmp_path):
    run_dir = _run_folder(tmp_path, status="succeeded")
    ledger = json.loads((run_dir / "ledger.json").read_text())
    ledger["notes"] = ["<script>alert('note')</script>"]
    ledger["attempts"][0]["plan"] = "fp16/<img src=x onerror=alert(1)>"
    (run_dir / "ledger.json").write_text(json.dumps(ledger))
    _, page = write_report(run_dir)
    text = page.read_text()
    assert "<script>" not in text and "<img src=x" not in text
    assert "&lt;script&gt;alert(&#39;note&#39;)&lt;/script&gt;" in text and "fp16/&lt;img src=x" in text


def test_the_loss_plateau_is_found_and_a_previous_run_of_the_recipe_is_compared(tmp_path):
    import math

    from lf_adapter.run.report import plateau_step

    steps = list(range(1, 101))
    settling = [2.0 + 3.0 * math.exp(-s / 8) + 0.01 * (-1) ** s for s in steps]  # flat (within 5%) from ~step 25
    assert 20 <= plateau_step(steps, settling) <= 35
    assert plateau_step(steps, [5.0 - 0.03 * s for s in steps]) is None  # still falling at the end
    assert plateau_step(steps[:10], settling[:10]) is None  # too few points to say
    # two runs of one recipe in one runs folder: the later one's summary names the earlier one's final loss
    earlier = _run_folder(tmp_path / "a", status="succeeded")
    later = _run_folder(tmp_path / "b", status="succeeded")
    runs = tmp_path / "runs"
    runs.mkdir()
    earlier.rename(runs / "earlier")
    for run in (runs / "earlier", later):
        ledger = json.loads((run / "ledger.json").read_text())
        ledger["recipe"] = str(tmp_path / "recipe" / "train.yaml")
        (run / "ledger.json").write_text(json.dumps(ledger))
    ledger = json.loads((later / "ledger.json").read_text())
    for attempt in ledger["attempts"]:  # began after the earlier run ended
        attempt["started_at"] += 1000
        attempt["ended_at"] = attempt["ended_at"] and attempt["ended_at"] + 1000
    (later / "ledger.json").write_text(json.dumps(ledger))
    later.rename(runs / "later")
    lines = "\n".join(summary_lines(collect(runs / "later"), None))
    assert "previous run earlier of this recipe: final loss 2.6000 at step 8" in lines
    assert "previous run" not in "\n".join(summary_lines(collect(runs / "earlier"), None))


def test_a_kernel_profile_reaches_the_summary_and_the_page(tmp_path, cpu_recipe):
    """lfa train --kernel-profile through the real trainer on the CPU (operators there, kernels on a GPU); a run
    without it says how to get one."""
    recipe = cpu_recipe("max_steps=5", "logging_steps=1", "output_dir=saves/profiled")
    result = run_lfa("train", recipe, "--run-dir", tmp_path / "profiled", "--kernel-profile")
    assert result.returncode == 0, result.stdout + result.stderr
    event = next(e for e in _events(tmp_path / "profiled") if e.get("event") == "kernels")
    assert event["device"] == "cpu" and (event["first_step"], event["last_step"]) == (3, 4)
    assert event["kinds_s"]["GEMMs"] > 0 and event["kinds_s"]["attention"] > 0
    assert sum(event["kinds_s"].values()) <= event["window_s"] * 1.01  # operators counted once, not nested
    assert "  profile      steps 3-4 of attempt 1 (CPU operators): " in result.stdout
    page = (tmp_path / "profiled" / "report.html").read_text()
    assert "Where the time went" in page and "<td>GEMMs</td>" in page and "aten::mm" in page
    _, path = write_report(_run_folder(tmp_path / "synthetic", status="succeeded"))
    assert "not profiled: <code>lfa train --kernel-profile</code>" in path.read_text()


def test_a_gpu_kernel_profile_shows_where_the_gpu_waited(tmp_path):
    run_dir = _run_folder(tmp_path, status="succeeded")
    gaps = [[40.5, 812.0, "void pytorch_flash::flash_fwd_kernel<...>", "liger_cross_entropy_kernel"]]
    kernels = {
        "event": "kernels",
        "first_step": 7,
        "last_step": 7,
        "window_s": 2.0,
        "device": "cuda",
        "gpu_busy_s": 1.8,
        "gpu_idle_s": 0.2,
        "kinds_s": {"GEMMs": 1.2, "attention": 0.6},
        "top_kernels": [["nvjet_sm90_tst", 1.2, 100]],
        "kernels_span_s": 1.95,
        "gaps_of_1ms": 3,
        "gaps_of_1ms_s": 0.0705,
        "longest_gaps": gaps,
        "attempt": 2,
    }
    with open(run_dir / "events.jsonl", "r+") as fh:  # before the torn last line the folder ends with
        lines = fh.read().splitlines()
        fh.seek(0)
        fh.write("\n".join([*lines[:-1], json.dumps(kernels), lines[-1]]))
    _, page = write_report(run_dir)
    text = page.read_text()
    assert "Longest GPU waits between kernels (3 of 1 ms or more, 0.070 s; the kernels spanned 1.950 s" in text
    assert "<td>40.50</td><td>812.0</td><td>void pytorch_flash::flash_fwd_kernel&lt;...&gt;</td>" in text
