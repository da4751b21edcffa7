"""The recipe as an attempt runs it: the resolved recipe, its DeepSpeed and accelerate configs, what a remedy
changed."""

from __future__ import annotations

from pathlib import Path

from ..hardware import HardwareProfile
from ..model_spec import ModelSpec
from ..plan import Plan
from ..quoting import comment_text
from ..quoting import yaml_scalar as _scalar
from ..recipe.keys import plan_keys
from ..recipe.read import (
    Recipe,
)
from ..recipe.render import nvme_setup, render_accelerate_config, render_deepspeed, set_top_level_keys
from .remedies import Attempt


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


def resolved_text(recipe: Recipe, changes: dict, notes: list[str]) -> str:
    header = ["# lfa train resolved this recipe; what changed and why:"] + [f"#   {comment_text(n)}" for n in notes]
    body = set_top_level_keys(recipe.text, changes, "  # lfa train: changed", "  # lfa train: added")
    return "\n".join(header) + "\n" + body
