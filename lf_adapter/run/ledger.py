"""The run ledger (`runs/<name>/ledger.json`) as typed records: one reader, one atomic writer. The supervisor
writes it, `lfa status/stop/report` and `lfa train`'s next run read it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

from .. import UserError
from ..guard import LEDGER_NAME, SUPERVISOR_FILE  # noqa: F401 (the ledger's file names, re-exported)

RunState = Literal["new", "starting", "running", "succeeded", "failed", "stopped"]
AttemptState = Literal["succeeded", "failed", "stopped", "supervisor died"]
FINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "stopped"})


@dataclass
class AttemptRecord:
    n: int
    started: str  # ISO time, for people
    plan: str  # Plan.label()
    overrides: dict = field(default_factory=dict)  # keys passed to llamafactory-cli on top of the recipe
    env: dict = field(default_factory=dict)
    recipe_hash: str = ""
    diff_from_previous: dict = field(default_factory=dict)
    resumed_from: str | None = None
    predicted: dict = field(default_factory=dict)  # tokens_per_s, reserved_gib, budget_gib, memory_gib of the plan
    trainer_pid: int | None = None
    trainer_process: dict | None = None  # ProcessRecord of the trainer's group leader: pid, start time, command line
    status: AttemptState | None = None  # None while it runs
    log: str | None = None
    first_step: int | None = None
    last_step: int | None = None
    live_stop: dict | None = None
    returncode: int | None = None
    duration_s: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    last_finite_step: int | None = None
    first_nonfinite_step: int | None = None
    divergence_warning: str | None = None
    memory_warning: str | None = None  # the measured peak was more than 3% above the prediction
    diverged_checkpoints_set_aside: list[str] = field(default_factory=list)
    failure: dict | None = None  # Failure.to_dict()
    remedy: dict | None = None  # action, why, decided_at


@dataclass
class RunLedger:
    recipe: str
    name: str = ""  # the run's name (lfa train --name; default the recipe folder's)
    attempts: list[AttemptRecord] = field(default_factory=list)
    status: RunState = "new"
    supervisor_pid: int | None = None
    supervisor_process: dict | None = None  # ProcessRecord: pid, start time, command line
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    resolved_recipe: str | None = None
    stopped_by: str | None = None
    # what the checkpoints were trained from: the recipe file's keys and each dataset file's fingerprint
    trained_from: dict = field(default_factory=dict)
    output_dir: str | None = None  # where the run writes, as it uses it (--set output_dir included)

    @property
    def last(self) -> AttemptRecord | None:
        return self.attempts[-1] if self.attempts else None

    def to_dict(self) -> dict:
        return asdict(self)


def _known(cls, data: dict) -> dict:
    """Keys this version knows; older and newer ledgers stay readable."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def ledger_from_dict(data: dict) -> RunLedger:
    if not isinstance(data, dict) or not isinstance(data.get("attempts", []), list):
        raise ValueError("not a ledger (expected an object with a list of attempts)")
    attempts = []
    for item in data.get("attempts", []):
        if not isinstance(item, dict):
            raise ValueError(f"attempt record {item!r} is not an object")
        item = _known(AttemptRecord, item)
        item.setdefault("started", "")
        item.setdefault("plan", "")
        attempts.append(AttemptRecord(**item))
    rest = _known(RunLedger, data)
    rest.pop("attempts", None)
    rest.setdefault("recipe", "")
    rest["notes"] = list(rest.get("notes") or [])
    return RunLedger(attempts=attempts, **rest)


def read_ledger(run_dir: Path) -> RunLedger:
    """The run's ledger; a detached run a moment after its start has only supervisor.pid (its ProcessRecord)."""
    path, pid_file = run_dir / LEDGER_NAME, run_dir / SUPERVISOR_FILE
    if not path.is_file() and pid_file.is_file():
        try:
            record = json.loads(pid_file.read_text())
        except (OSError, ValueError):
            record = None
        record = record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None
        return RunLedger(
            recipe="", status="starting", supervisor_pid=record and record["pid"], supervisor_process=record
        )
    try:
        return ledger_from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise UserError(f"cannot read {path}: {exc}") from None


RESERVE_NAME = ".lfa-ledger-reserve"
RESERVE_BYTES = 256 * 1024  # far more than a ledger of many attempts


def reserve_room(run_dir: Path) -> None:
    """Hold some of the run folder's disk so that the ledger can still be written when it fills."""
    try:
        (run_dir / RESERVE_NAME).write_bytes(b"\0" * RESERVE_BYTES)
    except OSError:
        release_reserve(run_dir)


def release_reserve(run_dir: Path) -> None:
    try:
        (run_dir / RESERVE_NAME).unlink()
    except OSError:
        pass


def write_ledger(run_dir: Path, ledger: RunLedger) -> None:
    """Atomic: readers (lfa status, a second terminal) see the old or the new ledger, never half of one."""
    path = run_dir / LEDGER_NAME
    tmp = path.with_name(f".{LEDGER_NAME}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(ledger.to_dict(), indent=2, default=str))
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk: no half-written file left behind; the old ledger stays
        raise
