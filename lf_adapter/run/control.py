"""`lfa status`, `lfa logs`, `lfa stop`: read a run directory (ledger.json, attempt logs, events.jsonl) and act on
the processes it records. The supervisor runs in its own session and the trainer in its own process group, so a
stop reaches torchrun's workers too and nothing is left holding a GPU."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from .. import UserError
from .ledger import FINAL_STATES as FINAL
from .ledger import LEDGER_NAME, SUPERVISOR_FILE, RunLedger, read_ledger, write_ledger
from .monitor import FileFollower, fold_event, json_record
from .process import ProcessRecord, is_recorded_process, record_from_dict, recorded_group_alive


def resolve_run_dir(run: str) -> Path:
    """A run directory, or a run name under ./runs."""
    for candidate in (Path(run), Path("runs") / run):
        if (candidate / LEDGER_NAME).is_file() or (candidate / SUPERVISOR_FILE).is_file():
            return candidate
    where = (
        f"{run} holds no ledger.json"
        if Path(run).is_absolute()
        else f"neither {run} nor runs/{run} holds a ledger.json"
    )
    raise UserError(f"no run '{run}': {where} (see `lfa status`)")


@dataclass
class RunStatus:
    name: str
    dir: str
    state: str  # starting | running | succeeded | failed | stopped | dead (supervisor gone, no end recorded)
    attempts: int
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    gpu_reserved_gib: float | None = None
    eta_s: float | None = None  # running runs: steps left x the recent step time
    started: str | None = None  # the first attempt's start
    failure: str | None = None
    supervisor_pid: int | None = None
    trainer_pid: int | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _last_events(run_dir: Path) -> dict:
    path = run_dir / "events.jsonl"
    if not path.is_file():
        return {}
    with path.open("rb") as fh:  # the tail is enough: a long run's events file grows with every step
        start = max(0, path.stat().st_size - 65536)
        fh.seek(start)
        lines = fh.read().decode("utf-8", errors="replace").splitlines()[1 if start else 0 :]
    state: dict = {}
    for record in filter(None, map(json_record, lines)):
        fold_event(state, record)
    step, total = state.get("step"), state.get("total")
    eta = (total - step) * state["step_time_s"] if step is not None and total and state.get("step_time_s") else None
    return {
        "step": step,
        "total_steps": total,
        "loss": state.get("loss"),
        "eta_s": eta,
        "gpu_reserved_gib": state.get("gpu_reserved_gib"),
        "tokens_per_s": round(state["tokens_per_s"]) if state.get("tokens_per_s") else None,
    }


def run_state(ledger: RunLedger) -> str:
    """The ledger's state, or "dead" when it records no end and its supervisor is gone (a pid that now belongs to
    another process counts as gone)."""
    return ledger.status if ledger.status in FINAL or is_recorded_process(supervisor_record(ledger)) else "dead"


def supervisor_record(ledger: RunLedger) -> ProcessRecord | None:
    return record_from_dict(ledger.supervisor_process)


def trainer_record(ledger: RunLedger) -> ProcessRecord | None:
    """The newest attempt's trainer (its process group leader) as recorded at launch."""
    return next((record_from_dict(a.trainer_process) for a in reversed(ledger.attempts) if a.trainer_process), None)


def run_status(run_dir: Path) -> RunStatus:
    ledger = read_ledger(run_dir)
    last = ledger.last
    state = run_state(ledger)
    status = RunStatus(
        name=ledger.name or run_dir.resolve().name,
        dir=str(run_dir),
        state=state,
        attempts=len(ledger.attempts),
        supervisor_pid=ledger.supervisor_pid,
        trainer_pid=last.trainer_pid if last else None,
        failure=((last.failure or {}).get("kind") if last else None),
        started=ledger.attempts[0].started if ledger.attempts else None,
    )
    for key, value in _last_events(run_dir).items():
        setattr(status, key, value)
    if state != "running":
        status.eta_s = None
    return status


def all_runs(root: Path = Path("runs")) -> list[Path]:
    """Runs under ./runs, and the demo's run (lfa demo keeps it under .lfa/demo/run)."""
    found = sorted(p.parent for p in root.glob("*/ledger.json")) if root.is_dir() else []
    demo = Path(".lfa/demo/run")
    return found + ([demo] if root == Path("runs") and (demo / "ledger.json").is_file() else [])


def stop_run(run_dir: Path, timeout_s: float = 60.0) -> tuple[str, bool]:
    """Graceful first (SIGINT to the supervisor, which stops the trainer's group: SIGINT, SIGTERM, SIGKILL), then
    forced (SIGKILL to both groups). Returns (what happened, whether any process of the trainer group remains)."""
    ledger = read_ledger(run_dir)
    supervisor, trainer = supervisor_record(ledger), trainer_record(ledger)

    def supervisor_alive() -> bool:
        return is_recorded_process(supervisor)

    def trainer_alive() -> bool:
        return recorded_group_alive(trainer)

    if not supervisor_alive() and not trainer_alive():
        reused = [
            f"pid {r.pid} now belongs to another process than the recorded '{(r.cmdline or '?')[:80]}'"
            for r in dict.fromkeys(r for r in (supervisor, trainer) if r is not None)
            if _pid_exists(r.pid) and not is_recorded_process(r)
        ]
        return f"not running ({ledger.status}" + "".join(f"; {why}, left alone" for why in reused) + ")", False
    how = "graceful"
    if supervisor_alive():
        os.kill(supervisor.pid, signal.SIGINT)
        deadline = time.time() + timeout_s
        while time.time() < deadline and (supervisor_alive() or trainer_alive()):
            time.sleep(0.2)
    if supervisor_alive() or trainer_alive():
        how = "forced"
        # the supervisor leads its own session (detached) or runs in the user's shell: only its pid is signalled
        for record, signal_it in ((trainer, trainer_alive), (supervisor, supervisor_alive)):
            if record is not None and signal_it():
                try:
                    (os.killpg if record is trainer else os.kill)(record.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        time.sleep(0.5)
        ledger = read_ledger(run_dir)
        ledger.status, ledger.stopped_by = "stopped", "lfa stop (forced)"
        write_ledger(run_dir, ledger)
    return f"stopped ({how})", trainer_alive()


def _pid_exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def follow_logs(run_dir: Path, follow: bool, lines: int, out, poll_s: float = 0.3) -> None:
    """Print the newest attempt's log (its last `lines` lines), then with follow keep printing, switching to the
    next attempt's log when the supervisor retries, until the run has ended."""

    def newest_log() -> Path | None:
        logs = sorted(run_dir.glob("attempt-*.log"), key=lambda p: int(p.stem.split("-")[1]))
        return logs[-1] if logs else None

    current = newest_log()
    follower = None
    if current is not None:
        text = current.read_bytes().decode("utf-8", errors="replace").replace("\r", "\n").splitlines()
        shown = text[len(text) - lines :] if lines else []  # text[-0:] would be the whole log
        out.write("\n".join(shown) + ("\n" if shown else ""))
        follower = FileFollower(current)
        follower.offset = current.stat().st_size
    while follow:
        if follower is not None:
            chunk = follower.read_new()
            if chunk:
                out.write(chunk.decode("utf-8", errors="replace"))
                out.flush()
        newest = newest_log()
        if newest is not None and newest != current:
            current, follower = newest, FileFollower(newest)
            out.write(f"\n==> {newest.name} <==\n")
            continue
        status = run_status(run_dir)
        if status.state in FINAL or status.state == "dead":
            if follower is not None:
                out.write(follower.read_new().decode("utf-8", errors="replace"))
            out.write(f"==> run {status.state} <==\n")
            return
        time.sleep(poll_s)
