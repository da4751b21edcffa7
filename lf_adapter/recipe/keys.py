"""The one translation between a Plan and LLaMA-Factory's recipe keys, both ways. The recipe template renders
plan_keys(), `lfa train` diffs attempts with it, and read-back (review, the supervisor, lfa diff) goes through
plan_from_keys(). The DeepSpeed JSON and the accelerate config are files beside the recipe: their names come from
here, their contents from render.py, and reading a DeepSpeed JSON back from recipe_file.deepspeed_setup(). The
launch environment a plan needs (launch_env) lives here too: launch.sh renders it, `lfa train` applies it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..hardware import HardwareProfile
from ..plan import ATTENTION_FROM_LF, Plan
from ..plugin import contract
from ..quoting import shell_export
from ..strategy import STRATEGIES, Offload, Optimizer, Sharding


def truthy(value) -> bool:
    """A recipe flag as LLaMA-Factory reads it: true, 'true', '1' or 'yes'."""
    return value is True or str(value).lower() in ("true", "1", "yes")


def warmup_key(transformers_version: str) -> str:
    """The key that carries the warmup ratio: transformers 5 reads a float warmup_steps below 1 as a ratio of the
    total steps (warmup_ratio is deprecated there and gone from 5.15); 4.x reads warmup_steps as a step count, so
    it needs warmup_ratio."""
    return "warmup_steps" if version_tuple(transformers_version) >= (5,) else "warmup_ratio"


def version_tuple(version: str) -> tuple[int, ...]:
    """A version's release numbers (major, minor, patch), for choosing which keys to write."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def deepspeed_file_name(plan: Plan) -> str | None:
    if not plan.deepspeed:
        return None
    offload = plan.offload.replace("-", "_")
    return f"ds_{plan.deepspeed}" + ("" if plan.offload == Offload.NONE else f"_offload_{offload}") + ".json"


# the LLaMA-Factory keys each optimizer sets (the paper's AdamW sets none); read back by optimizer_from_keys
OPTIMIZER_KEYS = {
    Optimizer.ADAMW: {},
    Optimizer.ADAMW_8BIT: {"optim": "adamw_bnb_8bit"},
    Optimizer.BADAM: {
        "use_badam": True,
        "badam_mode": "layer",
        "badam_switch_mode": "ascending",
        "badam_switch_interval": 50,
        "badam_verbose": 1,
    },
}


def optimizer_from_keys(data: dict) -> str:
    if truthy(data.get("use_badam", False)):
        return Optimizer.BADAM.value
    if str(data.get("optim", "")).lower() in ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit"):
        return Optimizer.ADAMW_8BIT.value
    return Optimizer.ADAMW.value


def plan_keys(plan: Plan) -> dict:
    """The LLaMA-Factory keys a plan sets (DeepSpeed as a file name, rendered separately)."""
    return {
        "per_device_train_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "bf16": plan.precision == "bf16",
        "fp16": plan.precision == "fp16",
        "disable_gradient_checkpointing": not plan.gradient_checkpointing,
        "enable_liger_kernel": plan.liger,
        "flash_attn": plan.flash_attn,
        "packing": plan.packing,
        "deepspeed": deepspeed_file_name(plan),
        **OPTIMIZER_KEYS[plan.optimizer],
    }


def precision_from_keys(data: dict) -> str:
    return "bf16" if truthy(data.get("bf16")) else "fp16" if truthy(data.get("fp16")) else "fp32"


def _header_sharding(meta: dict) -> str:
    """A strategy train.yaml has no key for (FSDP2), as the lfa-meta header records it; else no sharding."""
    for name, strategy in STRATEGIES.items():
        if strategy.header_key and meta.get(strategy.header_key) == name:
            return name
    return Sharding.NONE.value


def plan_from_keys(
    data: dict,
    meta: dict,
    hardware: HardwareProfile,
    deepspeed: tuple[str | None, str],
    micro_batch_size: int,
    grad_accum: int,
) -> Plan:
    """The plan a recipe's keys describe. deepspeed: (stage name or None, offload) read from its DeepSpeed JSON;
    FSDP2 and lfa's plugin settings (sorted steps, allocator, launcher) come from the lfa-meta header."""
    stage, offload = deepspeed
    flash_attn = str(data.get("flash_attn", "auto"))
    checkpointing = not truthy(data.get("disable_gradient_checkpointing", False))
    plugin = {setting.field: setting.read(meta) for setting in PLUGIN_SETTINGS}
    if not checkpointing:
        plugin["checkpoint_layers"] = None  # the header's, when a hand edit has turned checkpointing off since
    return Plan(
        precision=precision_from_keys(data),
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        world_size=hardware.world_size,
        nodes=hardware.nodes,
        on_cpu=not hardware.has_gpu,
        gradient_checkpointing=checkpointing,
        liger=truthy(data.get("enable_liger_kernel", False)),
        attention=ATTENTION_FROM_LF.get(flash_attn, flash_attn),
        sharding=stage or _header_sharding(meta),
        offload=offload,
        packing=truthy(data.get("packing", False)) or truthy(data.get("neat_packing", False)),
        **plugin,
        alloc_conf=meta.get("alloc_conf"),
        launcher="ray" if "ray_num_workers" in data or meta.get("launcher") == "ray" else "torchrun",
        optimizer=optimizer_from_keys(data),
    )


# NVLink multicast can wedge shared hosts; NCCL, PyTorch and NVSHMEM each need it off explicitly.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class PluginSetting:
    """A plan field lfa's plugin applies inside LLaMA-Factory, not a LLaMA-Factory key: written to the recipe's lfa-meta
    header under the field's name, read back from it, exported to the plugin as `variable`, compared by `lfa diff`
    as lfa_<field>. The one place each of these is named."""

    field: str
    variable: str
    why: str  # launch.sh's comment
    default: bool | int | None = False  # the plan's value when the header does not carry the field
    always_in_header: bool = False
    changes_results: bool = False  # `lfa diff` files it with the keys that change what is learned (numerics)

    @property
    def diff_key(self) -> str:
        return f"lfa_{self.field}"

    def header_value(self, plan: Plan) -> bool | int | None:
        value = getattr(plan, self.field)
        return value if value or self.always_in_header else None

    def env_value(self, plan: Plan) -> str | None:
        value = getattr(plan, self.field)
        return None if not value else "1" if value is True else str(value)

    def read(self, meta: dict) -> bool | int | None:
        value = meta.get(self.field)
        if not value:
            return self.default
        return bool(value) if isinstance(self.default, bool) else int(value)


PLUGIN_SETTINGS = (
    PluginSetting(
        "padding_free",
        contract.PADDING_FREE,
        "lfa plugin: each micro-batch's rows flattened into one sequence, attention kept per row (no compute on "
        "padding, exact)",
    ),
    PluginSetting(
        "token_budget",
        contract.TOKEN_BUDGET,
        "lfa plugin: each optimizer step's rows cut into micro-batches of at most this many tokens "
        "(same rows per step)",
        default=0,
    ),
    PluginSetting(
        "checkpoint_layers",
        contract.CHECKPOINT_LAYERS,
        "lfa plugin: only the first layers recompute their forward; the rest keep their activations",
        default=None,
    ),
    PluginSetting(
        "master_weights",
        contract.MASTER_WEIGHTS,
        "lfa plugin: 16-bit weights in the model, fp32 master weights and gradients in the optimizer "
        "(no per-micro-batch weight casts)",
        changes_results=True,  # the residual stream is 16-bit instead of autocast's fp32
    ),
    PluginSetting(
        "sorted_steps",
        contract.SORTED_STEPS,
        "lfa plugin: micro-batches sorted by length inside each optimizer step (same rows per step, less padding)",
        always_in_header=True,
    ),
)


@dataclass(frozen=True)
class LaunchEnv:
    """One exported variable, its value and why it is set; keep_existing: a value already in the environment wins
    (launch.sh writes ${NAME:-value})."""

    name: str
    value: str
    why: str
    keep_existing: bool = False


# experiment trackers `lfa generate --report-to` writes, and the package each needs in the training environment
REPORT_TO = {"none": None, "tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab"}


def _process_start_env(plan: Plan, master_port: int, master_addr: str | None) -> list[LaunchEnv]:
    """How the training processes start: accelerate's rendezvous (FSDP2), Ray workers, or LLaMA-Factory's torchrun
    relaunch (DeepSpeed or several processes); nothing for one plain process."""
    env: list[LaunchEnv] = []
    if plan.strategy.started_by == "accelerate":  # rendezvous only: accelerate launch starts the processes
        env += [
            LaunchEnv("NODE_RANK", "0", "this node's rank (accelerate --machine_rank)", keep_existing=True),
            LaunchEnv("MASTER_ADDR", master_addr or "127.0.0.1", "rendezvous host (node 0)", keep_existing=True),
            LaunchEnv("MASTER_PORT", str(master_port), "fixed rendezvous port", keep_existing=True),
        ]
    elif plan.launcher == "ray":
        env.append(
            LaunchEnv("USE_RAY", "1", f"LLaMA-Factory starts {plan.world_size} Ray worker(s) itself (no torchrun)")
        )
        env += [LaunchEnv(k, v, "NVLink multicast off") for k, v in MULTICAST_OFF.items()]
    elif plan.distributed:
        env += [
            LaunchEnv(
                "FORCE_TORCHRUN",
                "1",
                "LLaMA-Factory refuses DeepSpeed/multi-GPU without torchrun; this makes it relaunch itself",
            ),
            LaunchEnv("NPROC_PER_NODE", str(plan.world_size // plan.nodes), "processes on this node = GPUs per node"),
            LaunchEnv("NNODES", str(plan.nodes), "nodes in the job"),
            LaunchEnv("NODE_RANK", "0", "this node's rank", keep_existing=plan.nodes > 1),
            LaunchEnv("MASTER_ADDR", master_addr or "127.0.0.1", "rendezvous host (node 0)", keep_existing=True),
            LaunchEnv(
                "MASTER_PORT",
                str(master_port),
                "fixed port: LLaMA-Factory picks a random one otherwise, which breaks multi-node",
                keep_existing=True,
            ),
        ]
        env += [LaunchEnv(k, v, "NVLink multicast off") for k, v in MULTICAST_OFF.items()]
    return env


def launch_env(
    plan: Plan, offline: bool, master_port: int = 29500, master_addr: str | None = None, report_to=None
) -> list[LaunchEnv]:
    """Pure: the variables a plan needs. launch.sh renders them; `lfa train` applies them. report_to: the
    recipe's LLaMA-Factory `report_to` (a name or a list)."""
    env = [
        LaunchEnv(
            "DISABLE_VERSION_CHECK", "1", "lfa pins and tests the stack; LF's check rejects newer torch/transformers"
        )
    ]
    trackers = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if "wandb" in trackers:
        env.append(
            LaunchEnv(
                "WANDB_MODE",
                "offline",
                "W&B logs offline unless you set WANDB_MODE (`wandb sync` uploads later)",
                keep_existing=True,
            )
        )
    if offline:
        env.append(
            LaunchEnv("HF_HUB_OFFLINE", "1", "model and data are local: never wait on a hub that may be blocked")
        )
    env += _process_start_env(plan, master_port, master_addr)
    env.append(
        LaunchEnv(
            contract.DROP_PADDING_MASK,
            "1",
            "lfa plugin: right-padded batches train without a padding mask "
            "(exact under causal attention; SDPA keeps its flash kernel)",
        )
    )
    env.append(
        LaunchEnv(
            contract.GC_FREEZE,
            "1",
            "lfa plugin: objects alive when training starts are left out of Python's garbage collections "
            "(a full collection walks them all while the GPU waits)",
            keep_existing=True,
        )
    )
    for setting in PLUGIN_SETTINGS:
        value = setting.env_value(plan)
        if value is not None:
            env.append(LaunchEnv(setting.variable, value, setting.why))
    if plan.alloc_conf:
        if plan.distributed:  # DeepSpeed, several processes or FSDP2
            env.append(
                LaunchEnv(
                    "OPTIM_TORCH",
                    "0",
                    "otherwise LLaMA-Factory overwrites PYTORCH_CUDA_ALLOC_CONF in torchrun children",
                )
            )
        env.append(
            LaunchEnv(
                "PYTORCH_CUDA_ALLOC_CONF",
                plan.alloc_conf,
                "allocator: reuse memory across changing micro-batch shapes instead of fragmenting it",
            )
        )
    return env


def export_line(entry: LaunchEnv) -> str:
    """The entry as a bash `export` line (the value quoted: it may come from a profile or a flag)."""
    return shell_export(entry.name, entry.value, entry.keep_existing)
