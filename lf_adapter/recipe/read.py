"""Reading a generated (or hand-written) LLaMA-Factory recipe back into lfa's values."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from .. import UserError
from ..hardware import HardwareProfile, load_profile, profile_from_dict
from ..model_spec import ModelSpec, load_model_spec
from ..plan import Plan
from ..quoting import comment_text, has_surrogates, key_problem
from ..strategy import OFFLOADS, SHARDING_OF_STAGE, Offload
from .keys import PLUGIN_SETTINGS, plan_from_keys


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
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)

YAML_11_BOOL_WORDS = {"y", "n", "yes", "no", "on", "off"}


def parse_value(raw: str):
    """A --set value: a number, a boolean, null, or a [flow list] / {flow mapping}, as LLaMA-Factory's YAML reads
    them; anything else is the exact string given (yes/no/on/off too: save_strategy=no means the string)."""
    text = raw.strip()
    if not text or text.lower() in YAML_11_BOOL_WORDS:
        return raw if text else ""
    try:
        value = yaml.load(text, Loader=LlamaFactoryLoader)
    except yaml.YAMLError:
        return raw
    if isinstance(value, (bool, int, float)) or (value is None and text.lower() in ("null", "~")):
        return value
    if (isinstance(value, list) and text.startswith("[")) or (isinstance(value, dict) and text.startswith("{")):
        return value
    return raw


def parse_sets(items: tuple[str, ...] | list[str]) -> dict:
    """`--set KEY=VALUE` flags as {key: value}; one UserError naming every flag that is not of that form."""
    values, problems = {}, []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        problem = (
            "expected KEY=VALUE"
            if not sep
            else key_problem(key) or (f"the value of {key} is not valid UTF-8 text" if has_surrogates(raw) else None)
        )
        if problem:
            problems.append(f"--set '{comment_text(item)[:120]}': {problem}")
        else:
            values[key] = parse_value(raw)
    if problems:
        raise UserError("; ".join(problems))
    return values


class RecipeLoader(LlamaFactoryLoader):
    """Recipes as LLaMA-Factory reads them, minus YAML aliases: a recipe is a flat list of arguments, and nested
    aliases expand exponentially (a 'billion laughs' recipe grew lfa train past 6 GB)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None,
                None,
                f"YAML alias *{event.anchor}: recipes may not use anchors and aliases (write each value out)",
                event.start_mark,
            )
        return super().compose_node(parent, index)


MAX_RECIPE_BYTES = 1 << 20  # a LLaMA-Factory recipe is a few kB


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if path.is_dir():
        inside = " (it holds train.yaml: pass that)" if (path / "train.yaml").is_file() else ""
        raise UserError(f"recipe {path} is a folder, not a recipe file{inside}")
    if not path.is_file():
        raise UserError(f"recipe {path} does not exist")
    try:
        if path.stat().st_size > MAX_RECIPE_BYTES:
            raise UserError(
                f"recipe {path} is {path.stat().st_size / 2**20:.1f} MiB: not a LLaMA-Factory recipe "
                f"(at most {MAX_RECIPE_BYTES // 2**20} MiB)"
            )
        text = path.read_text(encoding="utf-8")
        data = yaml.load(text, Loader=RecipeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"cannot read recipe {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"recipe {path} must be a YAML mapping of LLaMA-Factory arguments")
    meta = {}
    for line in text.splitlines():
        if line.startswith("# lfa-meta: "):
            try:
                meta = json.loads(line[len("# lfa-meta: ") :])
            except json.JSONDecodeError:
                raise UserError(f"{path}: the '# lfa-meta:' header is not valid JSON") from None
    problems = header_problems(meta)
    if problems:
        raise UserError(f"{path}: the '# lfa-meta:' header " + "; ".join(problems))
    return Recipe(path=path, data=data, meta=meta, text=text)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# what each header key lfa reads back must hold (the header is data from a file: a hand edit or a PR may change it)
HEADER_VALUES: dict[str, tuple[str, Callable[[object], bool]]] = {
    "mean_seq_fraction": ("a number in (0, 1]", lambda v: _is_number(v) and 0.0 < v <= 1.0),
    "dataset_rows": ("a row count", _is_count),
    "effective_batch_size": ("a row count", _is_count),
    "hardware": ("a hardware profile (a JSON object)", lambda v: isinstance(v, dict)),
    "model": ("a model name", lambda v: isinstance(v, str)),
    "task": ("a task name", lambda v: isinstance(v, str)),
    "alloc_conf": ("a PYTORCH_CUDA_ALLOC_CONF string or null", lambda v: v is None or isinstance(v, str)),
    "launcher": ("torchrun or ray", lambda v: v in ("torchrun", "ray")),
    **{
        setting.field: (
            "true or false" if isinstance(setting.default, bool) else "a whole number",
            (lambda v: v is None or isinstance(v, bool))
            if isinstance(setting.default, bool)
            else (lambda v: v is None or v is False or _is_count(v)),
        )
        for setting in PLUGIN_SETTINGS
    },
}


def header_problems(meta) -> list[str]:
    """Pure: what is wrong with an lfa-meta header's values lfa reads back, one line each (empty: none)."""
    if not isinstance(meta, dict):
        return ["is not a JSON object"]
    return [
        f"{key} is {comment_text(json.dumps(meta[key]))[:60]}: expected {expected}"
        for key, (expected, valid) in HEADER_VALUES.items()
        if key in meta and not valid(meta[key])
    ]


def recipe_hardware(recipe: Recipe, override: str | None = None) -> HardwareProfile:
    if override:
        return load_profile(override)
    if "hardware" in recipe.meta:
        return profile_from_dict(recipe.meta["hardware"], str(recipe.path))
    return load_profile("detect")


def _deepspeed_json(recipe: Recipe, workdir: Path | None) -> dict:
    ds_path = (workdir or recipe.folder) / str(recipe.data["deepspeed"])
    try:
        data = json.loads(ds_path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{recipe.path}: deepspeed config {ds_path} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{recipe.path}: deepspeed config {ds_path} is not a JSON object")
    return data


def deepspeed_setup(recipe: Recipe, workdir: Path | None = None) -> tuple[str | None, str]:
    """(None | zero1 | zero2 | zero3, an Offload value) from the recipe's DeepSpeed JSON, resolved against the
    directory LLaMA-Factory runs in (default: the recipe's folder); UserError if unreadable."""
    if not recipe.data.get("deepspeed"):
        return None, "none"
    zero = _deepspeed_json(recipe, workdir).get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    param = (zero.get("offload_param") or {}).get("device")
    optimizer = (zero.get("offload_optimizer") or {}).get("device")
    device = param if param in ("cpu", "nvme") else optimizer
    kind = next(
        (
            name
            for name, k in OFFLOADS.items()
            if k.device == device and k.optimizer and k.parameters == (param in ("cpu", "nvme"))
        ),
        Offload.NONE.value,
    )
    return SHARDING_OF_STAGE.get(stage), str(kind)


def nvme_swap_folders(deepspeed_config: dict) -> list[str]:
    """The swap folders a DeepSpeed config names for NVMe offload (empty without NVMe offload)."""
    zero = deepspeed_config.get("zero_optimization") or {}
    return sorted(
        {
            str(section["nvme_path"])
            for section in (zero.get("offload_optimizer"), zero.get("offload_param"))
            if isinstance(section, dict) and section.get("device") == "nvme" and section.get("nvme_path")
        }
    )


LLAMAFACTORY_CUTOFF_LEN = 2048  # LLaMA-Factory's default cutoff_len (DataArguments)
# the recipe's counts lfa reads: each must be a whole number of at least 1, and each has LLaMA-Factory's default
COUNT_KEYS = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1, "cutoff_len": LLAMAFACTORY_CUTOFF_LEN}


def is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def count_problems(recipe: Recipe) -> list[str]:
    """Pure: each count key whose value is not a positive integer, one line each."""
    return [
        f"{key}: {comment_text(repr(recipe.data[key]))[:40]} is not a positive integer"
        for key in COUNT_KEYS
        if key in recipe.data and not is_positive_int(recipe.data[key])
    ]


def _int_key(recipe: Recipe, key: str) -> int:
    value = recipe.data.get(key, COUNT_KEYS[key])
    if not is_positive_int(value):
        raise UserError(f"{recipe.path}: {key}: {value!r} is not a positive integer")
    return value


def recipe_cutoff(recipe: Recipe) -> int:
    """The recipe's cutoff_len (LLaMA-Factory's default where it sets none); UserError if it is not a count."""
    return _int_key(recipe, "cutoff_len")


def readable_count(data: dict, key: str) -> int:
    """A count key's value, or LLaMA-Factory's default where the value is not a positive integer (a review goes on
    with it; its rule reports the value)."""
    value = data.get(key, COUNT_KEYS[key])
    return value if is_positive_int(value) else COUNT_KEYS[key]


def plan_from_recipe(recipe: Recipe, hardware: HardwareProfile, workdir: Path | None = None) -> Plan:
    try:
        return plan_from_keys(
            recipe.data,
            recipe.meta,
            hardware,
            deepspeed_setup(recipe, workdir),
            _int_key(recipe, "per_device_train_batch_size"),
            _int_key(recipe, "gradient_accumulation_steps"),
        )
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


def dataset_files(recipe: Recipe, workdir: Path | None = None) -> list[Path]:
    """The local files of the recipe's datasets, through dataset_dir/dataset_info.json (resolved against where
    LLaMA-Factory runs); the ones that cannot be found are left out."""
    return [path for path, _ in dataset_entries(recipe, workdir)]


def dataset_entries(recipe: Recipe, workdir: Path | None = None) -> list[tuple[Path, dict]]:
    """(file, its column mapping) of each local dataset file of the recipe."""
    dataset_dir = (workdir or recipe.folder) / str(recipe.data.get("dataset_dir", "data"))
    try:
        info = json.loads((dataset_dir / "dataset_info.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return []
    files = []
    for name in str(recipe.data.get("dataset", "")).split(","):
        entry = info.get(name.strip()) if isinstance(info, dict) else None
        if isinstance(entry, dict) and entry.get("file_name"):
            path = dataset_dir / str(entry["file_name"])
            if path.is_file():
                columns = entry.get("columns") if isinstance(entry.get("columns"), dict) else {}
                files.append((path, columns))
    return files


def file_fingerprint(path: Path, edge_bytes: int = 1 << 20) -> str:
    """Size and a hash of the first and last MiB: cheap on large datasets, and changes with any edit that changes
    the size, the head or the tail (row order is what a resumed run depends on)."""
    import hashlib

    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as handle:
        digest.update(handle.read(edge_bytes))
        if size > edge_bytes:
            handle.seek(max(edge_bytes, size - edge_bytes))
            digest.update(handle.read(edge_bytes))
    return f"{size}:{digest.hexdigest()[:16]}"


def launch_script(recipe: Recipe) -> str | None:
    """The launch.sh beside the recipe (lfa writes one), or None."""
    launch = recipe.folder / "launch.sh"
    return launch.read_text() if launch.is_file() else None


def recipe_workdir(recipe: Recipe, workdir: str | Path | None) -> Path:
    """Where llamafactory-cli will run, which is what LLaMA-Factory resolves relative paths against: --workdir, else
    the recipe's folder for lfa recipes (lfa train and lfa's launch.sh run there), else the current directory."""
    if workdir is not None:
        return Path(workdir)
    return recipe.folder if recipe.meta or launch_script(recipe) is not None else Path.cwd()
