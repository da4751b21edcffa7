"""Stage 10: the supervisor behind `lfa train`: attempts, ledger, resume, resolved recipe, detached runs."""

from __future__ import annotations

import dataclasses
import datetime as dt
import errno
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import UserError
from ..plugin import contract
from ..quoting import shell_export
from ..quoting import yaml_scalar as _scalar
from ..recipe.keys import launch_env, plan_keys
from .checkpoints import content_hash, newest_complete_checkpoint, set_aside_poisoned_checkpoints
from .ledger import (
    SUPERVISOR_FILE,
    AttemptRecord,
    release_reserve,
    reserve_room,
)
from .monitor import (
    Failure,
    cgroup_oom_kills,
    classify,
    failure_classes,
    host_oom_evidence,
    unexplained_kill,
)
from .preflight import RunSetup, attempt_prediction, disk_shortfall, preflight, prepare, swap_shortfall
from .process import (
    llamafactory_command,
    process_record,
    resolve_env,
    start,
    stop_group,
)
from .progress import Reporter
from .remedies import Attempt, next_remedy
from .request import TrainRequest
from .resolved import key_changes, resolved_text, write_accelerate_config, write_deepspeed_config
from .watch import Launch, attempt_peak_rss_gib, watch_attempt


def supervise(request: TrainRequest, finish: bool = True, start_process=start) -> int:
    """Prepare, run the attempts, finish: the run's exit code; the summary block and report once it ran
    (finish=False: the caller calls finish_run itself)."""
    setup = prepare(request)
    code = attempt_loop(setup, start_process)
    if finish:
        finish_run(setup.run_dir, setup.reporter)
    return code


def finish_run(run_dir: Path, reporter: Reporter) -> None:
    """The summary block (attempts, wall time, speed and memory against the prediction, final loss) and
    report.html with its PNGs in the run folder. A report that cannot be drawn never changes the run's outcome."""
    from .report import headline, summary_lines, write_report

    try:
        report, page = write_report(run_dir)
    except (UserError, OSError, ValueError) as exc:
        reporter.event("report_error", f"lfa: no report written: {exc}", error=str(exc))
        return
    if reporter.json_events:
        reporter.event("summary", "", report=str(page), **headline(report))
    else:
        for line in summary_lines(report, page):
            reporter.event("summary", line)


@dataclass
class LoopState:
    """What carries from one attempt to the next: the plan to run, the changes the last one ran with, the notes for
    the resolved recipe, the remedies tried."""

    attempt: Attempt
    previous_changes: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tried: set[str] = field(default_factory=set)


def prepare_launch(setup: RunSetup, state: LoopState) -> Launch | str:
    """The next attempt's command, environment and overrides; a message instead when the disks lack room for it."""
    recipe, hardware, output_dir, attempt = setup.recipe, setup.hardware, setup.output_dir, state.attempt
    short = disk_shortfall(output_dir, setup.trained_model, attempt.plan, setup.effective)
    if short:
        return short
    changes = key_changes(setup.effective, attempt, plan_keys(setup.attempt.plan))
    if attempt.plan.deepspeed and (changes.get("deepspeed") or attempt.own_deepspeed_config):
        changes["deepspeed"] = write_deepspeed_config(recipe.folder, attempt.plan, setup.context.model, hardware)
    short = swap_shortfall(
        recipe.folder,
        changes.get("deepspeed") or setup.effective.data.get("deepspeed"),
        setup.context.model or setup.trained_model,
        attempt.plan,
    )
    if short:
        return short
    overrides = {**setup.user_keys, **changes, **setup.launch_keys}
    # every node resumes from the same checkpoint of the shared output_dir; only node 0 tidies it
    checkpoint = (
        newest_complete_checkpoint(output_dir, tidy=not setup.request.node_rank) if output_dir.exists() else None
    )
    if checkpoint:
        overrides["resume_from_checkpoint"] = str(checkpoint)
        if not any(a.resumed_from or a.last_step for a in setup.ledger.attempts):
            setup.reporter.event(
                "resume_note",
                f"lfa: resuming from {checkpoint}, left in output_dir by an earlier "
                "run; pass --fresh to start over (it renames old checkpoints aside)",
                checkpoint=str(checkpoint),
            )
    n = len(setup.ledger.attempts) + 1
    entries = launch_env(
        attempt.plan,
        offline=setup.model_dir.is_dir(),
        master_port=hardware.master_port,
        master_addr=hardware.master_addr,
        report_to=setup.effective.data.get("report_to"),
    )
    env = resolve_env(entries)
    env.update(attempt.env)
    env[contract.EVENTS_FILE] = str(setup.run_dir / "events.jsonl")
    env[contract.SUPERVISOR_PID] = str(os.getpid())  # the trainer saves and stops if this supervisor dies
    if setup.request.kernel_profile:
        env[contract.KERNEL_PROFILE] = "1"
    env.update(setup.rendezvous_env)
    if attempt.plan.strategy.started_by == "accelerate":
        write_accelerate_config(recipe.folder, attempt.plan)
    command = llamafactory_command(recipe.path, [f"{k}={_scalar(v)}" for k, v in overrides.items()], attempt.plan, env)
    env[contract.ATTEMPT] = str(n)
    return Launch(n, command, env, [e.name for e in entries], overrides, changes, checkpoint)


def record_attempt(setup: RunSetup, state: LoopState, launch: Launch) -> AttemptRecord:
    """The attempt's ledger entry, saved before it starts; says on the console what runs."""
    plan = state.attempt.plan
    record = AttemptRecord(
        n=launch.n,
        started=dt.datetime.now().isoformat(timespec="seconds"),
        plan=plan.label(),
        overrides=launch.overrides,
        env={name: launch.env[name] for name in launch.env_names} | state.attempt.env,
        recipe_hash=content_hash({**setup.recipe.data, **launch.overrides}),
        diff_from_previous={k: v for k, v in launch.changes.items() if state.previous_changes.get(k) != v},
        resumed_from=str(launch.checkpoint) if launch.checkpoint else None,
        predicted=attempt_prediction(setup.effective, setup.hardware, plan, setup.trained_model),
    )
    setup.reporter.event(
        "attempt_start",
        f"[attempt {launch.n}] {plan.label()}"
        + (f" resuming from {launch.checkpoint.name}" if launch.checkpoint else "")
        + (f" with {launch.overrides}" if launch.overrides else ""),
        attempt=launch.n,
        plan=plan.label(),
        overrides=launch.overrides,
    )
    setup.ledger.attempts.append(record)
    setup.save()
    return record


def run_and_classify(
    setup: RunSetup, launch: Launch, record: AttemptRecord, interrupted: dict, start_process
) -> tuple[dict, Failure | None]:
    """Start the trainer, watch it to its end, and say what went wrong (None: it succeeded)."""
    run_dir, output_dir = setup.run_dir, setup.output_dir

    def on_start(pid):
        record.trainer_pid = pid
        record.trainer_process = process_record(pid).to_dict()
        setup.save()

    oom_kills_before = cgroup_oom_kills()
    result = watch_attempt(setup, launch, interrupted, on_start, start_process, record)
    failure = classify(result.pop("tail"), result["returncode"])
    if failure is not None and failure.kind == "host_oom_kill":
        peak = attempt_peak_rss_gib(run_dir / "events.jsonl", launch.n)
        ram = setup.hardware.ram_gib or None
        evidence = host_oom_evidence(oom_kills_before, cgroup_oom_kills(), peak, ram)
        if evidence:
            failure.evidence.append(f"host OOM: {evidence}")
        else:
            failure = unexplained_kill(
                failure,
                "no sign of a host OOM: the cgroup's oom_kill count did not "
                "rise"
                + (f", the trainer's RSS peaked at {peak:.2f} of {ram:.0f} GiB" if peak and ram else "")
                + "; killed by someone else",
            )
    live_stop = (result["live_stop"] or {}).get("kind")
    if live_stop == "nan_loss":
        failure = classify(["lfa: non-finite loss or grad_norm"], None)
    if live_stop == "loss_diverged":
        failure = classify([f"lfa: loss diverged: {result['divergence_warning']}"], None)
    if failure is not None and failure.kind == "nan_loss" and output_dir.exists() and not setup.request.node_rank:
        trusted_until = result["last_finite_step"]
        if trusted_until is None and launch.checkpoint is not None:  # diverged at once: keep what it resumed from
            trusted_until = int(launch.checkpoint.name.rsplit("-", 1)[1]) + 1
        record.diverged_checkpoints_set_aside = set_aside_poisoned_checkpoints(output_dir, trusted_until)
    for key, value in result.items():
        setattr(record, key, value)
    record.failure = failure.to_dict() if failure else None
    return result, failure


def finish_success(setup: RunSetup, state: LoopState, launch: Launch, record: AttemptRecord) -> int:
    """Record the success; when lfa changed the recipe, write the recipe as it finally ran beside it."""
    record.status = setup.ledger.status = "succeeded"
    if launch.changes:
        recipe = setup.recipe
        resolved = recipe.path.with_name(recipe.path.stem + ".resolved.yaml")
        env_notes = [
            f"{shell_export(k, v)}  (set by lfa train; keep it when launching this file yourself)"
            for k, v in record.env.items()
            if k.startswith(("PYTORCH_", "LFA_", "HF_", "FORCE_"))
        ]
        resolved.write_text(resolved_text(recipe, {**setup.user_keys, **launch.changes}, state.notes + env_notes))
        setup.ledger.resolved_recipe = str(resolved)
        setup.reporter.event("resolved", f"wrote {resolved} (what changed and why in its header)", path=str(resolved))
    setup.save()
    setup.reporter.event(
        "done", f"[attempt {launch.n}] finished: {setup.output_dir}", attempt=launch.n, output_dir=str(setup.output_dir)
    )
    return 0


def decide_after_failure(
    setup: RunSetup, state: LoopState, record: AttemptRecord, failure: Failure, result: dict
) -> int | None:
    """Record the failure and pick the remedy: the exit code when the run ends here, None when state.attempt now
    holds the next attempt."""
    ledger, reporter, n = setup.ledger, setup.reporter, record.n
    record.status = "failed"
    reporter.event(
        "failure",
        f"[attempt {n}] failed: {failure.kind}: " + " | ".join(failure.evidence)[:600],
        attempt=n,
        **failure.to_dict(),
    )
    log = setup.run_dir / result["log"]
    if not failure.retriable:
        ledger.status = "failed"
        setup.save()
        advice = next((c.advice for c in failure_classes() if c.name == failure.kind), "")
        reporter.event(
            "error",
            f"lfa: {failure.kind} cannot be fixed by retrying; see {log}" + (f"\n{advice}" if advice else ""),
            kind=failure.kind,
        )
        return 1
    remedy = next_remedy(state.attempt, failure, setup.context, state.tried)
    if remedy is None or remedy.attempt is None:
        ledger.status = "failed"
        if remedy is not None:
            record.remedy = {"action": remedy.action, "why": remedy.why, "decided_at": time.time()}
        setup.save()
        reporter.event(
            "error",
            f"lfa: {remedy.why}" if remedy else f"lfa: no remedy left for {failure.kind}; see {log}",
            kind=failure.kind,
        )
        return 1
    state.notes.append(f"attempt {n} failed with {failure.kind}; {remedy.action}: {remedy.why}")
    record.remedy = {"action": remedy.action, "why": remedy.why, "decided_at": time.time()}
    setup.save()
    reporter.event(
        "remedy", f"[attempt {n}] remedy {remedy.action}: {remedy.why}", action=remedy.action, why=remedy.why
    )
    state.attempt = remedy.attempt
    return None


def attempt_loop(setup: RunSetup, start_process=start) -> int:
    """Attempts until one succeeds, a failure cannot be retried, or the budget is spent: the exit code. Each attempt:
    prepare_launch, record_attempt, run_and_classify, then finish_success or decide_after_failure.
    start_process(command, cwd, env, log_file) -> Popen starts the trainer (launch.start; tests pass others)."""
    request, run_dir, ledger, reporter, save = setup.request, setup.run_dir, setup.ledger, setup.reporter, setup.save
    state = LoopState(setup.attempt)
    interrupted = {"process": None, "signal": None}

    def on_signal(signum, frame):
        interrupted["signal"] = signum
        if interrupted["process"] is not None:
            stop_group(interrupted["process"])
        raise KeyboardInterrupt

    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, on_signal),
        signal.SIGTERM: signal.signal(signal.SIGTERM, on_signal),
    }
    for earlier in ledger.attempts:  # attempts of a supervisor that died (kill -9) never got a status
        earlier.status = earlier.status or "supervisor died"
    ledger.status, ledger.supervisor_pid, ledger.error, ledger.name = "running", os.getpid(), None, setup.name
    ledger.supervisor_process = process_record(os.getpid()).to_dict()
    if setup.ended_orphan:
        ledger.notes.append(setup.ended_orphan)
        reporter.event("orphan", f"lfa: {setup.ended_orphan}", note=setup.ended_orphan)
    save()
    reserve_room(run_dir)
    try:
        for _ in range(request.max_attempts):
            launch = prepare_launch(setup, state)
            if isinstance(launch, str):
                ledger.status, ledger.error = "failed", launch
                save()
                reporter.event("error", f"lfa: {launch}", kind="disk_space")
                return 1
            record = record_attempt(setup, state, launch)
            result, failure = run_and_classify(setup, launch, record, interrupted, start_process)
            state.previous_changes = launch.changes
            if failure is None:
                return finish_success(setup, state, launch, record)
            code = decide_after_failure(setup, state, record, failure, result)
            if code is not None:
                return code
        ledger.status = "failed"
        save()
        reporter.event("error", f"lfa: retry budget of {request.max_attempts} attempts spent", kind="budget")
        return 1
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        return _end_on_full_disk(setup, exc, interrupted)
    except KeyboardInterrupt:
        return _end_on_stop(setup, interrupted)
    finally:
        reporter.end_progress()
        release_reserve(setup.run_dir)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for lock in setup.locks:
            lock.close()


def _end_on_full_disk(setup: RunSetup, exc: OSError, interrupted: dict) -> int:
    """The disk filled up: the ledger says whether the training had finished; the trainer is stopped."""
    ledger, run_dir = setup.ledger, setup.run_dir
    last = ledger.last
    finished = last is not None and last.returncode == 0  # the trainer had: only lfa's records are missing
    if finished:
        message = (
            f"training finished (the model is in {setup.output_dir}), but the disk is full "
            f"({exc.filename or run_dir}): lfa's records of the run may be incomplete; free space and run "
            "lfa report to redraw them"
        )
    else:
        message = (
            f"the disk is full ({exc.filename or run_dir}): the run stops here; free space and run lfa "
            "train again, it resumes from the newest complete checkpoint"
        )
    ledger.status = "succeeded" if finished else "failed"
    release_reserve(run_dir)  # the room held at the start: enough for the ledger
    try:
        setup.save()
    except OSError:
        message += f" (the ledger in {run_dir} could not be updated either)"
    if interrupted["process"] is not None:
        stop_group(interrupted["process"], grace_s=5.0)
    setup.reporter.event("error", f"lfa: {message}", kind="disk_full")
    return 0 if finished else 1


def _end_on_stop(setup: RunSetup, interrupted: dict) -> int:
    """Ctrl-C or SIGTERM: the attempt that ran is recorded with the steps it made and its wall time."""
    ledger = setup.ledger
    ledger.status = "stopped"
    last = ledger.last
    if last is not None:
        last.status = last.status or "stopped"
        process = interrupted.get("process")  # set while an attempt runs: the signal came during it
        if process is not None and interrupted.get("drain"):
            interrupted["drain"]()
        progress = interrupted.get("result") or {}
        last.first_step = last.first_step if last.first_step is not None else progress.get("first_step")
        last.last_step = last.last_step if last.last_step is not None else progress.get("last_step")
        if last.returncode is None and process is not None:
            last.returncode = process.poll()
        last.ended_at = last.ended_at or time.time()
        started = last.started_at or progress.get("started_at")
        if last.duration_s is None and started:  # the wall time of a stopped attempt counts too
            last.started_at, last.duration_s = started, round(last.ended_at - started, 2)
    setup.save()
    setup.reporter.event("stopped", "lfa: stopped; the trainer's process group was ended", signal=interrupted["signal"])
    return 143 if interrupted["signal"] == signal.SIGTERM else 130  # 128 + the signal, as shells report it


@dataclass
class DetachedRun:
    name: str
    dir: Path
    pid: int


def start_detached(request: TrainRequest) -> DetachedRun:
    """Re-run `lfa train` without --detach in a new session: it survives logout (no nohup needed)."""
    checked = preflight(request, before_detach=True)  # what the background run would only fail on
    name, run_dir = checked.name, checked.run_dir
    args = dataclasses.replace(request, recipe=request.recipe.resolve(), run_dir=run_dir, name=name).train_argv()
    with (run_dir / "supervisor.log").open("ab") as log:
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=os.getcwd(),
        )
    (run_dir / SUPERVISOR_FILE).write_text(json.dumps(process_record(process.pid).to_dict()))
    return DetachedRun(name, run_dir, process.pid)
