"""Stage 7: the environment and command that start `llamafactory-cli train`, and the subprocess itself."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..plan import Plan
from ..plugin import boot_dir

ACCELERATE_FSDP2_FILE = "accelerate_fsdp2.yaml"  # beside the recipe; FSDP2 plans start with it

# NVLink multicast can wedge shared hosts; NCCL, PyTorch and NVSHMEM each need it off explicitly.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class LaunchEnv:
    """One exported variable, its value (shell syntax allowed in launch.sh) and why it is set."""
    name: str
    value: str
    why: str


# experiment trackers `lfa generate --report-to` writes, and the package each needs in the training environment
REPORT_TO = {"none": None, "tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab"}


def launch_env(plan: Plan, offline: bool, master_port: int = 29500, master_addr: str | None = None,
               report_to=None) -> list[LaunchEnv]:
    """Pure: the variables a plan needs. launch.sh renders them; `lfa train` applies them. report_to: the
    recipe's LLaMA-Factory `report_to` (a name or a list)."""
    env = [LaunchEnv("DISABLE_VERSION_CHECK", "1", "lfa pins and tests the stack; LF's check rejects newer torch/transformers")]
    trackers = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if "wandb" in trackers:
        env.append(LaunchEnv("WANDB_MODE", "${WANDB_MODE:-offline}", "W&B logs offline unless you set WANDB_MODE "
                                                                     "(`wandb sync` uploads later)"))
    if offline:
        env.append(LaunchEnv("HF_HUB_OFFLINE", "1", "model and data are local: never wait on a hub that may be blocked"))
    distributed = plan.deepspeed is not None or plan.world_size > 1
    if plan.sharding == "fsdp2":  # accelerate launch starts the processes: rendezvous only, no torchrun relaunch
        env += [LaunchEnv("NODE_RANK", "${NODE_RANK:-0}", "this node's rank (accelerate --machine_rank)"),
                LaunchEnv("MASTER_ADDR", f"${{MASTER_ADDR:-{master_addr or '127.0.0.1'}}}", "rendezvous host (node 0)"),
                LaunchEnv("MASTER_PORT", f"${{MASTER_PORT:-{master_port}}}", "fixed rendezvous port")]
    elif plan.launcher == "ray":
        env.append(LaunchEnv("USE_RAY", "1", f"LLaMA-Factory starts {plan.world_size} Ray worker(s) itself (no torchrun)"))
        env += [LaunchEnv(k, v, "NVLink multicast off") for k, v in MULTICAST_OFF.items()]
    elif distributed:
        env += [
            LaunchEnv("FORCE_TORCHRUN", "1", "LLaMA-Factory refuses DeepSpeed/multi-GPU without torchrun; this makes it relaunch itself"),
            LaunchEnv("NPROC_PER_NODE", str(plan.world_size // plan.nodes), "processes on this node = GPUs per node"),
            LaunchEnv("NNODES", str(plan.nodes), "nodes in the job"),
            LaunchEnv("NODE_RANK", "${NODE_RANK:-0}" if plan.nodes > 1 else "0", "this node's rank"),
            LaunchEnv("MASTER_ADDR", f"${{MASTER_ADDR:-{master_addr or '127.0.0.1'}}}", "rendezvous host (node 0)"),
            LaunchEnv("MASTER_PORT", f"${{MASTER_PORT:-{master_port}}}", "fixed port: LLaMA-Factory picks a random one otherwise, which breaks multi-node"),
        ]
        env += [LaunchEnv(k, v, "NVLink multicast off") for k, v in MULTICAST_OFF.items()]
    env.append(LaunchEnv("LFA_DROP_PADDING_MASK", "1", "lfa plugin: right-padded batches train without a padding mask "
                                                        "(exact under causal attention; SDPA keeps its flash kernel)"))
    if plan.padding_free:
        env.append(LaunchEnv("LFA_PADDING_FREE", "1", "lfa plugin: each micro-batch's rows flattened into one sequence, "
                                                       "attention kept per row (no compute on padding, exact)"))
    if plan.sorted_steps:
        env.append(LaunchEnv("LFA_SORTED_STEPS", "1", "lfa plugin: micro-batches sorted by length inside each optimizer "
                                                       "step (same rows per step, less padding)"))
    if plan.alloc_conf:
        if distributed:
            env.append(LaunchEnv("OPTIM_TORCH", "0", "otherwise LLaMA-Factory overwrites PYTORCH_CUDA_ALLOC_CONF in torchrun children"))
        env.append(LaunchEnv("PYTORCH_CUDA_ALLOC_CONF", plan.alloc_conf, "allocator: reuse memory across changing "
                                                                         "micro-batch shapes instead of fragmenting it"))
    return env


def resolve_env(entries: list[LaunchEnv], base: dict[str, str] | None = None) -> dict[str, str]:
    """Apply launch_env entries to a copy of the environment, expanding the ${X:-default} forms."""
    env = dict(os.environ if base is None else base)
    for entry in entries:
        value = entry.value
        if value.startswith("${") and ":-" in value:
            name, default = value[2:-1].split(":-", 1)
            value = env.get(name, default)
        env[entry.name] = value
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


def llamafactory_command(recipe: Path, overrides: list[str], plan: Plan | None = None,
                         env: dict[str, str] | None = None) -> list[str]:
    """`llamafactory-cli train` (which relaunches itself through torchrun when FORCE_TORCHRUN says so), or for
    FSDP2 `accelerate launch` of LLaMA-Factory's launcher.py with the recipe folder's accelerate config."""
    if plan is not None and plan.sharding == "fsdp2":
        import importlib.util

        env = env or {}
        spec = importlib.util.find_spec("llamafactory.launcher")
        launcher = spec.origin if spec and spec.origin else "llamafactory/launcher.py"
        accelerate = Path(sys.executable).with_name("accelerate")
        return [str(accelerate) if accelerate.exists() else "accelerate", "launch",
                "--config_file", ACCELERATE_FSDP2_FILE, "--num_processes", str(plan.world_size),
                "--num_machines", str(plan.nodes), "--machine_rank", env.get("NODE_RANK", "0"),
                "--main_process_ip", env.get("MASTER_ADDR", "127.0.0.1"),
                "--main_process_port", env.get("MASTER_PORT", "29500"), launcher, str(recipe.name), *overrides]
    cli = Path(sys.executable).with_name("llamafactory-cli")
    program = [str(cli)] if cli.exists() else ["llamafactory-cli"]
    return program + ["train", str(recipe.name)] + list(overrides)


def start(command: list[str], cwd: Path, env: dict[str, str], log_file) -> subprocess.Popen:
    """Start the trainer in its own process group (so stop/kill reaches torchrun's children too)."""
    return subprocess.Popen(command, cwd=str(cwd), env=env, stdout=log_file, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


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
