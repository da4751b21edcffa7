"""The one translation between a Plan and LLaMA-Factory's recipe keys, both ways. The recipe template renders
plan_keys(), `lfa train` diffs attempts with it, and read-back (review, the supervisor, lfa diff) goes through
plan_from_keys(). The DeepSpeed JSON and the accelerate config are files beside the recipe: their names come from
here, their contents from render.py, and reading a DeepSpeed JSON back from recipe_file.deepspeed_setup()."""
from __future__ import annotations

from ..hardware import HardwareProfile
from ..plan import ATTENTION_FROM_LF, Plan
from ..strategy import Optimizer


def truthy(value) -> bool:
    """A recipe flag as LLaMA-Factory reads it: true, 'true', '1' or 'yes'."""
    return value is True or str(value).lower() in ("true", "1", "yes")


def deepspeed_file_name(plan: Plan) -> str | None:
    if not plan.deepspeed:
        return None
    offload = plan.offload.replace("-", "_")
    return f"ds_{plan.deepspeed}" + ("" if plan.offload == "none" else f"_offload_{offload}") + ".json"


# the LLaMA-Factory keys each optimizer sets (the paper's AdamW sets none); read back by optimizer_from_keys
OPTIMIZER_KEYS = {
    Optimizer.ADAMW: {},
    Optimizer.ADAMW_8BIT: {"optim": "adamw_bnb_8bit"},
    Optimizer.BADAM: {"use_badam": True, "badam_mode": "layer", "badam_switch_mode": "ascending",
                      "badam_switch_interval": 50, "badam_verbose": 1},
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


def plan_from_keys(data: dict, meta: dict, hardware: HardwareProfile, deepspeed: tuple[str | None, str],
                   micro_batch_size: int, grad_accum: int) -> Plan:
    """The plan a recipe's keys describe. deepspeed: (stage name or None, offload) read from its DeepSpeed JSON;
    FSDP2 and lfa's plugin settings (sorted steps, allocator, launcher) come from the lfa-meta header."""
    stage, offload = deepspeed
    flash_attn = str(data.get("flash_attn", "auto"))
    return Plan(
        precision=precision_from_keys(data), micro_batch_size=micro_batch_size, grad_accum=grad_accum,
        world_size=hardware.world_size, nodes=hardware.nodes, on_cpu=not hardware.has_gpu,
        gradient_checkpointing=not truthy(data.get("disable_gradient_checkpointing", False)),
        liger=truthy(data.get("enable_liger_kernel", False)),
        attention=ATTENTION_FROM_LF.get(flash_attn, flash_attn),
        sharding=stage or ("fsdp2" if meta.get("sharding") == "fsdp2" else "none"), offload=offload,
        packing=truthy(data.get("packing", False)) or truthy(data.get("neat_packing", False)),
        padding_free=bool(meta.get("padding_free", False)),
        sorted_steps=bool(meta.get("sorted_steps", False)), alloc_conf=meta.get("alloc_conf"),
        launcher="ray" if "ray_num_workers" in data or meta.get("launcher") == "ray" else "torchrun",
        optimizer=optimizer_from_keys(data),
    )
