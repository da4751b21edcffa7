"""Stage 7: the environment and command that start `llamafactory-cli train`, and the subprocess itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..plan import Plan
from ..plugin import boot_dir
from ..recipe.keys import LaunchEnv


def resolve_env(entries: list[LaunchEnv], base: dict[str, str] | None = None) -> dict[str, str]:
    """Apply launch_env entries to a copy of the environment (as launch.sh does: keep_existing values yield to a
    non-empty value already set)."""
    env = dict(os.environ if base is None else base)
    for entry in entries:
        env[entry.name] = (env.get(entry.name) or entry.value) if entry.keep_existing else entry.value
    boot = str(boot_dir())
    env["PYTHONPATH"] = boot + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # LLaMA-Factory relaunches through `torchrun` found on PATH: the one beside this interpreter, venv or not
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def ray_node_address() -> str | None:
    """The address Ray registers this node under, or None without Ray. LLaMA-Factory 0.9.5 without a master_addr
    asks Ray's dashboard for the head's address (needs ray[default] and a running dashboard); with one, it only
    checks the address against ray.nodes(). `lfa train` runs on the head, so this node's address is the head's."""
    try:
        from ray.util import get_node_ip_address
    except ImportError:
        return None
    return get_node_ip_address()


def llamafactory_command(
    recipe: Path, overrides: list[str], plan: Plan | None = None, env: dict[str, str] | None = None
) -> list[str]:
    """`llamafactory-cli train` (which relaunches itself through torchrun when FORCE_TORCHRUN says so), or for
    FSDP2 `accelerate launch` of LLaMA-Factory's launcher.py with the recipe folder's accelerate config."""
    if plan is not None and plan.strategy.started_by == "accelerate":
        import importlib.util

        env = env or {}
        spec = importlib.util.find_spec("llamafactory.launcher")
        launcher = spec.origin if spec and spec.origin else "llamafactory/launcher.py"
        accelerate = Path(sys.executable).with_name("accelerate")
        return [
            str(accelerate) if accelerate.exists() else "accelerate",
            "launch",
            "--config_file",
            plan.strategy.config_file,
            "--num_processes",
            str(plan.world_size),
            "--num_machines",
            str(plan.nodes),
            "--machine_rank",
            env.get("NODE_RANK", "0"),
            "--main_process_ip",
            env.get("MASTER_ADDR", "127.0.0.1"),
            "--main_process_port",
            env.get("MASTER_PORT", "29500"),
            launcher,
            str(recipe.name),
            *overrides,
        ]
    cli = Path(sys.executable).with_name("llamafactory-cli")
    program = [str(cli)] if cli.exists() else ["llamafactory-cli"]
    return program + ["train", str(recipe.name)] + list(overrides)


def start(command: list[str], cwd: Path, env: dict[str, str], log_file) -> subprocess.Popen:
    """Start the trainer in its own process group (so stop/kill reaches torchrun's children too)."""
    return subprocess.Popen(
        command,
        cwd=str(cwd),
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop_group(process: subprocess.Popen, grace_s: float = 120.0) -> int:
    """Stop a trainer lfa started (stop_process_group) and reap its leader."""
    stop_process_group(process.pid, grace_s, process)
    return process.wait()


def stop_process_group(pgid: int, grace_s: float = 120.0, leader: subprocess.Popen | None = None) -> None:
    """SIGINT the whole group (lfa's plugin makes the trainer save a checkpoint at the end of the step and exit),
    then SIGTERM, then SIGKILL; each stage waits for every process of the group, not only its leader (torchrun's
    workers may outlive the llamafactory-cli that started them)."""

    def running() -> bool:
        return (leader is not None and leader.poll() is None) or group_alive(pgid)

    for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.time() + wait
        while time.time() < deadline and running():
            time.sleep(0.1)
        if not running():
            break


def alive(pid: int | None) -> bool:
    """A live, non-zombie process."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def group_alive(pgid: int | None) -> bool:
    """Does any process of this process group remain (zombies excepted)?"""
    if not pgid:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@dataclass(frozen=True)
class ProcessRecord:
    """Which process lfa started: its pid with its start time (clock ticks since boot) and command line, so that a
    pid the kernel gave to another program since is never signalled or trusted."""

    pid: int
    start: int | None
    cmdline: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def _proc_start(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


def _proc_cmdline(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", errors="replace")
    except OSError:
        return None


def process_record(pid: int) -> ProcessRecord:
    """The identity of a live process, to record at launch."""
    return ProcessRecord(pid, _proc_start(pid), _proc_cmdline(pid))


def record_from_dict(data) -> ProcessRecord | None:
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
        return None
    start, cmdline = data.get("start"), data.get("cmdline")
    return ProcessRecord(
        data["pid"], start if isinstance(start, int) else None, cmdline if isinstance(cmdline, str) else None
    )


def is_recorded_process(record: ProcessRecord | None) -> bool:
    """Is the recorded process still running, as the same process (not a later one that got its pid)? The start
    time decides: a reused pid starts later. The command line is kept for messages only: read right after the start
    it can still be the parent's (the exec may not be visible in /proc yet)."""
    if record is None or not alive(record.pid):
        return False
    if record.start is None:  # a system without /proc: the pid is all there is
        return True
    return _proc_start(record.pid) == record.start


def recorded_group_alive(record: ProcessRecord | None) -> bool:
    """Does the recorded trainer's process group remain? Its leader must be the recorded process; a group whose
    leader has exited is still that group (the kernel does not reuse a pid while its process group exists)."""
    if record is None:
        return False
    if alive(record.pid):
        return is_recorded_process(record)
    return group_alive(record.pid)
