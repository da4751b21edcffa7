"""Watching one attempt: the trainer's log and the plugin's events, the measured peak against the prediction."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ..measured import OVER_PREDICTION, MeasuredPeak, card_key, now_iso, record_peak, shape_key
from ..nvml_session import gpu_used_gib
from ..plugin import contract, run_kernels
from ..recipe.read import recipe_cutoff
from .ledger import (
    AttemptRecord,
)
from .monitor import (
    FileFollower,
    LineReader,
    TrainerLogWatcher,
    classify,
    failure_class,
    fold_event,
    json_record,
)
from .preflight import RunSetup
from .process import (
    start,
    stop_group,
)

POLL_S = 0.1


def attempt_peak_rss_gib(events_file: Path, attempt: int) -> float | None:
    """The largest host RSS rank 0's plugin reported during one attempt (GiB), None without events."""
    peak = None
    try:
        lines = events_file.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for event in filter(None, map(json_record, lines)):
        if event.get("attempt") == attempt and isinstance(event.get("host_rss_gib"), (int, float)):
            peak = max(peak or 0.0, float(event["host_rss_gib"]))
    return peak


def _read_events(events_follower: FileFollower, reader: LineReader, state: dict) -> bool:
    """Fold new plugin events into the progress state; True when something arrived."""
    changed = False
    for event in filter(None, map(json_record, reader.feed(events_follower.read_new()))):
        changed = True
        fold_event(state, event)
    return changed


def _note_step(result: dict, step: int, first: int | None = None) -> None:
    """Record the attempt's steps; `first`: the lowest step among the events read with this one."""
    low = min(step, first) if first is not None else step
    result["first_step"] = low if result["first_step"] is None else min(result["first_step"], low)
    result["last_step"] = max(result["last_step"] or 0, step)


def _drain_steps(events: FileFollower, events_reader: LineReader, watcher: TrainerLogWatcher, result: dict) -> None:
    """After a stop signal: the steps the trainer reported before it ended, which the loop had no time to read."""
    state: dict = {}
    if _read_events(events, events_reader, state) and state.get("step"):
        _note_step(result, state["step"], state.get("first_step"))
    for record in watcher.poll():
        if record.get("current_steps") is not None:
            _note_step(result, record["current_steps"])


@dataclass
class Launch:
    """One attempt ready to start: its command line and environment, and what it changes and resumes from."""

    n: int
    command: list[str]
    env: dict
    env_names: list[str]  # the launch environment entries recorded in the ledger
    overrides: dict
    changes: dict
    checkpoint: Path | None


@dataclass
class _Watch:
    """One attempt's followers and what they have read so far: the log's new lines, the plugin's events and
    trainer_log.jsonl, the progress state, the result, and when a stop was decided."""

    setup: RunSetup
    n: int
    attempt: AttemptRecord | None
    log_file: BinaryIO
    watcher: TrainerLogWatcher
    events: FileFollower
    result: dict
    events_reader: LineReader = field(default_factory=lambda: LineReader(tail=20))
    state: dict = field(default_factory=dict)
    probed_at: float = 0.0
    detected_at: float | None = None

    def stop(self, kind: str, why: str | None = None) -> None:
        """Decide to stop the attempt (once): the kind the ledger records, a line for its log."""
        if self.detected_at is not None:
            return
        self.detected_at = time.time()
        if why:
            self.log_file.write(f"lfa: {why}; stopping the attempt\n".encode())
            self.log_file.flush()
        self.result["live_stop"] = {"kind": kind, "detected_at": self.detected_at}

    def classify(self, new_lines: list[str]) -> None:
        """A failure class that stops at its first line (seen in the log as it is written)."""
        if self.detected_at is None and new_lines:
            live = classify(new_lines, None)
            if live and failure_class(live.kind).stop_at_first_line:
                self.stop(live.kind)

    def follow_progress(self) -> None:
        """The plugin's events, the GPU's memory every 2 s and trainer_log.jsonl's records into the progress line."""
        reporter, state = self.setup.reporter, self.state
        changed = _read_events(self.events, self.events_reader, state)
        if changed and state.get("step"):  # the plugin's step event can precede trainer_log.jsonl's record
            _note_step(self.result, state["step"], state.get("first_step"))
        if time.time() - self.probed_at > 2.0:
            state["gpu_used_gib"], self.probed_at, changed = gpu_used_gib(), time.time(), True
        for record in self.watcher.poll():
            step = record.get("current_steps")
            if step is not None:
                _note_step(self.result, step)
                state.update(step=step, total=record.get("total_steps"))
            state.update({k: record[k] for k in ("loss", "lr") if k in record})
            if record.get("remaining_time"):
                state["eta"] = record["remaining_time"]
            reporter.progress(self.n, state, record)
            changed = False
        if changed:
            reporter.progress(self.n, state, None)

    def check_health(self) -> None:
        """A peak above the prediction (a warning), a stalled or diverging loss (a warning, a stop when asked), a
        non-finite loss or gradient norm in three consecutive logs (a stop)."""
        setup, result, n = self.setup, self.result, self.n
        if self.attempt is not None and "memory_warning" not in result:
            warning = peak_above_prediction(setup, self.attempt, self.state)
            if warning:
                result["memory_warning"] = self.state["memory_warning"] = warning
                setup.reporter.event("warning", f"[attempt {n}] lfa: {warning}", attempt=n, warning=warning)
        vocab_size = setup.trained_model.vocab_size if setup.trained_model else None
        stall = self.watcher.stalled(vocab_size) if "divergence_warning" not in result else None
        if stall:
            result["divergence_warning"] = stall
            setup.reporter.event("warning", f"[attempt {n}] lfa: {stall}", attempt=n, warning=stall)
            if setup.request.stop_on_divergence:
                self.stop("loss_diverged", f"loss diverged: {stall}")
        if self.watcher.diverged:
            self.stop("nan_loss", "non-finite loss or grad_norm in 3 consecutive logs")


def watch_attempt(
    setup: RunSetup,
    launch: Launch,
    interrupted: dict,
    on_start,
    start_process=start,
    attempt: AttemptRecord | None = None,
) -> dict:
    """Start the trainer and follow it to its end: the progress line, the steps it made, a failure that ends it
    early (a NaN, a divergence, a class that cannot recover), its return code and the log's tail."""
    n, command, env = launch.n, launch.command, launch.env
    log_path = setup.run_dir / f"attempt-{n}.log"
    events_path = Path(env[contract.EVENTS_FILE])
    trainer_log = setup.output_dir / "trainer_log.jsonl"
    watcher = TrainerLogWatcher(trainer_log)
    watcher.follower.offset = trainer_log.stat().st_size if trainer_log.exists() else 0
    events = FileFollower(events_path)
    events.offset = events_path.stat().st_size if events_path.exists() else 0
    reader = LineReader()
    result = {"log": log_path.name, "first_step": None, "last_step": None, "live_stop": None}
    with log_path.open("ab") as log_file:
        log_file.write(f"$ {' '.join(command)}\n".encode())
        log_file.flush()
        watch = _Watch(setup, n, attempt, log_file, watcher, events, result)
        started = result["started_at"] = time.time()
        process = start_process(command, setup.recipe.folder, env, log_file)
        interrupted.update(
            process=process, result=result, drain=lambda: _drain_steps(events, watch.events_reader, watcher, result)
        )
        on_start(process.pid)
        follower = FileFollower(log_path)
        while True:
            done = process.poll() is not None
            watch.classify(reader.feed(follower.read_new()))
            watch.follow_progress()
            watch.check_health()
            if done:
                break
            if watch.detected_at is not None and time.time() - watch.detected_at > 0.5:
                stop_group(process, grace_s=0.5)
                break
            time.sleep(POLL_S)
        returncode = process.wait()
        setup.reporter.end_progress()
        reader.feed(follower.read_new())
        reader.flush()
        watcher.poll()
        result.update(
            returncode=returncode,
            duration_s=round(time.time() - started, 2),
            started_at=started,
            ended_at=time.time(),
            last_finite_step=watcher.last_finite_step,
            first_nonfinite_step=watcher.first_nonfinite_step,
        )
        result["tail"] = list(reader.tail)
    interrupted["process"] = None
    return result


def peak_above_prediction(setup: RunSetup, record: AttemptRecord, state: dict) -> str | None:
    """After the first steps: the measured peak against the attempt's prediction. More than 3% above is a warning,
    and the measurement is stored for the next `lfa generate` of this model shape on this card."""
    predicted, measured = record.predicted.get("reserved_gib"), state.get("gpu_reserved_gib")
    if not predicted or not measured or (state.get("step") or 0) < 2 or setup.trained_model is None:
        return None
    peak = MeasuredPeak(
        shape=shape_key(setup.trained_model),
        card=card_key(setup.hardware),
        plan=record.plan,
        seq_len=recipe_cutoff(setup.effective),
        predicted_reserved_gib=predicted,
        measured_reserved_gib=measured,
        measured_allocated_gib=state.get("gpu_allocated_gib") or measured,
        run=str(setup.run_dir),
        recorded=now_iso(),
    )
    if peak.over <= OVER_PREDICTION:
        return None
    warning = (
        f"GPU memory peaked at {measured:.2f} GiB reserved, {100 * peak.over:.1f}% above the predicted "
        f"{predicted:.2f} GiB"
    )
    unpriced = run_kernels.unpriced(os.environ)
    if unpriced:  # another memory than the plan's: the next plan must not learn from it
        return f"{warning} (under {', '.join(unpriced)}, which the plan does not price: not stored)"
    stored = record_peak(peak)
    return f"{warning} (the memory model's error on this model)" + (
        f"; stored in {stored}: the next lfa generate of this model on this card plans from it" if stored else ""
    )
