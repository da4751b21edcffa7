"""Stage 10: the supervisor behind `lfa train`: attempts, ledger, resume, resolved recipe, detached runs."""

from __future__ import annotations

import datetime as dt
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import UserError
from ..data import dataset_problems
from ..guard import claim_output_dir, foreign_entries, output_dir_problem, run_dir_problem
from ..hardware import HardwareProfile, installed_versions, nearest_existing
from ..measured import OVER_PREDICTION, MeasuredPeak, card_key, now_iso, record_peak, shape_key
from ..memory import checkpoint_gib, disk_gib, disk_limit_gib
from ..model_spec import ModelSpec, load_model_spec
from ..nvml_session import gpu_used_gib
from ..plan import Plan
from ..planner import predict
from ..plugin import contract
from ..quoting import comment_text, host_problem, port_problem, run_name_problem, shell_export
from ..quoting import yaml_scalar as _scalar
from ..recipe.keys import launch_env, plan_keys
from ..recipe.read import (
    Recipe,
    dataset_entries,
    dataset_files,
    file_fingerprint,
    load_recipe,
    nvme_swap_folders,
    parse_sets,
    plan_from_recipe,
    recipe_hardware,
    recipe_model_spec,
)
from ..recipe.render import nvme_setup, render_accelerate_config, render_deepspeed, set_top_level_keys
from ..strategy import Sharding
from ..throughput import speed_basis, within_checked_sizes
from .control import trainer_record
from .ledger import (
    LEDGER_NAME,
    SUPERVISOR_FILE,
    AttemptRecord,
    RunLedger,
    read_ledger,
    release_reserve,
    reserve_room,
    write_ledger,
)
from .monitor import (
    Failure,
    FileFollower,
    LineReader,
    TrainerLogWatcher,
    cgroup_oom_kills,
    classify,
    failure_class,
    failure_classes,
    fold_event,
    host_oom_evidence,
    unexplained_kill,
)
from .process import (
    llamafactory_command,
    process_record,
    ray_node_address,
    recorded_group_alive,
    resolve_env,
    start,
    stop_group,
    stop_process_group,
)
from .progress import Reporter
from .remedies import Attempt, Context, hub_mirror_from_env, ladder_problems, next_remedy

POLL_S = 0.1


@dataclass
class TrainRequest:
    recipe: Path
    run_dir: Path | None = None
    name: str | None = None
    max_attempts: int = 4
    allow_hparam_change: bool = False
    json_events: bool = False
    overrides: tuple[str, ...] = ()
    fresh: bool = False  # start without the checkpoints already in output_dir (renamed aside)
    resume_anyway: bool = False  # resume although the recipe or its data changed since the checkpoints
    node_rank: int | None = None  # multi-node: this node's rank (one supervisor per node)
    master_addr: str | None = None  # override the profile's rendezvous host
    master_port: int | None = None
    hardware: str | None = None  # plan remedies for this profile instead of the recipe's own
    stop_on_divergence: bool = False  # stop (and retry) when the loss sits at ln(vocab) or keeps rising


def key_changes(recipe: Recipe, attempt: Attempt, base_plan_keys: dict) -> dict:
    """Keys whose value for this attempt differs from the recipe file (base_plan_keys: plan_keys of the recipe's
    own plan, computed once per run)."""
    changes = {}
    for key, value in {**plan_keys(attempt.plan), **attempt.keys}.items():
        current = recipe.data.get(key, base_plan_keys.get(key))
        if key == "deepspeed" and current is not None and base_plan_keys.get(key) == value:
            continue  # same DeepSpeed plan as the recipe: keep the recipe's own file
        if _scalar(current) != _scalar(value):
            changes[key] = value
    return changes


def write_deepspeed_config(
    folder: Path, plan: Plan, model: ModelSpec | None = None, hardware: HardwareProfile | None = None
) -> str:
    """Render lfa's DeepSpeed config for a retry; never overwrites a different file of the user's."""
    name, text = render_deepspeed(plan, nvme_setup(plan, model, hardware))
    path = folder / name
    if path.exists() and path.read_text() != text:
        path = folder / (Path(name).stem + ".lfa.json")
    path.write_text(text)
    return path.name


def write_accelerate_config(folder: Path, plan: Plan) -> None:
    """The accelerate config an FSDP2 attempt starts with (a recipe's own file of that name is kept)."""
    name, text = render_accelerate_config(plan)
    if not (folder / name).exists():
        (folder / name).write_text(text)


def is_complete_checkpoint(path: Path) -> bool:
    """Every file a resume reads is there, and what can be validated cheaply is whole: trainer_state.json and the
    safetensors index parse as JSON, the weight and optimizer files are not empty (a torn write leaves them short)."""
    weights = [
        path / name
        for name in (
            "model.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
            "pytorch_model.bin.index.json",
        )
        if (path / name).is_file()
    ]
    optimizer = [path / "optimizer.pt"] if (path / "optimizer.pt").is_file() else list(path.glob("global_step*"))
    if not (path / "trainer_state.json").is_file() or not weights or not optimizer:
        return False
    for name in ("trainer_state.json", "model.safetensors.index.json"):
        if (path / name).is_file():
            try:
                json.loads((path / name).read_text())
            except (OSError, ValueError, UnicodeDecodeError):
                return False
    return all(f.is_dir() or f.stat().st_size > 0 for f in [*weights, *optimizer])


def _checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    found = []
    for path in output_dir.glob("checkpoint-*"):
        match = re.fullmatch(r"checkpoint-(\d+)", path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return found


def attempt_peak_rss_gib(events_file: Path, attempt: int) -> float | None:
    """The largest host RSS rank 0's plugin reported during one attempt (GiB), None without events."""
    peak = None
    try:
        lines = events_file.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if (
            isinstance(event, dict)
            and event.get("attempt") == attempt
            and isinstance(event.get("host_rss_gib"), (int, float))
        ):
            peak = max(peak or 0.0, float(event["host_rss_gib"]))
    return peak


def set_aside_previous_output(output_dir: Path) -> Path | None:
    """--fresh: everything an earlier run left in output_dir (checkpoints, the final model, logs) moves into
    superseded-<time>/ there, so LLaMA-Factory sees an empty folder and nothing is deleted."""
    entries = [p for p in foreign_entries(output_dir) if not p.startswith("superseded-")]
    if not entries:
        return None
    target = output_dir / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
    target.mkdir(exist_ok=True)
    for name in entries:
        (output_dir / name).rename(target / name)
    return target


def set_aside_poisoned_checkpoints(output_dir: Path, last_finite_step: int | None) -> list[str]:
    """After a divergence: a checkpoint holds the weights after its step, which the next step's loss is the first
    to use; only checkpoints before the last step whose logged loss was finite are trusted. The others are renamed
    aside (never deleted), so neither lfa nor LLaMA-Factory's auto-resume picks them."""
    moved = []
    for step, path in _checkpoints(output_dir):
        if last_finite_step is None or step >= last_finite_step:
            aside = path.with_name(f"diverged-{path.name}-{int(time.time())}")
            path.rename(aside)
            moved.append(aside.name)
    return moved


def newest_complete_checkpoint(output_dir: Path, tidy: bool = True) -> Path | None:
    """The highest-step checkpoint that was fully written; incomplete ones are renamed aside, never deleted,
    so LLaMA-Factory's own auto-resume cannot pick them."""
    found = _checkpoints(output_dir)
    best = None
    for _step, path in sorted(found, reverse=True):
        if best is None and is_complete_checkpoint(path):
            best = path
        elif best is None and tidy:
            path.rename(path.with_name(f"incomplete-{path.name}-{int(time.time())}"))
    return best


def _hash(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read_events(events_follower: FileFollower, reader: LineReader, state: dict) -> bool:
    """Fold new plugin events into the progress state; True when something arrived."""
    changed = False
    for line in reader.feed(events_follower.read_new()):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
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
    n, command, env, cwd = launch.n, launch.command, launch.env, setup.recipe.folder
    run_dir, output_dir, reporter = setup.run_dir, setup.output_dir, setup.reporter
    vocab_size = setup.trained_model.vocab_size if setup.trained_model else None
    stop_on_divergence = setup.request.stop_on_divergence
    log_path = run_dir / f"attempt-{n}.log"
    events_path = Path(env[contract.EVENTS_FILE])
    trainer_log = output_dir / "trainer_log.jsonl"
    watcher = TrainerLogWatcher(trainer_log)
    watcher.follower.offset = trainer_log.stat().st_size if trainer_log.exists() else 0
    events = FileFollower(events_path)
    events.offset = events_path.stat().st_size if events_path.exists() else 0
    events_reader, state = LineReader(tail=20), {}
    reader = LineReader()
    probed_at = 0.0
    result = {"log": log_path.name, "first_step": None, "last_step": None, "live_stop": None}
    with log_path.open("ab") as log_file:
        log_file.write(f"$ {' '.join(command)}\n".encode())
        log_file.flush()
        started = result["started_at"] = time.time()
        process = start_process(command, cwd, env, log_file)
        interrupted.update(
            process=process, result=result, drain=lambda: _drain_steps(events, events_reader, watcher, result)
        )
        on_start(process.pid)
        follower = FileFollower(log_path)
        detected_at = None
        while True:
            done = process.poll() is not None
            new_lines = reader.feed(follower.read_new())
            if detected_at is None and new_lines:
                live = classify(new_lines, None)
                if live and failure_class(live.kind).stop_at_first_line:
                    detected_at = time.time()
                    result["live_stop"] = {"kind": live.kind, "detected_at": detected_at}
            changed = _read_events(events, events_reader, state)
            if changed and state.get("step"):  # the plugin's step event can precede trainer_log.jsonl's record
                _note_step(result, state["step"], state.get("first_step"))
            if time.time() - probed_at > 2.0:
                state["gpu_used_gib"], probed_at, changed = gpu_used_gib(), time.time(), True
            for record in watcher.poll():
                step = record.get("current_steps")
                if step is not None:
                    _note_step(result, step)
                    state.update(step=step, total=record.get("total_steps"))
                state.update({k: record[k] for k in ("loss", "lr") if k in record})
                if record.get("remaining_time"):
                    state["eta"] = record["remaining_time"]
                reporter.progress(n, state, record)
                changed = False
            if changed:
                reporter.progress(n, state, None)
            if attempt is not None and "memory_warning" not in result:
                warning = peak_above_prediction(setup, attempt, state)
                if warning:
                    result["memory_warning"] = state["memory_warning"] = warning
                    reporter.event("warning", f"[attempt {n}] lfa: {warning}", attempt=n, warning=warning)
            stall = watcher.stalled(vocab_size) if "divergence_warning" not in result else None
            if stall:
                result["divergence_warning"] = stall
                reporter.event("warning", f"[attempt {n}] lfa: {stall}", attempt=n, warning=stall)
                if stop_on_divergence and detected_at is None:
                    detected_at = time.time()
                    log_file.write(f"lfa: loss diverged: {stall}; stopping the attempt\n".encode())
                    log_file.flush()
                    result["live_stop"] = {"kind": "loss_diverged", "detected_at": detected_at}
            if watcher.diverged and detected_at is None:
                detected_at = time.time()
                log_file.write(b"lfa: non-finite loss or grad_norm in 3 consecutive logs; stopping the attempt\n")
                log_file.flush()
                result["live_stop"] = {"kind": "nan_loss", "detected_at": detected_at}
            if done:
                break
            if detected_at is not None and time.time() - detected_at > 0.5:
                stop_group(process, grace_s=0.5)
                break
            time.sleep(POLL_S)
        returncode = process.wait()
        reporter.end_progress()
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
        seq_len=int(setup.effective.data.get("cutoff_len") or 2048),
        predicted_reserved_gib=predicted,
        measured_reserved_gib=measured,
        measured_allocated_gib=state.get("gpu_allocated_gib") or measured,
        run=str(setup.run_dir),
        recorded=now_iso(),
    )
    if peak.over <= OVER_PREDICTION:
        return None
    stored = record_peak(peak)
    warning = (
        f"GPU memory peaked at {measured:.2f} GiB reserved, {100 * peak.over:.1f}% above the predicted "
        f"{predicted:.2f} GiB (the memory model's error on this model)"
    )
    return warning + (
        f"; stored in {stored}: the next lfa generate of this model on this card plans from it" if stored else ""
    )


def resolved_text(recipe: Recipe, changes: dict, notes: list[str]) -> str:
    header = ["# lfa train resolved this recipe; what changed and why:"] + [f"#   {comment_text(n)}" for n in notes]
    body = set_top_level_keys(recipe.text, changes, "  # lfa train: changed", "  # lfa train: added")
    return "\n".join(header) + "\n" + body


LOCK_NAME = ".lfa-train.lock"


def run_folders(request: TrainRequest, recipe: Recipe, name: str) -> tuple[Path, Path]:
    """The run folder (created) and output_dir (checked: lfa never writes into a folder it did not create), before
    anything else is written. recipe: as the run uses it (--set keys applied). UserError with one message
    otherwise."""
    run_dir = (request.run_dir or Path("runs") / name).resolve()
    problem = run_dir_problem(run_dir)
    if problem:
        raise UserError(problem)
    output_dir = (recipe.folder / str(recipe.data["output_dir"])).resolve()
    holder = lock_holder(run_dir, output_dir)
    if holder:  # say who runs there before saying whose folder it is
        raise UserError(
            f"{output_dir if (output_dir / LOCK_NAME).is_file() else run_dir} is in use by {holder}: one "
            "supervisor per run. Follow it with `lfa status` / `lfa logs -f`, or end it with `lfa stop`"
        )
    try:
        history = bool(read_ledger(run_dir).attempts) if (run_dir / LEDGER_NAME).is_file() else False
    except UserError:
        history = True  # a damaged ledger of this run: its output_dir is still its own
    problem = output_dir_problem(output_dir, recipe.folder, run_dir, history, shared=request.node_rank is not None)
    if problem:
        raise UserError(problem)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in [run_dir, *run_dir.parents] if p.exists() and not p.is_dir()), run_dir)
        raise UserError(
            f"cannot make the run folder {run_dir}: {blocker} is a file; move it or pass --run-dir"
        ) from None
    return run_dir, output_dir


def lock_holder(run_dir: Path, output_dir: Path) -> str | None:
    """Who holds this run's or this output_dir's lock right now (a running supervisor), or None."""
    import fcntl

    for path in (run_dir / LOCK_NAME, output_dir / LOCK_NAME):
        if not path.is_file():
            continue
        with open(path) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return handle.read().strip() or "another lfa train"
    return None


def hold_run_locks(run_dir: Path, output_dir: Path, node_rank: int | None = None) -> list:
    """One supervisor per run folder and per output_dir: an exclusive flock on each, held for the life of this
    process (the kernel drops it when the process dies, kill -9 included). A second `lfa train` of the same run
    name or recipe stops here with who holds it."""
    import fcntl

    output_dir.mkdir(parents=True, exist_ok=True)
    held = []
    # several nodes share one output_dir (one supervisor per node): each node locks its own name there
    output_lock = LOCK_NAME if node_rank is None else LOCK_NAME.replace(".lock", f"-node{node_rank}.lock")
    for path in (run_dir / LOCK_NAME, output_dir / output_lock):
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another lfa train"
            handle.close()
            for other in held:
                other.close()
            raise UserError(
                f"{path.parent} is in use by {holder}: one supervisor per run. Follow it with "
                "`lfa status` / `lfa logs -f`, or end it with `lfa stop`"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"lfa train (pid {os.getpid()}, run {run_dir})\n")
        handle.flush()
        held.append(handle)
    return held


def end_orphaned_trainer(run_dir: Path) -> str | None:
    """A trainer whose supervisor died (kill -9) keeps its process group; its plugin saves and stops within a
    step once it notices, but a new supervisor must not start a second trainer beside it: end it first."""
    if not (run_dir / LEDGER_NAME).is_file():
        return None
    try:
        trainer = trainer_record(read_ledger(run_dir))
    except UserError:
        return None
    if not recorded_group_alive(trainer):  # a pid that now belongs to another program is not ours to signal
        return None
    stop_process_group(trainer.pid)
    return f"ended the orphaned trainer (process group {trainer.pid}) of a supervisor that died, before starting again"


def disk_shortfall(output_dir: Path, model: ModelSpec | None, plan: Plan, recipe: Recipe) -> str | None:
    """Before an attempt: the output_dir's disk must hold the next checkpoint (weights + optimizer state); without
    it the save fails after the work is done. None when it does, or when the model's size is unknown."""
    if model is None or str(recipe.data.get("save_strategy", "steps")).lower() == "no":
        return None
    need = checkpoint_gib(model, plan)
    free = shutil.disk_usage(output_dir).free / 2**30
    if free >= need * 1.05:
        return None
    return (
        f"{output_dir} has {free:.2f} GiB free, but one checkpoint of {model.name} takes about {need:.2f} GiB "
        f"({'16-bit weights + fp32 master and Adam state' if plan.deepspeed else 'fp32 weights + Adam state'}); "
        "free space or point output_dir at a larger disk (save_total_limit only removes old checkpoints after a "
        "new one is written)"
    )


def swap_shortfall(folder: Path, deepspeed_file: str | None, model: ModelSpec | None, plan: Plan) -> str | None:
    """Before an NVMe offload attempt: each swap folder of the DeepSpeed config (relative to the folder the trainer
    runs in) must hold what DeepSpeed swaps there. Swap files an earlier attempt left there are rewritten, so they
    count as free. None when it fits or nothing is swapped."""
    if model is None or not plan.offloads_to_nvme or not deepspeed_file:
        return None
    try:
        config = json.loads((folder / deepspeed_file).read_text())
    except (OSError, json.JSONDecodeError):
        return None  # the trainer reports an unreadable config itself
    need = disk_gib(model, plan)
    for swap in nvme_swap_folders(config if isinstance(config, dict) else {}):
        path = folder / swap
        existing = nearest_existing(path)
        reusable = (
            sum(f.stat().st_size for f in (path / "zero_stage_3").rglob("*") if f.is_file()) / 2**30
            if (path / "zero_stage_3").is_dir()
            else 0.0
        )
        free = shutil.disk_usage(existing).free / 2**30 + reusable
        if need > disk_limit_gib(free):
            return (
                f"NVMe offload swaps {need:.0f} GiB to {swap}, but {existing} has {free:.0f} GiB free "
                f"({disk_limit_gib(free):.0f} usable); point nvme_path at a larger local disk "
                "(lfa generate --nvme-path DIR)"
            )
    return None


def training_inputs(recipe: Recipe) -> dict:
    """What a run's checkpoints come from: the recipe's keys as the run uses them (--set keys applied) and a
    fingerprint of each dataset file."""
    return {
        "recipe": json.loads(json.dumps(recipe.data, default=str)),
        "datasets": {str(path.resolve()): file_fingerprint(path) for path in dataset_files(recipe)},
    }


def refuse_bad_dataset(recipe: Recipe) -> None:
    """The dataset files LLaMA-Factory will read, checked before anything starts (file:line for each problem)."""
    problems = [p for path, columns in dataset_entries(recipe) for p in dataset_problems(path, columns)]
    if problems:
        raise UserError(
            "the dataset would fail or lose rows in LLaMA-Factory; not started:\n"
            + "\n".join(f"  {p}" for p in problems)
        )


def refuse_changed_resume(request: TrainRequest, recipe: Recipe, ledger: RunLedger, output_dir: Path) -> dict:
    """This run's training inputs; UserError when checkpoints would be resumed under a changed recipe or dataset
    without --resume-anyway (or --fresh)."""
    now = training_inputs(recipe)
    if not request.fresh and not request.resume_anyway and newest_complete_checkpoint(output_dir, tidy=False):
        changed = changed_inputs(ledger.trained_from, now)
        if changed:
            raise UserError(
                f"the recipe or its data changed since this run's checkpoints were trained ("
                f"{'; '.join(changed)}): resuming would continue the old run under the new settings. "
                "Pass --resume-anyway to resume, or --fresh to start over (old checkpoints are renamed "
                "aside)"
            )
    return now


def changed_inputs(before: dict, now: dict) -> list[str]:
    """Each change between two training_inputs records, for one message (empty: nothing changed, or nothing was
    recorded before)."""
    if not before:
        return []
    old, new = before.get("recipe", {}), now.get("recipe", {})
    changes = [
        f"{key}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}"
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]
    old_data, new_data = before.get("datasets", {}), now.get("datasets", {})
    changes += [
        f"dataset {Path(path).name} "
        + ("removed" if path not in new_data else "added" if path not in old_data else "edited")
        for path in sorted(set(old_data) | set(new_data))
        if old_data.get(path) != new_data.get(path)
    ]
    return changes


def trained_model_spec(recipe: Recipe) -> ModelSpec | None:
    """The shape of the model the recipe trains (what is written to disk); None when lfa cannot know it."""
    try:
        return recipe_model_spec(recipe)
    except UserError:
        return None


def recovery_context(
    recipe: Recipe,
    hardware: HardwareProfile,
    trained: ModelSpec | None,
    liger_available: bool,
    allow_hparam_change: bool = False,
) -> Context:
    """What remedies need to know of a run: the recipe's schedule and model, the hardware, the shape OOM recovery
    plans for (None: the plain ladder). LFA_EMULATE_MODEL names another shape to plan for: fault-injection tests
    emulate a 6.7B OOM while a tiny model trains on the CPU."""
    emulated = os.environ.get(contract.EMULATE_MODEL)
    lr = recipe.data.get("learning_rate")
    kwargs = recipe.data.get("lr_scheduler_kwargs")
    model_dir = recipe.folder / str(recipe.data.get("model_name_or_path", ""))
    return Context(
        hardware=hardware,
        allow_hparam_change=allow_hparam_change,
        learning_rate=float(lr) if lr is not None else None,
        hub_mirror=hub_mirror_from_env(),
        model_cached=model_dir.is_dir(),
        scheduler_kwargs=kwargs if isinstance(kwargs, dict) else None,
        model=load_model_spec(emulated) if emulated else trained,
        seq_len=int(recipe.data.get("cutoff_len") or 2048),
        mean_seq_fraction=float(recipe.meta.get("mean_seq_fraction", 0.75)),
        liger_available=liger_available,
        dataloader_workers=int(recipe.data["dataloader_num_workers"])
        if str(recipe.data.get("dataloader_num_workers", "")).isdigit()
        else None,
    )


def attempt_prediction(recipe: Recipe, hardware: HardwareProfile, plan: Plan, model: ModelSpec | None) -> dict:
    """What the memory and throughput models predict for an attempt's plan, kept beside what it measured."""
    if model is None:
        return {}
    seq_len = int(recipe.data.get("cutoff_len") or 2048)
    c = predict(model, plan, hardware, seq_len, float(recipe.meta.get("mean_seq_fraction", 0.75)))
    # on a CPU the speed "model" is a rough FLOP rate, and far below the sizes it was checked on a step is bound by
    # kernel launches: no prediction to hold a measurement against
    return {
        "tokens_per_s": round(c.tokens_per_s) if hardware.has_gpu and within_checked_sizes(model) else None,
        "speed_basis": speed_basis(hardware, plan),
        "reserved_gib": round(c.memory.reserved_gib, 3),
        "budget_gib": c.memory.budget_gib,
        "limit_gib": c.memory.limit_gib,
        "memory_gib": {k: round(v, 3) for k, v in c.memory.items.items()},
        "host_gib": round(c.host.total_gib, 2),
        # for the report's MFU: 6N + attention at cutoff_len per token (bench/seed_scenario.py's accounting)
        "flops_per_token": model.flops_per_token(seq_len),
        "peak_tflops": hardware.gpu.peak_tflops_16bit * plan.world_size if hardware.has_gpu else None,
    }


@dataclass
class RunSetup:
    request: TrainRequest
    recipe: Recipe
    hardware: HardwareProfile
    name: str
    run_dir: Path
    output_dir: Path
    locks: list
    ledger: RunLedger
    reporter: Reporter
    user_keys: dict
    model_dir: Path
    trained_model: ModelSpec | None
    context: Context
    effective: Recipe  # the recipe with --set keys: what the first attempt's plan is read from
    attempt: Attempt
    launch_keys: dict
    rendezvous_env: dict
    ended_orphan: str | None

    def save(self) -> None:
        write_ledger(self.run_dir, self.ledger)


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
class Preflight:
    """The checks before anything starts, on the recipe as the run uses it (--set keys applied)."""

    recipe: Recipe  # the file
    hardware: HardwareProfile  # --hardware, else the recipe's own
    user_keys: dict  # --set
    effective: Recipe  # the recipe with --set keys: what every check and the first attempt's plan read
    name: str
    run_dir: Path
    output_dir: Path
    ledger: RunLedger
    trained_from: dict


def rendezvous_flag_problems(request: TrainRequest) -> list[str]:
    """--master-addr and --master-port reach the trainers' environment: a host name or address, a port."""
    problems = []
    if request.master_addr is not None and (problem := host_problem(request.master_addr)):
        problems.append(f"--master-addr {problem}")
    if request.master_port is not None and (problem := port_problem(request.master_port)):
        problems.append(f"--master-port {problem}")
    return problems


def preflight(request: TrainRequest, before_detach: bool = False) -> Preflight:
    """Read the recipe and its --set keys, make the run folder, and refuse (UserError, one message) an output_dir
    lfa may not write into, one in use, a dataset LLaMA-Factory would fail on, or a resume under changed inputs."""
    recipe = load_recipe(request.recipe)
    user_keys = parse_sets(request.overrides)
    problems = rendezvous_flag_problems(request)
    if problems:
        raise UserError("; ".join(problems))
    hardware = recipe_hardware(recipe, request.hardware)
    # --set keys are part of the recipe this run starts from: every check, the plan and every remedy start from
    # them, and a remedy's change wins over them on the next attempt
    effective = Recipe(recipe.path, {**recipe.data, **user_keys}, recipe.meta, recipe.text)
    if "output_dir" not in effective.data:
        raise UserError(f"{recipe.path} has no output_dir")
    name = request.name or recipe.folder.resolve().name
    problem = run_name_problem(name)
    if problem:
        raise UserError(f"run name {problem}")
    run_dir, output_dir = run_folders(request, effective, name)
    try:
        ledger = read_ledger(run_dir) if (run_dir / LEDGER_NAME).is_file() else RunLedger(str(recipe.path.resolve()))
    except UserError:
        if before_detach:  # a damaged ledger is the background run's to report
            ledger = RunLedger("")
        else:
            raise
    refuse_bad_dataset(effective)  # both before anything is locked, created or renamed
    trained_from = refuse_changed_resume(request, effective, ledger, output_dir)
    return Preflight(recipe, hardware, user_keys, effective, name, run_dir, output_dir, ledger, trained_from)


def prepare(request: TrainRequest) -> RunSetup:
    """Everything before the first attempt: the recipe and its plan, the run folder and its locks, the ledger, what
    remedies need to know. Raises UserError on bad input, before anything runs."""
    problems = ladder_problems()  # a misspelled remedy would only be skipped in the middle of a failing run
    if problems:
        raise UserError("failures/classes.yaml: " + "; ".join(problems))
    checked = preflight(request)
    recipe, effective, user_keys = checked.recipe, checked.effective, checked.user_keys
    name, run_dir, output_dir, ledger = checked.name, checked.run_dir, checked.output_dir, checked.ledger
    hardware, trained_from = checked.hardware, checked.trained_from
    locks = hold_run_locks(run_dir, output_dir, request.node_rank)
    claim_output_dir(output_dir, run_dir, recipe.path)
    ended_orphan = end_orphaned_trainer(run_dir)
    if request.fresh:  # what earlier attempts wrote is moved aside, never deleted
        set_aside_previous_output(output_dir)
    ledger.trained_from = trained_from
    ledger.output_dir = str(output_dir)
    rendezvous_env = {
        name: str(value)
        for name, value in (
            ("NODE_RANK", request.node_rank),
            ("MASTER_ADDR", request.master_addr),
            ("MASTER_PORT", request.master_port),
        )
        if value is not None
    }
    if request.node_rank is not None and not 0 <= request.node_rank < hardware.nodes:
        raise UserError(f"--node-rank {request.node_rank}: the recipe's hardware has {hardware.nodes} node(s)")
    reporter = Reporter(request.json_events)
    model_dir = recipe.folder / str(effective.data.get("model_name_or_path", ""))
    trained_model = trained_model_spec(effective)
    context = recovery_context(
        effective,
        hardware,
        trained_model,
        liger_available=installed_versions().get("liger-kernel") is not None,
        allow_hparam_change=request.allow_hparam_change,
    )
    attempt = Attempt(plan_from_recipe(effective, hardware))
    launch_keys = {}
    if (
        attempt.plan.launcher == "ray"
        and "ray_run_name" not in recipe.data
        and "master_addr" not in recipe.data
        and "master_addr" not in user_keys
    ):
        address = ray_node_address()
        if address is None:
            raise UserError(
                f"{recipe.path} trains through Ray (USE_RAY=1) but ray is not installed here: pip install ray"
            )
        launch_keys["master_addr"] = address
    return RunSetup(
        request,
        recipe,
        hardware,
        name,
        run_dir,
        output_dir,
        locks,
        ledger,
        reporter,
        user_keys,
        model_dir,
        trained_model,
        context,
        effective,
        attempt,
        launch_keys,
        rendezvous_env,
        ended_orphan,
    )


@dataclass
class LoopState:
    """What carries from one attempt to the next: the plan to run, the changes the last one ran with, the notes for
    the resolved recipe, the remedies tried."""

    attempt: Attempt
    previous_changes: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tried: set[str] = field(default_factory=set)


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
    env.update(setup.rendezvous_env)
    if attempt.plan.sharding == Sharding.FSDP2:
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
        recipe_hash=_hash({**setup.recipe.data, **launch.overrides}),
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
    request, run_dir, output_dir, ledger, reporter = (
        setup.request,
        setup.run_dir,
        setup.output_dir,
        setup.ledger,
        setup.reporter,
    )
    save = setup.save
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
        last = ledger.last
        finished = last is not None and last.returncode == 0  # the trainer had: only lfa's records are missing
        if finished:
            message = (
                f"training finished (the model is in {output_dir}), but the disk is full "
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
            save()
        except OSError:
            message += f" (the ledger in {run_dir} could not be updated either)"
        if interrupted["process"] is not None:
            stop_group(interrupted["process"], grace_s=5.0)
        reporter.event("error", f"lfa: {message}", kind="disk_full")
        return 0 if finished else 1
    except KeyboardInterrupt:
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
        save()
        reporter.event("stopped", "lfa: stopped; the trainer's process group was ended", signal=interrupted["signal"])
        return 143 if interrupted["signal"] == signal.SIGTERM else 130  # 128 + the signal, as shells report it
    finally:
        reporter.end_progress()
        release_reserve(setup.run_dir)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for lock in setup.locks:
            lock.close()


@dataclass
class DetachedRun:
    name: str
    dir: Path
    pid: int


def start_detached(request: TrainRequest) -> DetachedRun:
    """Re-run `lfa train` without --detach in a new session: it survives logout (no nohup needed)."""
    checked = preflight(request, before_detach=True)  # what the background run would only fail on
    name, run_dir = checked.name, checked.run_dir
    args = [
        sys.executable,
        "-m",
        "lf_adapter.cli",
        "train",
        str(request.recipe.resolve()),
        "--run-dir",
        str(run_dir),
        "--name",
        name,
        "--max-attempts",
        str(request.max_attempts),
    ]
    args += ["--allow-hparam-change"] if request.allow_hparam_change else []
    args += ["--node-rank", str(request.node_rank)] if request.node_rank is not None else []
    args += ["--hardware", request.hardware] if request.hardware else []
    args += ["--fresh"] if request.fresh else []
    args += ["--resume-anyway"] if request.resume_anyway else []
    args += ["--stop-on-divergence"] if request.stop_on_divergence else []
    args += ["--master-addr", request.master_addr] if request.master_addr else []
    args += ["--master-port", str(request.master_port)] if request.master_port else []
    args += [x for s in request.overrides for x in ("--set", s)]
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
