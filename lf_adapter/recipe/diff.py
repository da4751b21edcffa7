"""`lfa diff A B`: what a recipe change does, keys that change training results first."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import UserError
from ..hardware import profile_from_dict
from ..strategy import Offload
from .keys import OPTIMIZER_KEYS, PLUGIN_SETTINGS, optimizer_from_keys, precision_from_keys
from .read import Recipe, deepspeed_setup, is_positive_int

# Keys whose change changes what the model learns (numerics, data, schedule); their order is the report's order.
RESULT_KEYS = [
    "model_name_or_path",
    "stage",
    "finetuning_type",
    "dataset",
    "template",
    "cutoff_len",
    "precision",
    "effective_batch_size",
    "learning_rate",
    "num_train_epochs",
    "max_steps",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_ratio",
    "warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "optim",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "seed",
    "data_seed",
    "packing",
    "neat_packing",
    "train_on_prompt",
    "mask_history",
    "pure_bf16",
    "max_samples",
    "val_size",
]
# what is trained: the optimizer and every key an optimizer sets (BAdam's, 8-bit AdamW's)
RESULT_KEYS += ["optimizer"] + sorted({k for keys in OPTIMIZER_KEYS.values() for k in keys} - set(RESULT_KEYS))
RESULT_KEYS += [setting.diff_key for setting in PLUGIN_SETTINGS if setting.changes_results]
# Keys that change speed or memory but not the result (given the same effective batch).
SPEED_KEYS = [
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "world_size",
    "deepspeed",
    "deepspeed_config",
    "disable_gradient_checkpointing",
    "enable_liger_kernel",
    "flash_attn",
    *(setting.diff_key for setting in PLUGIN_SETTINGS if not setting.changes_results),
    "lfa_alloc_conf",
    "preprocessing_num_workers",
    "dataloader_num_workers",
    "use_reentrant_gc",
    "torch_compile",
]
GROUPS = {"results": "changes training results", "speed": "changes speed or memory only", "other": "bookkeeping"}


@dataclass(frozen=True)
class DiffEntry:
    group: str  # results | speed | other
    key: str
    old: object
    new: object

    def to_dict(self) -> dict:
        return asdict(self)


def semantic_view(recipe: Recipe) -> dict:
    """The recipe's keys plus derived values a reviewer cares about: precision, effective batch, DeepSpeed stage."""
    data = dict(recipe.data)
    world = profile_from_dict(recipe.meta["hardware"], str(recipe.path)).world_size if "hardware" in recipe.meta else 1
    data["precision"] = precision_from_keys(data)
    data["optimizer"] = str(optimizer_from_keys(data))
    warmup = data.get("warmup_steps")
    if "warmup_ratio" not in data and isinstance(warmup, float) and 0 < warmup < 1:  # transformers 5's ratio
        data["warmup_ratio"] = data.pop("warmup_steps")
    data.pop("bf16", None), data.pop("fp16", None)
    data["world_size"] = world
    batch = [data.get("per_device_train_batch_size", 1), data.get("gradient_accumulation_steps", 1)]
    data["effective_batch_size"] = (
        batch[0] * batch[1] * world if all(map(is_positive_int, batch)) else "not whole numbers"
    )
    if data.get("deepspeed"):
        try:  # the base ref's JSON may be missing: the diff still shows the rest
            stage, offload = deepspeed_setup(recipe)
            data["deepspeed_config"] = stage + ("" if offload == Offload.NONE else f", offload {offload}")
        except UserError:
            data["deepspeed_config"] = "unreadable"
    if recipe.meta:
        data.update({setting.diff_key: setting.read(recipe.meta) for setting in PLUGIN_SETTINGS})
        data["lfa_alloc_conf"] = recipe.meta.get("alloc_conf")
    return data


def semantic_diff(a: dict, b: dict) -> list[DiffEntry]:
    """Differences between two semantic_view()s, grouped: results first, then speed, then bookkeeping."""
    entries = []
    for key in sorted(
        set(a) | set(b),
        key=lambda k: (
            RESULT_KEYS.index(k) if k in RESULT_KEYS else len(RESULT_KEYS),
            SPEED_KEYS.index(k) if k in SPEED_KEYS else len(SPEED_KEYS),
            k,
        ),
    ):
        if a.get(key) == b.get(key):
            continue
        group = "results" if key in RESULT_KEYS else "speed" if key in SPEED_KEYS else "other"
        entries.append(DiffEntry(group, key, a.get(key), b.get(key)))
    order = list(GROUPS)
    return sorted(entries, key=lambda e: order.index(e.group))


def format_diff(entries: list[DiffEntry], old_name: str, new_name: str, fmt: str = "text") -> str:
    if fmt == "json":
        return json.dumps(
            {"old": old_name, "new": new_name, "changes": [e.to_dict() for e in entries]}, indent=2, default=str
        )
    if not entries:
        return f"{old_name} -> {new_name}: no semantic change" + ("\n" if fmt == "text" else "")
    lines = []
    if fmt == "markdown":
        lines += [f"| | key | {Path(old_name).name} | {Path(new_name).name} |", "|---|---|---|---|"]
        lines += [f"| {GROUPS[e.group]} | `{e.key}` | `{e.old}` | `{e.new}` |" for e in entries]
        return "\n".join(lines)
    for group, title in GROUPS.items():
        rows = [e for e in entries if e.group == group]
        if rows:
            lines.append(f"{title}:")
            lines += [f"  {e.key}: {e.old!r} -> {e.new!r}" for e in rows]
    return "\n".join(lines) + "\n"
