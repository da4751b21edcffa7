"""lfa's review rules: a registry of small named checks over one RuleContext (`lfa review` runs them in order)."""

from __future__ import annotations

import difflib
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..guard import forbidden_output_dir, foreign_entries, read_marker
from ..hardware import HardwareProfile
from ..measured import generate_headroom
from ..memory import disk_gib, disk_limit_gib, estimate, host_memory
from ..model_spec import ModelSpec
from ..plan import Plan
from ..recipe.read import COUNT_KEYS, Recipe, launch_script, nvme_swap_folders, readable_count
from ..strategy import CONSTRAINTS, Offload, violations
from ..tasks import TaskSpec, chat_template_files, load_task, task_files
from .findings import Finding, raw_scalars
from .lf_checks import installed_version, llamafactory_templates, version_keys, version_matches
from .summary import count_dataset_rows

PATH_KEYS = ("model_name_or_path", "dataset_dir", "output_dir", "deepspeed", "tokenized_path", "adapter_name_or_path")
EXPONENT_WITHOUT_DOT = re.compile(r"^[-+]?\d+[eE][-+]?\d+$")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _resolve(workdir: Path, recipe: Recipe, value: str) -> tuple[Path, str]:
    """A relative path as LLaMA-Factory resolves it (against workdir), and a note when it exists only beside the
    YAML instead (LLaMA-Factory would not find it there)."""
    path = Path(value)
    if path.is_absolute():
        return path, ""
    resolved = workdir / path
    beside = recipe.folder / path
    if not resolved.exists() and beside.exists() and beside.resolve() != resolved.resolve():
        return resolved, (
            f" (it exists relative to the recipe, {beside}, but LLaMA-Factory resolves relative paths "
            f"against the directory it runs in, {workdir}: run it there or pass --workdir)"
        )
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
        return launch_script(self.recipe)

    @property
    def task(self) -> TaskSpec | None:
        name = self.recipe.meta.get("task")
        return load_task(name) if name in task_files() else None

    def add(self, severity: str, rule_id: str, message: str, key: str | None = None) -> None:
        self.findings.append(
            Finding(severity, rule_id, message, str(self.recipe.path), self.lines.get(key, 1) if key else 1)
        )


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
        c.add(
            "error",
            "bf16_unsupported",
            f"bf16 on {gpu.name} (sm{gpu.compute_capability}): no native bf16; "
            "transformers' check passes through emulation, so this runs slowly or fails mid-run. Use fp16",
            "bf16",
        )
    if c.plan.precision == "fp16" and gpu is not None and gpu.bf16:
        c.add("info", "fp16_on_bf16_card", f"fp16 on {gpu.name}, which has bf16 (no loss scaling, no overflow)", "fp16")


@rule("ray_without_use_ray")
def ray_needs_use_ray(c: RuleContext) -> None:
    launch = c.launch
    if c.plan.launcher == "ray" and launch is not None and not re.search(r"^export USE_RAY=\"?1\"?", launch, re.M):
        c.add(
            "error",
            "ray_without_use_ray",
            "the recipe has Ray keys but launch.sh does not export USE_RAY=1: "
            "LLaMA-Factory would ignore them and train in one process",
            "ray_num_workers",
        )


@rule("deepspeed_without_torchrun", "deepspeed_launch")
def deepspeed_needs_torchrun(c: RuleContext) -> None:
    if not c.d.get("deepspeed") or c.plan.launcher == "ray":  # Ray workers get their rank from LLaMA-Factory
        return
    launch = c.launch
    if launch is not None and not re.search(r"^export FORCE_TORCHRUN=\"?1\"?", launch, re.M):
        c.add(
            "error",
            "deepspeed_without_torchrun",
            "DeepSpeed is set but launch.sh does not export "
            'FORCE_TORCHRUN=1: LLaMA-Factory stops with "Please use `FORCE_TORCHRUN=1` to launch DeepSpeed '
            'training."',
            "deepspeed",
        )
    elif launch is None:
        c.add(
            "warning",
            "deepspeed_launch",
            "DeepSpeed needs FORCE_TORCHRUN=1 at launch (lfa train sets it; with "
            "plain llamafactory-cli export it yourself)",
            "deepspeed",
        )


@rule("deepspeed_config", "zero3_min_lr", "offload_without_optimizer", "nvme_path_missing", "nvme_path_no_room")
def deepspeed_config(c: RuleContext) -> None:
    d = c.d
    if not d.get("deepspeed") or c.plan.launcher == "ray":
        return
    ds_path, beside = _resolve(c.workdir, c.recipe, str(d["deepspeed"]))
    try:
        ds = json.loads(ds_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        c.add(
            "error", "deepspeed_config", f"DeepSpeed config {d['deepspeed']} cannot be read: {exc}{beside}", "deepspeed"
        )
        return
    kwargs = d.get("lr_scheduler_kwargs")
    # c.plan's sharding was read from this same file (review/core.py deepspeed_setup)
    if c.plan.strategy.min_lr_as_rate and isinstance(kwargs, dict) and "min_lr" in kwargs:
        c.add(
            "error",
            "zero3_min_lr",
            "lr_scheduler_kwargs.min_lr with ZeRO-3: transformers reads "
            "optimizer.defaults, which DeepSpeed's ZeRO-3 optimizer lacks (AttributeError at the first "
            "step, seen on the H200); write min_lr_rate = min_lr / learning_rate",
            "lr_scheduler_kwargs",
        )
    if c.plan.offload != Offload.NONE and "optimizer" not in ds and ds.get("zero_force_ds_cpu_optimizer", True):
        c.add(
            "error",
            "offload_without_optimizer",
            f"{d['deepspeed']} offloads to the CPU but names no optimizer: "
            "DeepSpeed refuses the Trainer's AdamW (\"You are using ZeRO-Offload with a client provided "
            'optimizer"); add an "optimizer": {"type": "AdamW", "params": {"lr": "auto", ...}} '
            "section (lfa's templates do)",
            "deepspeed",
        )
    _nvme_paths(c, ds)


def _nvme_paths(c: RuleContext, ds: dict) -> None:
    """NVMe offload's swap folder must be there (or creatable) on this machine and hold what is swapped."""
    need = disk_gib(c.spec, c.plan) if c.spec is not None else None
    for folder in nvme_swap_folders(ds):
        path = Path(folder) if Path(folder).is_absolute() else c.workdir / folder
        if not path.is_dir():  # this may not be the training machine: its disk cannot be judged from here
            c.add(
                "warning",
                "nvme_path_missing",
                f"nvme_path {folder} is not a folder here; it must exist on the "
                f"training machine with {need or 0:.0f} GiB free (lfa train checks before it starts)",
                "deepspeed",
            )
            continue
        try:
            free = shutil.disk_usage(path).free / 2**30
        except OSError:
            continue
        if need is not None and need > disk_limit_gib(free):
            c.add(
                "error",
                "nvme_path_no_room",
                f"nvme_path {folder}: NVMe offload swaps {need:.0f} GiB (fp32 master "
                f"weights, Adam moments, gradients) but {path} has {free:.0f} GiB free (usable "
                f"{disk_limit_gib(free):.0f}); point nvme_path at a larger local disk",
                "deepspeed",
            )


@rule("output_dir_forbidden", "output_dir_not_empty")
def output_dir_safety(c: RuleContext) -> None:
    """LLaMA-Factory writes checkpoints, config.json and README.md into output_dir: never a folder it must not touch."""
    if not c.d.get("output_dir"):
        return
    path, _ = _resolve(c.workdir, c.recipe, str(c.d["output_dir"]))
    where = forbidden_output_dir(path, c.recipe.folder)
    if where:
        c.add(
            "error",
            "output_dir_forbidden",
            f"output_dir {c.d['output_dir']} resolves to {path.resolve()}, "
            f"{where}: LLaMA-Factory would overwrite files there (lfa train refuses it)",
            "output_dir",
        )
    elif read_marker(path) is None and foreign_entries(path):
        c.add(
            "warning",
            "output_dir_not_empty",
            f"output_dir {path} already holds files lfa did not write "
            f"({', '.join(foreign_entries(path)[:3])}): lfa train refuses it unless it is this run's",
            "output_dir",
        )


@rule("optimizer_changed")
def optimizer_changed(c: RuleContext) -> None:
    if c.plan.changes_optimizer:
        key = "use_badam" if c.plan.optimizer == "badam" else "optim"
        c.add(
            "warning",
            "optimizer_changed",
            f"the optimizer is {c.plan.optimizer}, not the paper's AdamW: this "
            "changes what is trained (8-bit moments or one layer at a time), a hyper-parameter change to report "
            "beside the results",
            key,
        )


@rule("effective_batch_changed")
def effective_batch_of_the_task(c: RuleContext) -> None:
    task, plan = c.task, c.plan
    if task is not None and plan.effective_batch_size != task.effective_batch_size:
        c.add(
            "warning",
            "effective_batch_changed",
            f"effective batch {plan.effective_batch_size} = "
            f"{plan.micro_batch_size} x {plan.grad_accum} x {plan.world_size} GPU(s), but task {task.name} trains "
            f"with {task.effective_batch_size} (the paper's batch); learning rate and schedule assume it",
            "per_device_train_batch_size",
        )


@rule("not_a_count")
def counts_are_positive(c: RuleContext) -> None:
    for key in COUNT_KEYS:  # a value of the wrong type is LLaMA-Factory's own wrong_type finding
        value = c.d.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            c.add("error", "not_a_count", f"`{key}: {value}`: must be at least 1 (memory and speed below assume "
                  f"{readable_count(c.d, key)})", key)  # fmt: skip


@rule("exponent_float")
def exponent_floats(c: RuleContext) -> None:
    for key, raw in raw_scalars(c.recipe.text).items():
        if EXPONENT_WITHOUT_DOT.match(raw):
            c.add(
                "warning",
                "exponent_float",
                f"`{key}: {raw}` is a float to LLaMA-Factory 0.9.5 (OmegaConf) but a "
                f"string to plain PyYAML (yaml.safe_load, HfArgumentParser.parse_yaml_file): write it with a dot, "
                f"e.g. {float(raw):.1e}".replace("e-0", "e-").replace("e+0", "e+"),
                key,
            )


# keys whose value is a secret (LLaMA-Factory's hub tokens, transformers' hub_token, trackers' API keys)
SECRET_KEYS = ("hub_token", "hf_hub_token", "ms_hub_token", "om_hub_token", "swanlab_api_key", "wandb_api_key")
HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")
LOCAL_TRACKERS = {"none", "tensorboard"}


@rule("data_leaves_machine", "secret_in_recipe")
def data_leaving_the_machine(c: RuleContext) -> None:
    """Keys that upload the model or the metrics, and secrets written in plain text (never echoed)."""
    d = c.d
    for key in ("push_to_hub", "export_hub_model_id"):
        if d.get(key) not in (None, False, "", "false", "False"):
            where = d.get("hub_model_id") or d.get("export_hub_model_id") or "a repository named after output_dir"
            c.add("warning", "data_leaves_machine", f"{key}: the trained model is uploaded to the hub ({where})", key)
    if d.get("hub_model_id") and not d.get("push_to_hub"):
        c.add(
            "warning",
            "data_leaves_machine",
            f"hub_model_id {d['hub_model_id']}: names a hub repository to upload to (push_to_hub uploads there)",
            "hub_model_id",
        )
    trackers = d.get("report_to", "none")
    trackers = [trackers] if isinstance(trackers, str) else list(trackers or [])
    remote = [str(t) for t in trackers if str(t).lower() not in LOCAL_TRACKERS]
    if remote:
        c.add(
            "warning",
            "data_leaves_machine",
            f"report_to {', '.join(remote)}: metrics and run settings go to that service (W&B stays offline only "
            "where WANDB_MODE=offline, as lfa's launch.sh sets it)",
            "report_to",
        )
    if d.get("use_swanlab") and str(d.get("swanlab_mode", "cloud")).lower() != "local":
        c.add(
            "warning", "data_leaves_machine", "use_swanlab without swanlab_mode: local uploads metrics", "use_swanlab"
        )
    for key in SECRET_KEYS:
        if d.get(key):
            c.add(
                "error",
                "secret_in_recipe",
                f"{key} holds a secret in plain text: anyone who reads the recipe (a PR, a log) can use it; remove "
                "it and log in where training runs (huggingface-cli login, or HF_TOKEN in the environment)",
                key,
            )
    for key, value in d.items():
        if key not in SECRET_KEYS and isinstance(value, str) and HF_TOKEN.search(value):
            c.add("error", "secret_in_recipe", f"{key} holds what looks like a Hugging Face token (hf_...)", key)


@rule("path_with_spaces")
def paths_without_spaces(c: RuleContext) -> None:
    d = c.d
    distributed = bool(d.get("deepspeed")) or c.hardware.world_size > 1
    spaced = [k for k in PATH_KEYS if " " in str(d.get(k) or "")] + (
        ["(recipe path)"] if " " in str(c.recipe.path.resolve()) else []
    )
    for key in spaced:
        c.add(
            "error" if distributed else "warning",
            "path_with_spaces",
            f"{key} contains a space: LLaMA-Factory's torchrun relaunch splits it"
            + ("" if distributed else " (matters once the recipe runs on several GPUs or DeepSpeed)"),
            key if key in d else None,
        )


@rule("version_dependent_key")
def version_dependent_keys(c: RuleContext) -> None:
    for entry in version_keys():
        if entry["key"] not in c.d:
            continue
        installed = installed_version(entry["package"])
        # the installed version decides: it rejects the key (error), accepts it (info: a note for other
        # installs), or is absent here (warning: the key works only on some versions)
        severity = (
            "warning" if installed is None else "info" if version_matches(installed, entry["accepted"]) else "error"
        )
        c.add(
            severity,
            "version_dependent_key",
            f"`{entry['key']}` exists only in {entry['package']} {entry['accepted']}"
            + (f" (installed: {installed})" if installed else "")
            + f"; elsewhere: {entry['instead']}",
            entry["key"],
        )


@rule("warmup_steps_ratio", "warmup_ratio_removed")
def warmup_key_for_the_installed_transformers(c: RuleContext) -> None:
    """The warmup ratio's key depends on transformers: 5 reads a warmup_steps below 1 as a ratio and removed
    warmup_ratio in 5.15; 4.x reads warmup_steps as a step count, so a ratio there means no warmup at all."""
    installed = installed_version("transformers")
    ratio, steps = c.d.get("warmup_ratio"), c.d.get("warmup_steps")
    if ratio is not None and installed is not None and version_matches(installed, ">=5.15"):
        c.add(
            "error",
            "warmup_ratio_removed",
            f"`warmup_ratio` is gone from transformers 5.15 (installed: {installed}), and LLaMA-Factory stops on "
            f"the unknown key: write `warmup_steps: {ratio}` (a float below 1 is a ratio of the total steps)",
            "warmup_ratio",
        )
    if not isinstance(steps, float) or not 0 < steps < 1:
        return
    if installed is not None and version_matches(installed, ">=5"):
        return
    c.add(
        "warning" if installed is None else "error",
        "warmup_steps_ratio",
        f"`warmup_steps: {steps}` is a ratio of the total steps only on transformers >= 5"
        + (f"; the installed {installed} reads it as a step count and trains without warmup" if installed else "")
        + f": on transformers 4 write `warmup_ratio: {steps}`",
        "warmup_steps",
    )


@rule("plugin_template")
def plugin_template_launch(c: RuleContext) -> None:
    template, launch = c.d.get("template"), c.launch
    if template in chat_template_files() and (launch is None or "plugin" not in launch):
        c.add(
            "warning",
            "plugin_template",
            f"template {template} is not in stock LLaMA-Factory: launch with "
            "`lfa train` or an lfa launch.sh, which register it in every process",
            "template",
        )


@rule("dataset_info_missing", "dataset_info_invalid", "dataset_undefined", "dataset_file_missing")
def datasets_defined(c: RuleContext) -> None:
    d = c.d
    info_file, beside = _resolve(
        c.workdir, c.recipe, str(Path(str(d.get("dataset_dir", "data"))) / "dataset_info.json")
    )
    dataset_dir = info_file.parent
    for name in [s.strip() for s in str(d.get("dataset") or "").split(",") if s.strip()]:
        if not info_file.is_file():
            c.add(
                "error",
                "dataset_info_missing",
                f'{info_file} does not exist (LLaMA-Factory: "Cannot open {info_file}"){beside}',
                "dataset_dir",
            )
            return
        try:
            info = json.loads(info_file.read_text())
        except json.JSONDecodeError as exc:
            c.add("error", "dataset_info_invalid", f"{info_file} is not valid JSON: {exc}", "dataset_dir")
            return
        if name not in info:
            close = difflib.get_close_matches(name, list(info), n=1)
            c.add(
                "error",
                "dataset_undefined",
                f"dataset {name} is not in {info_file.name}" + (f"; did you mean {close[0]}?" if close else ""),
                "dataset",
            )
        elif "file_name" in info[name] and not (dataset_dir / info[name]["file_name"]).exists():
            c.add(
                "warning",
                "dataset_file_missing",
                f"{info[name]['file_name']} (dataset {name}) is not here; it must exist on the training machine",
                "dataset",
            )


@rule("model_missing", "model_from_stage")
def model_exists(c: RuleContext) -> None:
    model = str(c.d.get("model_name_or_path", ""))
    local, beside = _resolve(c.workdir, c.recipe, model)
    stage_input = c.task.model_from_task if c.task is not None else None
    if model and not HUB_ID.match(model) and not local.exists():
        if stage_input:
            c.add(
                "warning",
                "model_from_stage",
                f"model {model} is {stage_input}'s output: train that stage first",
                "model_name_or_path",
            )
        else:
            c.add(
                "error",
                "model_missing",
                f"model {model} is neither a local folder (from {c.workdir}) nor a hub id{beside}",
                "model_name_or_path",
            )


@rule("unknown_template")
def template_known(c: RuleContext) -> None:
    template, known = c.d.get("template"), llamafactory_templates()
    if template and known is not None and template not in known:
        close = difflib.get_close_matches(str(template), sorted(known), n=1)
        c.add(
            "error",
            "unknown_template",
            f"template {template} is neither in LLaMA-Factory nor in lfa's "
            "catalog/chat" + (f"; did you mean {close[0]}?" if close else ""),
            "template",
        )


@rule("memory_over_budget", "memory_headroom")
def gpu_memory(c: RuleContext) -> None:
    gpu, plan = c.gpu, c.plan
    if c.spec is None or gpu is None:
        return
    cutoff = readable_count(c.d, "cutoff_len")
    mem = estimate(c.spec, plan, cutoff, gpu.vram_gib, generate_headroom(c.spec, c.hardware))
    if mem.reserved_gib > gpu.vram_gib:
        c.add(
            "error",
            "memory_over_budget",
            f"predicted peak {mem.reserved_gib:.1f} GiB per GPU does not fit "
            f"{gpu.vram_gib:.1f} GiB on {c.hardware.name} ({plan.label()}): CUDA out of memory expected",
            "per_device_train_batch_size",
        )
    elif not mem.fits:
        c.add(
            "warning",
            "memory_headroom",
            f"predicted peak {mem.reserved_gib:.1f} GiB leaves "
            f"{mem.headroom_left:.0%} of {gpu.vram_gib:.1f} GiB free; lfa plans for {mem.headroom:.0%}",
            "per_device_train_batch_size",
        )


@rule("host_memory_over")
def host_ram(c: RuleContext) -> None:
    if c.spec is None:
        return
    host = host_memory(c.spec, c.plan, c.hardware)
    if host.ram_gib and not host.fits:
        c.add(
            "error" if host.total_gib > host.ram_gib else "warning",
            "host_memory_over",
            f"predicted host RAM {host.total_gib:.1f} GiB per node ({host.phase}: "
            + ", ".join(f"{k} {v:.1f}" for k, v in host.items.items())
            + f") against {host.ram_gib:.0f} GiB on {c.hardware.name} ({host.limit_gib:.1f} usable): the kernel's "
            "OOM killer ends the trainer (SIGKILL, no Python error)",
            "deepspeed" if c.plan.offload != Offload.NONE else None,
        )


@rule("max_samples")
def max_samples_set(c: RuleContext) -> None:
    if c.d.get("max_samples"):
        c.add(
            "warning",
            "max_samples",
            f"max_samples: {c.d['max_samples']} trains on the first {c.d['max_samples']} rows of the dataset only",
            "max_samples",
        )


@rule("fewer_rows_than_batch", "few_steps_per_epoch")
def steps_per_epoch(c: RuleContext) -> None:
    rows, plan = count_dataset_rows(c.recipe, c.workdir), c.plan
    if rows is None:
        return
    rows = min(rows, int(c.d["max_samples"])) if c.d.get("max_samples") else rows
    steps = -(-rows // plan.effective_batch_size)  # the trainer steps on a last, partial batch too
    if rows < plan.effective_batch_size:
        c.add(
            "warning",
            "fewer_rows_than_batch",
            f"{rows} rows is less than one effective batch of "
            f"{plan.effective_batch_size}: each epoch is one optimizer step of {rows} rows, not "
            f"{plan.effective_batch_size}",
            "per_device_train_batch_size",
        )
    elif steps < 10:
        c.add(
            "warning",
            "few_steps_per_epoch",
            f"{rows} rows / effective batch {plan.effective_batch_size} = "
            f"{steps} optimizer steps per epoch: warmup and the schedule have little room",
            "per_device_train_batch_size",
        )


def lfa_findings(
    recipe: Recipe,
    hardware: HardwareProfile,
    plan: Plan,
    lines: dict[str, int],
    spec: ModelSpec | None,
    workdir: Path | None = None,
) -> list[Finding]:
    context = RuleContext(recipe, hardware, plan, lines, spec, workdir or recipe.folder)
    for registered in RULES:
        registered.check(context)
    return context.findings
