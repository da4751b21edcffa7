"""Reading a generated (or hand-written) LLaMA-Factory recipe back into lfa's values."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from .. import UserError
from ..hardware import HardwareProfile, load_profile, profile_from_dict
from ..model_spec import ModelSpec, load_model_spec
from .keys import plan_from_keys
from ..plan import Plan


@dataclass
class Recipe:
    path: Path
    data: dict  # the LLaMA-Factory keys
    meta: dict  # lfa's header (empty for hand-written recipes)
    text: str

    @property
    def folder(self) -> Path:
        return self.path.parent


class LlamaFactoryLoader(yaml.SafeLoader):
    """PyYAML as LLaMA-Factory 0.9.5 reads recipes through OmegaConf: exponent floats without a dot (3e-6) are
    floats (plain PyYAML keeps them strings); yes/no/on/off are still booleans."""


LlamaFactoryLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))

YAML_11_BOOL_WORDS = {"y", "n", "yes", "no", "on", "off"}


def parse_value(raw: str):
    """A --set value: YAML, except that yes/no/on/off stay strings (save_strategy=no means the string)."""
    if not raw.strip():
        return ""
    if raw.strip().lower() in YAML_11_BOOL_WORDS:
        return raw.strip()
    return yaml.load(raw, Loader=LlamaFactoryLoader)


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"recipe {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.load(text, Loader=LlamaFactoryLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"cannot read recipe {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"recipe {path} must be a YAML mapping of LLaMA-Factory arguments")
    meta = {}
    for line in text.splitlines():
        if line.startswith("# lfa-meta: "):
            try:
                meta = json.loads(line[len("# lfa-meta: "):])
            except json.JSONDecodeError:
                raise UserError(f"{path}: the '# lfa-meta:' header is not valid JSON") from None
    return Recipe(path=path, data=data, meta=meta, text=text)


def recipe_hardware(recipe: Recipe, override: str | None = None) -> HardwareProfile:
    if override:
        return load_profile(override)
    if "hardware" in recipe.meta:
        return profile_from_dict(recipe.meta["hardware"], str(recipe.path))
    return load_profile("detect")


OFFLOAD_DEVICES = ("cpu", "nvme")  # DeepSpeed offloads to either; both leave the GPU


def deepspeed_setup(recipe: Recipe, workdir: Path | None = None) -> tuple[str | None, str]:
    """(None | zero2 | zero3, none | optimizer | all) from the recipe's DeepSpeed JSON, resolved against the
    directory LLaMA-Factory runs in (default: the recipe's folder); UserError if unreadable."""
    if not recipe.data.get("deepspeed"):
        return None, "none"
    ds_path = (workdir or recipe.folder) / str(recipe.data["deepspeed"])
    try:
        zero = json.loads(ds_path.read_text()).get("zero_optimization", {})
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{recipe.path}: deepspeed config {ds_path} cannot be read: {exc}") from None
    stage = int(zero.get("stage", 0))
    offload = "none"
    if (zero.get("offload_param") or {}).get("device") in OFFLOAD_DEVICES:
        offload = "all"
    elif (zero.get("offload_optimizer") or {}).get("device") in OFFLOAD_DEVICES:
        offload = "optimizer"
    return {1: "zero1", 2: "zero2", 3: "zero3"}.get(stage), offload


def _int_key(recipe: Recipe, key: str, default: int) -> int:
    value = recipe.data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{recipe.path}: {key}: {value!r} is not a positive integer")
    return value


def plan_from_recipe(recipe: Recipe, hardware: HardwareProfile, workdir: Path | None = None) -> Plan:
    try:
        return plan_from_keys(recipe.data, recipe.meta, hardware, deepspeed_setup(recipe, workdir),
                              _int_key(recipe, "per_device_train_batch_size", 1),
                              _int_key(recipe, "gradient_accumulation_steps", 1))
    except ValueError as exc:  # a value outside lfa's vocabularies, e.g. flash_attn: flash
        raise UserError(f"{recipe.path}: {exc}") from None


def recipe_model_spec(recipe: Recipe, workdir: Path | None = None, model: str | None = None) -> ModelSpec:
    """The shape to plan for: `model` if given, else the recipe's model_name_or_path (a local folder resolved as
    LLaMA-Factory resolves it, against the directory it runs in, which for lfa train is the recipe's folder; or a
    hub id of lfa's catalog), else the shape lfa generated the recipe for (a stage-2 recipe's model is stage 1's
    output, which does not exist before stage 1 has trained)."""
    if model:
        local = Path(model)
        return load_model_spec(model if local.is_dir() else model)
    name = str(recipe.data.get("model_name_or_path") or "")
    if not name:
        raise UserError(f"{recipe.path} has no model_name_or_path")
    local = (workdir or recipe.folder) / name
    try:
        return load_model_spec(str(local) if local.is_dir() else name)
    except UserError:
        if recipe.meta.get("model"):
            return load_model_spec(str(recipe.meta["model"]))
        raise
