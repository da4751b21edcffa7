"""One supervisor per run folder and output_dir: the locks, and the trainer a killed supervisor left behind."""

from __future__ import annotations

import os
from pathlib import Path

from .. import UserError
from ..guard import output_dir_problem, run_dir_problem
from ..recipe.read import (
    Recipe,
)
from .control import trainer_record
from .ledger import (
    LEDGER_NAME,
    read_ledger,
)
from .process import (
    recorded_group_alive,
    stop_process_group,
)
from .request import TrainRequest

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
