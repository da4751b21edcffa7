"""`lfa review`: validate recipes with LLaMA-Factory's own argument parsing plus lfa's rules, and summarize them
for a pull request (plan, memory against the budget, tokens per step, predicted speed and wall time, and what
changed against the base branch)."""
from __future__ import annotations

import contextlib
import difflib
import importlib.metadata
import io
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from . import UserError, templates_dir
from .hardware import HardwareProfile
from .memory import estimate, host_memory
from .model_spec import ModelSpec
from .plan import Plan
from .planner import predict, speed_basis
from .strategy import CONSTRAINTS, violations
from .recipe_diff import DiffEntry, format_diff, semantic_diff, semantic_view
from .recipe_file import (LlamaFactoryLoader, Recipe, deepspeed_setup, load_recipe, plan_from_recipe, recipe_hardware,
                          recipe_model_spec)
from .tasks import TaskSpec, chat_template_files, task_files, load_task

SEVERITIES = ("error", "warning", "info")
PATH_KEYS = ("model_name_or_path", "dataset_dir", "output_dir", "deepspeed", "tokenized_path", "adapter_name_or_path")
# keys checked by lfa's own rules, with the card the recipe is meant for: the machine running the review (a CI
# runner) is not the one that trains, so LLaMA-Factory's device checks would judge the wrong machine
DEVICE_KEYS = ("bf16", "fp16", "deepspeed", "enable_liger_kernel", "flash_attn", "use_unsloth")
EXPONENT_WITHOUT_DOT = re.compile(r"^[-+]?\d+[eE][-+]?\d+$")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Finding:
    severity: str  # error | warning | info
    rule: str
    message: str
    file: str
    line: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ReviewSummary:
    """What a recipe will do on its hardware; None where lfa cannot know (no model shape, no GPU, no dataset)."""
    hardware: str
    plan: str
    precision: str
    micro_batch: int
    grad_accum: int
    gpus: int
    effective_batch: int
    deepspeed: str
    gradient_checkpointing: bool
    tokens_per_step: int
    note: str | None = None
    model: str | None = None
    memory_gib: dict[str, float] | None = None
    reserved_gib: float | None = None
    budget_gib: float | None = None
    fits: bool | None = None
    host_gib: float | None = None
    host_ram_gib: float | None = None
    predicted_tokens_per_s: int | None = None
    speed_basis: str | None = None
    dataset_rows: int | None = None
    predicted_wall_time_s: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class RecipeReview:
    path: str
    findings: list[Finding] = field(default_factory=list)
    summary: ReviewSummary | None = None
    diff: list[DiffEntry] | None = None
    base: str | None = None  # "new recipe" or the base ref

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    def to_dict(self) -> dict:
        return {"path": self.path, "findings": [f.to_dict() for f in self.findings],
                "summary": self.summary.to_dict() if self.summary else {},
                "base": self.base, "diff": None if self.diff is None else [e.to_dict() for e in self.diff]}


def _top_level_nodes(text: str) -> list[tuple[yaml.Node, yaml.Node]]:
    try:
        node = yaml.compose(text, Loader=LlamaFactoryLoader)
    except yaml.YAMLError:
        return []
    if not isinstance(node, yaml.MappingNode):
        return []
    return [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)]


def key_lines(text: str) -> dict[str, int]:
    """1-based line of every top-level key."""
    return {k.value: k.start_mark.line + 1 for k, _ in _top_level_nodes(text)}


def raw_scalars(text: str) -> dict[str, str]:
    """Top-level keys whose value is a plain (unquoted) scalar, as written."""
    return {k.value: v.value for k, v in _top_level_nodes(text) if isinstance(v, yaml.ScalarNode) and v.style is None}


def _version_matches(installed: str, spec: str) -> bool:
    """A development or pre-release build counts as its release line: 0.9.5.dev0 is LLaMA-Factory 0.9.5 (whose
    keys it already has), not 'below 0.9.5'."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(Version(installed).base_version)
    except InvalidVersion:
        return True  # an unparseable local build: do not call its keys wrong
    return release in SpecifierSet(spec)


def _installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def version_keys() -> list[dict]:
    return yaml.safe_load((templates_dir() / "review" / "version_keys.yaml").read_text())


@lru_cache(maxsize=1)
def llamafactory_fields() -> dict[str, object] | None:
    """Every key LLaMA-Factory's train parser accepts -> its type annotation (None without LLaMA-Factory)."""
    try:
        with _quiet():
            from llamafactory.hparams.parser import _TRAIN_ARGS
    except Exception:  # not installed, or broken: review falls back to lfa's rules
        return None
    import dataclasses
    import typing

    fields = {}
    for cls in _TRAIN_ARGS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            fields[f.name] = hints.get(f.name, f.type)
    return fields


@lru_cache(maxsize=1)
def llamafactory_templates() -> frozenset[str] | None:
    """LLaMA-Factory's chat templates with lfa's registered (None without LLaMA-Factory)."""
    from .plugin import hooks

    try:
        with _quiet():
            from llamafactory.data import template
    except Exception:
        return None
    hooks.register_chat_templates(template)  # skips the ones already registered
    return frozenset(template.TEMPLATES)


@contextlib.contextmanager
def _quiet():
    """LLaMA-Factory and transformers log at import and parse time; review prints findings only."""
    os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
    os.environ.setdefault("LLAMAFACTORY_VERBOSITY", "WARN")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _choices(annotation) -> list[str]:
    import enum

    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [str(member.value) for member in annotation]
    return []


def _accepts(annotation, value) -> bool:
    """Does a YAML value fit a dataclass field annotation (loosely: the scalar kinds that matter)?"""
    import enum
    import types
    import typing

    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if value is None:
        return annotation is type(None)
    if annotation is typing.Any or origin in (list, dict, tuple) or annotation in (list, dict):
        return True
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return isinstance(value, str) and value in _choices(annotation)
    return True


def _llamafactory_findings(recipe: Recipe, lines: dict[str, int]) -> list[Finding]:
    """Keys, types and the checks LLaMA-Factory's get_train_args applies, without loading a model."""
    fields = llamafactory_fields()
    path = str(recipe.path)
    if fields is None:
        return [Finding("info", "llamafactory_missing", "LLaMA-Factory is not importable here: only lfa's rules ran "
                        "(pip install 'lf-adapter[train]')", path)]
    findings = []
    written = raw_scalars(recipe.text)
    for key, value in recipe.data.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.75)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            findings.append(Finding("error", "unknown_key", f"`{key}` is not a LLaMA-Factory argument{hint}",
                                    path, lines.get(key, 1)))
        elif isinstance(value, bool) and not _accepts(fields[key], value):
            findings.append(Finding("error", "yaml_boolean", f"`{key}: {written.get(key, value)}` "
                                    f"is read as the boolean {str(value).lower()} (YAML 1.1), but {key} takes a "
                                    f"string: quote it, e.g. {key}: \"no\"", path, lines.get(key, 1)))
        elif not _accepts(fields[key], value):
            choices = _choices(fields[key])
            findings.append(Finding("error", "wrong_type", f"`{key}: {value!r}` does not fit {key}'s type "
                                    f"({getattr(fields[key], '__name__', fields[key])})" +
                                    (f": one of {', '.join(choices)}" if choices else "") +
                                    ("; transformers' eager attention is `disabled` in LLaMA-Factory"
                                     if key == "flash_attn" and value == "eager" else ""), path, lines.get(key, 1)))
    if any(f.severity == "error" for f in findings):
        return findings  # the parser would stop at the first of these
    from llamafactory.hparams.parser import get_train_args

    args = {k: v for k, v in recipe.data.items() if k not in DEVICE_KEYS}
    with tempfile.TemporaryDirectory() as scratch, _quiet():
        args["output_dir"] = os.path.join(scratch, "output")  # the output folder's state is not the recipe's
        try:
            get_train_args(args)
        except (ValueError, TypeError, ImportError, RuntimeError) as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
            key = next((k for k in recipe.data if re.search(rf"\b{re.escape(k)}\b", message)), None)
            findings.append(Finding("error", "llamafactory_check", f"LLaMA-Factory rejects it: {message}", path,
                                    lines.get(key, 1) if key else 1))
    return findings


def _launch_script(recipe: Recipe) -> str | None:
    launch = recipe.folder / "launch.sh"
    return launch.read_text() if launch.is_file() else None


def _resolve(workdir: Path, recipe: Recipe, value: str) -> tuple[Path, str]:
    """A relative path as LLaMA-Factory resolves it (against workdir), and a note when it exists only beside the
    YAML instead (LLaMA-Factory would not find it there)."""
    path = Path(value)
    if path.is_absolute():
        return path, ""
    resolved = workdir / path
    beside = recipe.folder / path
    if not resolved.exists() and beside.exists() and beside.resolve() != resolved.resolve():
        return resolved, (f" (it exists relative to the recipe, {beside}, but LLaMA-Factory resolves relative paths "
                          f"against the directory it runs in, {workdir}: run it there or pass --workdir)")
    return resolved, ""


@dataclass
class RuleContext:
    """What every lfa review rule reads; rules report through add()."""
    recipe: Recipe
    hardware: HardwareProfile
    plan: Plan
    lines: dict[str, int]
    spec: ModelSpec | None
    workdir: Path
    findings: list[Finding] = field(default_factory=list)

    @property
    def d(self) -> dict:
        return self.recipe.data

    @property
    def gpu(self):
        return self.hardware.gpu if self.hardware.has_gpu else None

    @property
    def launch(self) -> str | None:
        return _launch_script(self.recipe)

    @property
    def task(self) -> TaskSpec | None:
        name = self.recipe.meta.get("task")
        return load_task(name) if name in task_files() else None

    def add(self, severity: str, rule_id: str, message: str, key: str | None = None) -> None:
        self.findings.append(Finding(severity, rule_id, message, str(self.recipe.path),
                                     self.lines.get(key, 1) if key else 1))


@dataclass(frozen=True)
class Rule:
    name: str
    ids: tuple[str, ...]  # the finding rule ids it can report
    check: Callable[[RuleContext], None]


RULES: list[Rule] = []


def rule(*ids: str):
    """Register a review check under the rule ids it reports (`lfa review` runs them in this order)."""
    def register(check: Callable[[RuleContext], None]):
        RULES.append(Rule(check.__name__, ids, check))
        return check
    return register


@rule(*(c.rule for c in CONSTRAINTS))
def strategy_constraints(c: RuleContext) -> None:
    for constraint in violations(c.plan):  # strategy.CONSTRAINTS: combinations that fail at the first step
        c.add("error", constraint.rule, f"{constraint.why}; {constraint.fix}", constraint.key)


@rule("bf16_unsupported", "fp16_on_bf16_card")
def precision_for_the_card(c: RuleContext) -> None:
    gpu = c.gpu
    if c.plan.precision == "bf16" and gpu is not None and not gpu.bf16:
        c.add("error", "bf16_unsupported", f"bf16 on {gpu.name} (sm{gpu.compute_capability}): no native bf16; "
              "transformers' check passes through emulation, so this runs slowly or fails mid-run. Use fp16", "bf16")
    if c.plan.precision == "fp16" and gpu is not None and gpu.bf16:
        c.add("info", "fp16_on_bf16_card", f"fp16 on {gpu.name}, which has bf16 (no loss scaling, no overflow)", "fp16")


@rule("ray_without_use_ray")
def ray_needs_use_ray(c: RuleContext) -> None:
    launch = c.launch
    if c.plan.launcher == "ray" and launch is not None and not re.search(r"^export USE_RAY=\"?1\"?", launch, re.M):
        c.add("error", "ray_without_use_ray", "the recipe has Ray keys but launch.sh does not export USE_RAY=1: "
              "LLaMA-Factory would ignore them and train in one process", "ray_num_workers")


@rule("deepspeed_without_torchrun", "deepspeed_launch")
def deepspeed_needs_torchrun(c: RuleContext) -> None:
    if not c.d.get("deepspeed") or c.plan.launcher == "ray":  # Ray workers get their rank from LLaMA-Factory
        return
    launch = c.launch
    if launch is not None and not re.search(r"^export FORCE_TORCHRUN=\"?1\"?", launch, re.M):
        c.add("error", "deepspeed_without_torchrun", "DeepSpeed is set but launch.sh does not export "
              "FORCE_TORCHRUN=1: LLaMA-Factory stops with \"Please use `FORCE_TORCHRUN=1` to launch DeepSpeed "
              "training.\"", "deepspeed")
    elif launch is None:
        c.add("warning", "deepspeed_launch", "DeepSpeed needs FORCE_TORCHRUN=1 at launch (lfa train sets it; with "
              "plain llamafactory-cli export it yourself)", "deepspeed")


@rule("deepspeed_config", "zero3_min_lr", "offload_without_optimizer")
def deepspeed_config(c: RuleContext) -> None:
    d = c.d
    if not d.get("deepspeed") or c.plan.launcher == "ray":
        return
    ds_path, beside = _resolve(c.workdir, c.recipe, str(d["deepspeed"]))
    try:
        ds = json.loads(ds_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        c.add("error", "deepspeed_config", f"DeepSpeed config {d['deepspeed']} cannot be read: {exc}{beside}",
              "deepspeed")
        return
    zero = ds.get("zero_optimization", {})
    kwargs = d.get("lr_scheduler_kwargs")
    if int(zero.get("stage", 0)) == 3 and isinstance(kwargs, dict) and "min_lr" in kwargs:
        c.add("error", "zero3_min_lr", "lr_scheduler_kwargs.min_lr with ZeRO-3: transformers reads "
              "optimizer.defaults, which DeepSpeed's ZeRO-3 optimizer lacks (AttributeError at the first "
              "step, seen on the H200); write min_lr_rate = min_lr / learning_rate", "lr_scheduler_kwargs")
    if c.plan.offload != "none" and "optimizer" not in ds and ds.get("zero_force_ds_cpu_optimizer", True):
        c.add("error", "offload_without_optimizer", f"{d['deepspeed']} offloads to the CPU but names no optimizer: "
              "DeepSpeed refuses the Trainer's AdamW (\"You are using ZeRO-Offload with a client provided "
              "optimizer\"); add an \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": \"auto\", ...}} "
              "section (lfa's templates do)", "deepspeed")


@rule("effective_batch_changed")
def effective_batch_of_the_task(c: RuleContext) -> None:
    task, plan = c.task, c.plan
    if task is not None and plan.effective_batch_size != task.effective_batch_size:
        c.add("warning", "effective_batch_changed", f"effective batch {plan.effective_batch_size} = "
              f"{plan.micro_batch_size} x {plan.grad_accum} x {plan.world_size} GPU(s), but task {task.name} trains "
              f"with {task.effective_batch_size} (the paper's batch); learning rate and schedule assume it",
              "per_device_train_batch_size")


@rule("exponent_float")
def exponent_floats(c: RuleContext) -> None:
    for key, raw in raw_scalars(c.recipe.text).items():
        if EXPONENT_WITHOUT_DOT.match(raw):
            c.add("warning", "exponent_float", f"`{key}: {raw}` is a float to LLaMA-Factory 0.9.5 (OmegaConf) but a "
                  f"string to plain PyYAML (yaml.safe_load, HfArgumentParser.parse_yaml_file): write it with a dot, "
                  f"e.g. {float(raw):.1e}".replace("e-0", "e-").replace("e+0", "e+"), key)


@rule("path_with_spaces")
def paths_without_spaces(c: RuleContext) -> None:
    d = c.d
    distributed = bool(d.get("deepspeed")) or c.hardware.world_size > 1
    spaced = [k for k in PATH_KEYS if " " in str(d.get(k) or "")] + \
        (["(recipe path)"] if " " in str(c.recipe.path.resolve()) else [])
    for key in spaced:
        c.add("error" if distributed else "warning", "path_with_spaces",
              f"{key} contains a space: LLaMA-Factory's torchrun relaunch splits it" +
              ("" if distributed else " (matters once the recipe runs on several GPUs or DeepSpeed)"),
              key if key in d else None)


@rule("version_dependent_key")
def version_dependent_keys(c: RuleContext) -> None:
    for entry in version_keys():
        if entry["key"] not in c.d:
            continue
        installed = _installed(entry["package"])
        # the installed version decides: it rejects the key (error), accepts it (info: a note for other
        # installs), or is absent here (warning: the key works only on some versions)
        severity = "warning" if installed is None else \
            "info" if _version_matches(installed, entry["accepted"]) else "error"
        c.add(severity, "version_dependent_key",
              f"`{entry['key']}` exists only in {entry['package']} {entry['accepted']}"
              + (f" (installed: {installed})" if installed else "") + f"; elsewhere: {entry['instead']}",
              entry["key"])


@rule("plugin_template")
def plugin_template_launch(c: RuleContext) -> None:
    template, launch = c.d.get("template"), c.launch
    if template in chat_template_files() and (launch is None or "plugin" not in launch):
        c.add("warning", "plugin_template", f"template {template} is not in stock LLaMA-Factory: launch with "
              "`lfa train` or an lfa launch.sh, which register it in every process", "template")


@rule("dataset_info_missing", "dataset_info_invalid", "dataset_undefined", "dataset_file_missing")
def datasets_defined(c: RuleContext) -> None:
    d = c.d
    info_file, beside = _resolve(c.workdir, c.recipe, str(Path(str(d.get("dataset_dir", "data"))) / "dataset_info.json"))
    dataset_dir = info_file.parent
    for name in [s.strip() for s in str(d.get("dataset") or "").split(",") if s.strip()]:
        if not info_file.is_file():
            c.add("error", "dataset_info_missing", f"{info_file} does not exist (LLaMA-Factory: \"Cannot open "
                  f"{info_file}\"){beside}", "dataset_dir")
            return
        try:
            info = json.loads(info_file.read_text())
        except json.JSONDecodeError as exc:
            c.add("error", "dataset_info_invalid", f"{info_file} is not valid JSON: {exc}", "dataset_dir")
            return
        if name not in info:
            close = difflib.get_close_matches(name, list(info), n=1)
            c.add("error", "dataset_undefined", f"dataset {name} is not in {info_file.name}"
                  + (f"; did you mean {close[0]}?" if close else ""), "dataset")
        elif "file_name" in info[name] and not (dataset_dir / info[name]["file_name"]).exists():
            c.add("warning", "dataset_file_missing", f"{info[name]['file_name']} (dataset {name}) is not here; it "
                  "must exist on the training machine", "dataset")


@rule("model_missing", "model_from_stage")
def model_exists(c: RuleContext) -> None:
    model = str(c.d.get("model_name_or_path", ""))
    local, beside = _resolve(c.workdir, c.recipe, model)
    stage_input = c.task.model_from_task if c.task is not None else None
    if model and not HUB_ID.match(model) and not local.exists():
        if stage_input:
            c.add("warning", "model_from_stage", f"model {model} is {stage_input}'s output: train that stage first",
                  "model_name_or_path")
        else:
            c.add("error", "model_missing", f"model {model} is neither a local folder (from {c.workdir}) nor a "
                  f"hub id{beside}", "model_name_or_path")


@rule("unknown_template")
def template_known(c: RuleContext) -> None:
    template, known = c.d.get("template"), llamafactory_templates()
    if template and known is not None and template not in known:
        close = difflib.get_close_matches(str(template), sorted(known), n=1)
        c.add("error", "unknown_template", f"template {template} is neither in LLaMA-Factory nor in lfa's "
              "templates/chat" + (f"; did you mean {close[0]}?" if close else ""), "template")


@rule("memory_over_budget", "memory_headroom")
def gpu_memory(c: RuleContext) -> None:
    gpu, plan = c.gpu, c.plan
    if c.spec is None or gpu is None:
        return
    mem = estimate(c.spec, plan, int(c.d.get("cutoff_len", 2048)), gpu.vram_gib)
    if mem.reserved_gib > gpu.vram_gib:
        c.add("error", "memory_over_budget", f"predicted peak {mem.reserved_gib:.1f} GiB per GPU does not fit "
              f"{gpu.vram_gib:.1f} GiB on {c.hardware.name} ({plan.label()}): CUDA out of memory expected",
              "per_device_train_batch_size")
    elif not mem.fits:
        c.add("warning", "memory_headroom", f"predicted peak {mem.reserved_gib:.1f} GiB leaves "
              f"{mem.headroom_left:.0%} of {gpu.vram_gib:.1f} GiB free; lfa plans for {mem.headroom:.0%}",
              "per_device_train_batch_size")


@rule("host_memory_over")
def host_ram(c: RuleContext) -> None:
    if c.spec is None:
        return
    host = host_memory(c.spec, c.plan, c.hardware)
    if host.ram_gib and not host.fits:
        c.add("error" if host.total_gib > host.ram_gib else "warning", "host_memory_over",
              f"predicted host RAM {host.total_gib:.1f} GiB per node ({host.phase}: " +
              ", ".join(f"{k} {v:.1f}" for k, v in host.items.items()) +
              f") against {host.ram_gib:.0f} GiB on {c.hardware.name} ({host.limit_gib:.1f} usable): the kernel's "
              "OOM killer ends the trainer (SIGKILL, no Python error)", "deepspeed" if c.plan.offload != "none" else None)


@rule("max_samples")
def max_samples_set(c: RuleContext) -> None:
    if c.d.get("max_samples"):
        c.add("warning", "max_samples", f"max_samples: {c.d['max_samples']} trains on the first "
              f"{c.d['max_samples']} rows of the dataset only", "max_samples")


@rule("fewer_rows_than_batch", "few_steps_per_epoch")
def steps_per_epoch(c: RuleContext) -> None:
    rows, plan = _dataset_rows(c.recipe, c.workdir), c.plan
    if rows is None:
        return
    rows = min(rows, int(c.d["max_samples"])) if c.d.get("max_samples") else rows
    steps = rows // plan.effective_batch_size
    if steps < 1:
        c.add("error", "fewer_rows_than_batch", f"{rows} rows is less than one effective batch of "
              f"{plan.effective_batch_size}: not one optimizer step per epoch", "per_device_train_batch_size")
    elif steps < 10:
        c.add("warning", "few_steps_per_epoch", f"{rows} rows / effective batch {plan.effective_batch_size} = "
              f"{steps} optimizer steps per epoch: warmup and the schedule have little room",
              "per_device_train_batch_size")


def _lfa_findings(recipe: Recipe, hardware: HardwareProfile, plan: Plan, lines: dict[str, int],
                  spec: ModelSpec | None, workdir: Path | None = None) -> list[Finding]:
    context = RuleContext(recipe, hardware, plan, lines, spec, workdir or recipe.folder)
    for registered in RULES:
        registered.check(context)
    return context.findings


def _model_spec(recipe: Recipe, model: str | None, workdir: Path) -> ModelSpec | None:
    try:
        return recipe_model_spec(recipe, workdir, model)
    except UserError:
        return None


def _dataset_rows(recipe: Recipe, workdir: Path) -> int | None:
    if recipe.meta.get("dataset_rows"):
        return int(recipe.meta["dataset_rows"])
    try:
        dataset_dir = workdir / str(recipe.data.get("dataset_dir", "data"))
        info = json.loads((dataset_dir / "dataset_info.json").read_text())
        entry = info[str(recipe.data["dataset"]).split(",")[0].strip()]
        with (dataset_dir / entry["file_name"]).open(encoding="utf-8") as fh:
            return sum(1 for line in fh if line.strip())
    except (OSError, KeyError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def summarize(recipe: Recipe, hardware: HardwareProfile, plan: Plan, spec: ModelSpec | None,
              workdir: Path | None = None) -> ReviewSummary:
    d = recipe.data
    cutoff = int(d.get("cutoff_len", 2048))
    fraction = 1.0 if plan.packing else float(recipe.meta.get("mean_seq_fraction", 0.75))
    summary = ReviewSummary(
        hardware=hardware.name, plan=plan.label(), precision=plan.precision, micro_batch=plan.micro_batch_size,
        grad_accum=plan.grad_accum, gpus=plan.world_size, effective_batch=plan.effective_batch_size,
        deepspeed=f"{plan.deepspeed}" + ("" if plan.offload == "none" else f" offload {plan.offload}")
        if plan.deepspeed else "none", gradient_checkpointing=plan.gradient_checkpointing,
        tokens_per_step=round(plan.effective_batch_size * cutoff * fraction))
    if spec is None:
        summary.note = "model shape unknown (not local, not in lfa's catalog): no memory or speed estimate"
        return summary
    summary.model = f"{spec.name} ({spec.num_params / 1e9:.2f} B params)"
    predicted = predict(spec, plan, hardware, cutoff, fraction)
    if hardware.has_gpu:
        summary.memory_gib = {k: round(v, 2) for k, v in predicted.memory.items.items()}
        summary.reserved_gib = round(predicted.memory.reserved_gib, 2)
        summary.budget_gib = hardware.gpu.vram_gib
        summary.fits = predicted.memory.fits
    summary.host_gib = round(predicted.host.total_gib, 1)
    summary.host_ram_gib = predicted.host.ram_gib
    tokens_per_s = predicted.tokens_per_s
    summary.predicted_tokens_per_s = round(tokens_per_s)
    summary.speed_basis = speed_basis(hardware, plan)
    rows = _dataset_rows(recipe, workdir or recipe.folder)
    if rows:
        epochs = float(d.get("num_train_epochs", 3.0))
        total = rows * epochs * cutoff * fraction
        if d.get("max_steps") and int(d["max_steps"]) > 0:
            total = min(total, int(d["max_steps"]) * summary.tokens_per_step)
        summary.dataset_rows = rows
        summary.predicted_wall_time_s = round(total / tokens_per_s)
    return summary


def _base_view(path: Path, base_ref: str) -> tuple[dict | None, str]:
    """semantic_view of the recipe as it is at a git ref (e.g. origin/main): the 'what changed' of a PR review."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=path.parent, capture_output=True, text=True,
                             check=True).stdout.strip()
        rel = path.resolve().relative_to(Path(top).resolve()).as_posix()
        shown = subprocess.run(["git", "show", f"{base_ref}:{rel}"], cwd=top, capture_output=True, text=True)
    except (subprocess.CalledProcessError, ValueError, OSError) as exc:
        raise UserError(f"--base {base_ref}: {path} is not in a git checkout ({exc})") from None
    if shown.returncode != 0:
        return None, "new recipe"
    with tempfile.TemporaryDirectory() as scratch:  # the base's DeepSpeed JSON is read from the same ref
        base_file = Path(scratch) / path.name
        base_file.write_text(shown.stdout)
        recipe = load_recipe(base_file)
        ds = recipe.data.get("deepspeed")
        if ds:
            ds_rel = (Path(rel).parent / str(ds)).as_posix()
            ds_text = subprocess.run(["git", "show", f"{base_ref}:{ds_rel}"], cwd=top, capture_output=True, text=True)
            if ds_text.returncode == 0:
                (Path(scratch) / str(ds)).parent.mkdir(parents=True, exist_ok=True)
                (Path(scratch) / str(ds)).write_text(ds_text.stdout)
        return semantic_view(recipe), base_ref


def recipe_workdir(recipe: Recipe, workdir: str | Path | None) -> Path:
    """Where llamafactory-cli will run, which is what LLaMA-Factory resolves relative paths against: --workdir, else
    the recipe's folder for lfa recipes (lfa train and lfa's launch.sh run there), else the current directory."""
    if workdir is not None:
        return Path(workdir)
    return recipe.folder if recipe.meta or _launch_script(recipe) is not None else Path.cwd()


def review_recipe(path: str | Path, hardware: str | None = None, model: str | None = None,
                  base_ref: str | None = None, workdir: str | Path | None = None) -> RecipeReview:
    """Every rule runs on any recipe lfa can parse: a missing or unreadable file is one finding, never an abort."""
    recipe = load_recipe(path)
    lines = key_lines(recipe.text)
    hw = recipe_hardware(recipe, hardware)
    where = recipe_workdir(recipe, workdir)
    unreadable_ds = None
    try:
        plan = plan_from_recipe(recipe, hw, where)
    except UserError:  # an unreadable DeepSpeed JSON or a batch key that is no integer: each has its own finding;
        # the summary plans without what cannot be read
        unreadable_ds = bool(recipe.data.get("deepspeed"))
        readable = {k: v for k, v in recipe.data.items() if k != "deepspeed" and not (
            k in ("per_device_train_batch_size", "gradient_accumulation_steps") and
            (isinstance(v, bool) or not isinstance(v, int) or v < 1))}
        plan = plan_from_recipe(Recipe(recipe.path, readable, recipe.meta, recipe.text), hw)
        try:
            stage, offload = deepspeed_setup(recipe, where)
            plan, unreadable_ds = plan.replace(sharding=stage or "none", offload=offload), False
        except UserError:
            pass
    spec = _model_spec(recipe, model, where)
    review = RecipeReview(path=str(recipe.path))
    review.findings = _llamafactory_findings(recipe, lines) + _lfa_findings(recipe, hw, plan, lines, spec, where)
    if unreadable_ds:
        review.findings.append(Finding("info", "memory_without_deepspeed", "memory and speed below assume no "
                                       "DeepSpeed: its config could not be read", str(recipe.path),
                                       lines.get("deepspeed", 1)))
    review.findings.sort(key=lambda f: (SEVERITIES.index(f.severity), f.line))
    review.summary = summarize(recipe, hw, plan, spec, where)
    if base_ref:
        base, review.base = _base_view(recipe.path, base_ref)
        if base is not None:
            review.diff = semantic_diff(base, semantic_view(recipe))
    return review


def format_reviews(reviews: list[RecipeReview], fmt: str) -> str:
    if fmt == "json":
        return json.dumps([r.to_dict() for r in reviews], indent=2, default=str)
    if fmt == "github":
        out = []
        for r in reviews:
            for f in r.findings:
                kind = {"error": "error", "warning": "warning", "info": "notice"}[f.severity]
                out.append(f"::{kind} file={f.file},line={f.line},title=lfa {f.rule}::{f.message}")
        return "\n".join(out) + ("\n" if out else "")
    if fmt == "markdown":
        return _markdown(reviews)
    out = []
    for r in reviews:
        for f in r.findings:
            out.append(f"{f.file}:{f.line}: {f.severity}: [{f.rule}] {f.message}")
        s = r.summary
        if s is None:
            continue
        line = f"{r.path}: {s.plan} on {s.hardware}, effective batch {s.effective_batch}, " \
               f"~{s.tokens_per_step:,} tokens/step"
        if s.reserved_gib is not None:
            line += f", {s.reserved_gib:.1f} of {s.budget_gib:.1f} GiB"
        if s.host_gib is not None:
            line += f", host {s.host_gib:.0f}" + (f" of {s.host_ram_gib:.0f} GiB RAM" if s.host_ram_gib else " GiB RAM")
        if s.predicted_tokens_per_s is not None:
            line += f", ~{s.predicted_tokens_per_s:,} tok/s"
        if s.predicted_wall_time_s is not None:
            line += f", ~{_duration(s.predicted_wall_time_s)} for {s.dataset_rows:,} rows"
        out.append(line)
        if s.speed_basis is not None:
            out.append(f"  (speed: {s.speed_basis})")
        if r.diff is not None:
            out.append(format_diff(r.diff, f"{r.base}", "this change").rstrip())
        elif r.base:
            out.append(f"  ({r.base})")
    errors = sum(len(r.errors) for r in reviews)
    out.append(f"lfa review: {len(reviews)} recipe(s), {errors} error(s), "
               f"{sum(1 for r in reviews for f in r.findings if f.severity == 'warning')} warning(s)")
    return "\n".join(out) + "\n"


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _markdown(reviews: list[RecipeReview]) -> str:
    errors = sum(len(r.errors) for r in reviews)
    out = [f"## lfa review: {len(reviews)} recipe(s), " + (f"**{errors} error(s)**" if errors else "no errors"), ""]
    for r in reviews:
        s = r.summary
        out += [f"### `{r.path}`", ""]
        if r.findings:
            out += ["| | line | rule | finding |", "|---|---|---|---|"]
            icon = {"error": "❌", "warning": "⚠️", "info": "ℹ️"}
            out += [f"| {icon[f.severity]} {f.severity} | {f.line} | `{f.rule}` | {_cell(f.message)} |"
                    for f in r.findings]
        else:
            out.append("No findings.")
        if s is None:
            continue
        out += ["", "| plan | effective batch | tokens/step | memory per GPU | host RAM per node | predicted speed | wall time |",
                "|---|---|---|---|---|---|---|",
                f"| `{s.plan}` on {s.hardware} | {s.effective_batch} = {s.micro_batch} x {s.grad_accum} x "
                f"{s.gpus} | ~{s.tokens_per_step:,} | "
                + (f"{s.reserved_gib:.1f} / {s.budget_gib:.1f} GiB" if s.reserved_gib is not None else "-") + " | "
                + (f"{s.host_gib:.0f} / {s.host_ram_gib or 0:.0f} GiB" if s.host_gib is not None else "-") + " | "
                + (f"~{s.predicted_tokens_per_s:,} tok/s" if s.predicted_tokens_per_s is not None else "-") + " | "
                + (f"~{_duration(s.predicted_wall_time_s)} ({s.dataset_rows:,} rows)" if s.predicted_wall_time_s is not None else "-")
                + " |"]
        if s.speed_basis is not None:
            out += ["", f"Speed and wall time rest on: {s.speed_basis}."]
        if s.memory_gib is not None:
            out += ["", "<details><summary>memory breakdown (GiB per GPU)</summary>", ""]
            out += [f"- {v:.2f} {k}" for k, v in s.memory_gib.items()] + ["", "</details>"]
        if r.diff is not None:
            out += ["", f"**Changes against `{r.base}`**" + (" (none)" if not r.diff else ""), ""]
            if r.diff:
                out.append(format_diff(r.diff, r.base or "base", r.path, "markdown"))
        elif r.base:
            out += ["", f"_{r.base}_"]
        out.append("")
    return "\n".join(out)
