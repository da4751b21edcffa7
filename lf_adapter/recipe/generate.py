"""`lfa generate`: task + model + hardware -> plan -> rendered recipe folder (the glue between the stages)."""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from .. import UserError
from ..data import ASSUMED_MEAN_SEQ_FRACTION, DatasetProfile, profile_dataset
from ..hardware import DiskSpec, HardwareProfile, installed_versions, load_profile, nearest_existing
from ..measured import planning_margin
from ..model_spec import ModelSpec, load_model_spec
from ..plan import LF_FLASH_ATTN, PINNABLE, Plan
from ..plan_reasons import format_machine_options, machine_options
from ..planner import NoPlanFits, PlanOptions, PlanResult, plan
from ..quoting import comment_text
from ..strategy import STRATEGIES, Offload, Optimizer, Sharding
from ..tasks import TaskSpec, load_task
from ..throughput import speed_basis
from .keys import OPTIMIZER_KEYS, plan_keys
from .read import load_recipe, parse_sets, parse_value
from .render import (
    DEFAULT_LLAMAFACTORY,
    DEFAULT_TRANSFORMERS,
    RecipeInputs,
    nvme_setup,
    relative_to_dir,
    render_recipe,
)

LIGER_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral", "mixtral", "gemma", "gemma2", "phi3", "granite", "olmo2"}
TASK_HYPERPARAMETERS = {
    "cutoff_len",
    "learning_rate",
    "num_train_epochs",
    "lr_scheduler_type",
    "min_lr",
    "warmup_ratio",
    "effective_batch_size",
    "ddp_timeout",
    "max_steps",
    "seed",
}


def _flag(name: str, value: object) -> list[str]:
    return [name, str(value)] if value else []


def _switch(name: str, on: bool) -> list[str]:
    return [name] if on else []


def _repeated(name: str, values: tuple[str, ...]) -> list[str]:
    return [x for value in values for x in (name, value)]


# the --no-X switches and the request (and plan) field each turns off
SWITCHED_OFF = {
    "padding_free": "--no-padding-free",
    "token_budget": "--no-token-budget",
    "master_weights": "--no-master-weights",
}


@dataclass
class GenerateRequest:
    task: str
    out_dir: Path
    model: str | None = None
    dataset: str | None = None
    template: str | None = None
    hardware: str = "detect"
    gpus: int | None = None
    allow_packing: bool = False
    sort_steps: bool = True
    padding_free: bool = True  # where the exact varlen kernel exists (--no-padding-free: padded everywhere)
    token_budget: bool = True  # token-budget micro-batches where they apply (--no-token-budget: fixed ones)
    master_weights: bool = True  # 16-bit model, fp32 masters where they run (--no-master-weights: autocast)
    pins: tuple[str, ...] = ()  # FIELD=VALUE plan fields fixed by the user
    launcher: str = "torchrun"
    llamafactory_version: str | None = None  # default: the installed one, else 0.9.5
    transformers_version: str | None = None  # default: the installed one, else 5.6.0 (what LF 0.9.5 installs)
    precision: str | None = None
    sets: tuple[str, ...] = ()
    save_steps: int = 500
    logging_steps: int = 10
    name: str = "train"
    command: str = ""
    report_to: str = "none"  # a key of recipe.keys.REPORT_TO
    allow_optimizer_change: bool = False  # memory-light optimizers may be chosen (they change what is trained)
    nvme_path: str | None = None  # NVMe offload's swap folder instead of the profile's disk path
    use_measured: bool = True  # plan from peaks lfa train measured on this machine (goldens: from the models alone)

    def argv(self) -> list[str]:
        """The `lfa generate` flags that plan this recipe again (the recipe's header records them; the output folder,
        save and logging steps are left out: they do not change the plan)."""
        return [
            "--task", self.task, *_flag("--model", self.model), *_flag("--dataset", self.dataset),
            *_flag("--template", self.template), "--hardware", self.hardware, *_flag("--gpus", self.gpus),
            *_flag("--precision", self.precision), *_switch("--allow-packing", self.allow_packing),
            *_switch("--no-sorted-steps", not self.sort_steps),
            *(x for field, switch in SWITCHED_OFF.items() for x in _switch(switch, not getattr(self, field))),
            *_repeated("--pin", self.pins),
            *_switch("--allow-optimizer-change", self.allow_optimizer_change), *_flag("--nvme-path", self.nvme_path),
            *_flag("--launcher", self.launcher if self.launcher != "torchrun" else None),
            *_flag("--llamafactory-version", self.llamafactory_version), *_repeated("--set", self.sets),
            *_flag("--report-to", self.report_to if self.report_to != "none" else None),
        ]  # fmt: skip


@dataclass
class Generated:
    files: dict[str, str]
    result: PlanResult
    model: ModelSpec
    hardware: HardwareProfile
    task: TaskSpec
    dataset: DatasetProfile | None = None
    hyperparameters: dict | None = None
    listing: list[str] = dataclasses.field(default_factory=list)  # what runs on this machine
    memory_note: str = ""  # extra headroom or a measured peak the plan rests on (measured.planning_margin)


# LLaMA-Factory keys the plan writes (recipe.keys.plan_keys and the optimizers' keys): --set may not change them
PLAN_OWNED_KEYS = set(plan_keys(Plan("bf16", 1, 1))) | {key for keys in OPTIMIZER_KEYS.values() for key in keys}

# what each task hyper-parameter must be; (type, lowest allowed value)
HYPERPARAMETER_RULES = {
    "learning_rate": (float, 0.0),
    "min_lr": (float, 0.0),
    "num_train_epochs": (float, 0.0),
    "warmup_ratio": (float, 0.0),
    "cutoff_len": (int, 1),
    "effective_batch_size": (int, 1),
    "max_steps": (int, -1),
    "ddp_timeout": (int, 1),
    "seed": (int, 0),
}


def check_hyperparameters(hp: dict) -> None:
    """Every problem with the task's hyper-parameters (after --set) in one message, before anything is planned."""
    problems = []
    for key, (kind, lowest) in HYPERPARAMETER_RULES.items():
        if key not in hp:
            continue
        value = hp[key]
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (kind is int and not isinstance(value, int))
        ):
            problems.append(f"{key}={value!r} is not {'an integer' if kind is int else 'a number'}")
        elif value < lowest or (kind is float and key in ("learning_rate", "num_train_epochs") and value <= 0):
            problems.append(f"{key}={value} must be {'> 0' if kind is float else f'>= {lowest}'}")
    if problems:
        raise UserError("invalid hyper-parameters: " + "; ".join(problems))


def parse_pins(pins: tuple[str, ...]) -> dict:
    fixed = {}
    for item in pins:
        key, sep, raw = item.partition("=")
        key = key.strip()
        shown = comment_text(item)[:120]
        if not sep or key not in PINNABLE:
            raise UserError(f"--pin '{shown}': expected FIELD=VALUE with FIELD one of {', '.join(PINNABLE)}")
        value = parse_value(raw)
        if key in ("deepspeed", "alloc_conf") and value in ("none", None, False):
            value = None
        elif not isinstance(value, PINNABLE[key][0]):
            kind = {int: "an integer", bool: "true or false", str: "a name"}[PINNABLE[key][0]]
            raise UserError(f"--pin '{shown}': {key} takes {kind}")
        fixed[key] = value
    for key in ("token_budget", "checkpoint_layers", "micro_batch_size"):
        lowest = 0 if key == "token_budget" else 1
        if key in fixed and (isinstance(fixed[key], bool) or fixed[key] < lowest):
            raise UserError(f"--pin {key}={fixed[key]}: must be an integer >= {lowest}")
    if fixed.get("checkpoint_layers") and fixed.get("gradient_checkpointing") is False:
        raise UserError("--pin checkpoint_layers needs gradient checkpointing (not gradient_checkpointing=false)")
    stages = [name for name, s in STRATEGIES.items() if s.engine == "deepspeed" and s.proposed != "never"]
    if fixed.get("deepspeed") not in (None, *stages):
        record = STRATEGIES.get(str(fixed["deepspeed"]))
        why = f"{record.not_proposed_why}; " if record and record.not_proposed_why else ""
        raise UserError(f"--pin deepspeed={fixed['deepspeed']}: {why}use {', '.join(stages)} or none")
    if "sharding" in fixed:
        try:
            Sharding.parse(fixed["sharding"], "--pin sharding")
        except ValueError as exc:
            raise UserError(str(exc)) from None
    if fixed.get("attention", "sdpa") not in LF_FLASH_ATTN:
        raise UserError(f"--pin attention={fixed['attention']}: use one of {', '.join(LF_FLASH_ATTN)}")
    for key, vocabulary in (("offload", Offload), ("optimizer", Optimizer)):
        if key in fixed:
            try:
                vocabulary.parse(fixed[key], f"--pin {key}")
            except ValueError as exc:
                raise UserError(str(exc)) from None
    return fixed


def _stage1_model(request: GenerateRequest, task: TaskSpec) -> tuple[str, str]:
    """norm2code starts from pseudo2norm's output: (model path for the recipe, model whose shape to plan for)."""
    # layout recipes/<task>/<hardware>/: stage 1 lives at recipes/<model_from_task>/<same hardware>/
    stage1 = request.out_dir.parent.parent / task.model_from_task / request.out_dir.name / f"{request.name}.yaml"
    if not stage1.is_file():
        raise UserError(
            f"task {task.name} trains on {task.model_from_task}'s output model: generate "
            f"{task.model_from_task} into {stage1.parent} first, or pass --model"
        )
    recipe = load_recipe(stage1)
    output = relative_to_dir(str(stage1.parent / str(recipe.data["output_dir"])), request.out_dir)
    stage1_model = stage1.parent / str(recipe.data["model_name_or_path"])
    return output, str(stage1_model) if stage1_model.is_dir() else str(recipe.data["model_name_or_path"])


def with_swap_folder(hardware: HardwareProfile, folder: str) -> HardwareProfile:
    """The profile with NVMe offload swapping to `folder`: its free space is measured when the folder (or the
    nearest existing folder above it) is on this machine, else the profile's disk figures are kept."""
    import shutil

    existing = nearest_existing(Path(folder).expanduser())
    disk = hardware.disk or DiskSpec(path=folder, free_gib=0.0, source="--nvme-path")
    try:
        free = round(shutil.disk_usage(existing).free / 2**30, 1)
        disk = dataclasses.replace(
            disk,
            path=folder,
            free_gib=free,
            source=(disk.source + "; " if disk.source else "") + f"free space measured at {existing} by lfa generate",
        )
    except OSError:
        disk = dataclasses.replace(disk, path=folder)
    return dataclasses.replace(hardware, disk=disk)


LLAMAFACTORY_VERSION = re.compile(r"\d+\.\d+(\.\d+)?([.+-]?[A-Za-z0-9]+)*")


def _hardware(request: GenerateRequest) -> HardwareProfile:
    """The profile asked for, with the swap folder and GPU count the flags set."""
    hardware = load_profile(request.hardware)
    if request.nvme_path:
        hardware = with_swap_folder(hardware, request.nvme_path)
    if request.gpus is not None:
        if request.gpus < 1 or (hardware.has_gpu and request.gpus > hardware.gpus_per_node * hardware.nodes):
            raise UserError(
                f"--gpus {request.gpus}: {hardware.name} has {hardware.world_size} GPU(s); use 1..{hardware.world_size}"
            )
        hardware = dataclasses.replace(hardware, nodes=1, gpus_per_node=request.gpus)
    if request.launcher == "ray" and hardware.world_size == 1:
        raise UserError("--launcher ray needs several GPUs or nodes: one process needs no launcher")
    if request.launcher == "ray" and not hardware.has_gpu:
        raise UserError(
            "--launcher ray needs GPUs: LLaMA-Factory's Ray path counts every CPU of a CPU-only machine "
            "as a device and reserves 10 CPUs for each, so it can never place its workers; use "
            "--launcher torchrun"
        )
    if request.precision == "bf16" and hardware.has_gpu and not hardware.gpu.bf16:
        raise UserError(
            f"--precision bf16: {hardware.gpu.name} (sm{hardware.gpu.compute_capability}) has no native bf16"
        )
    return hardware


def _models(request: GenerateRequest, task: TaskSpec) -> tuple[str, str]:
    """(the model the recipe loads, the model whose shape is planned): the same unless a stage-2 task trains on a
    stage-1 output."""
    if request.model:
        return request.model, request.model
    if task.model_from_task:
        return _stage1_model(request, task)
    if task.default_model:
        return task.default_model, task.default_model
    raise UserError(f"task {task.name} has no default model: pass --model")


def _hyperparameters(request: GenerateRequest, task: TaskSpec) -> tuple[dict, dict]:
    """(the task's hyperparameters with --set's, the other --set keys): keys the plan owns are refused."""
    hp, extra = dict(task.hyperparameters), {}
    for key, value in parse_sets(request.sets).items():
        (hp if key in TASK_HYPERPARAMETERS else extra)[key] = value
    check_hyperparameters(hp)
    owned = sorted(set(extra) & PLAN_OWNED_KEYS)
    if owned:
        raise UserError(
            f"--set {', '.join(owned)}: the plan sets these from the memory model; pin the plan field instead "
            "(--pin micro_batch_size=N, --precision, --pin gradient_checkpointing=false, --pin deepspeed=..., "
            "--pin optimizer=...; the rows per step: --effective-batch)"
        )
    return hp, extra


def _pinned_fields(request: GenerateRequest) -> dict:
    """The plan fields the user fixed (--precision, --pin); a --no-X switch and a pin turning X on are one error."""
    fixed = {"precision": request.precision} if request.precision else {}
    fixed.update(parse_pins(request.pins))
    for field, switch in SWITCHED_OFF.items():
        if not getattr(request, field) and fixed.get(field):
            raise UserError(f"{switch} and --pin {field}={fixed[field]} contradict each other: drop one")
    return fixed


def _dataset(
    request: GenerateRequest, task: TaskSpec, cutoff: int, shape_model: str
) -> tuple[str, float, DatasetProfile | None]:
    """(the recipe's dataset path, the mean row length over cutoff_len, the profile when the data was read)."""
    if request.dataset:
        profile = profile_dataset(request.dataset, task.dataset.columns, cutoff, shape_model)
        return relative_to_dir(request.dataset, request.out_dir), profile.mean_seq_fraction, profile
    if task.dataset.file_name:
        return f"data/{task.dataset.file_name}", ASSUMED_MEAN_SEQ_FRACTION, None
    raise UserError(f"task {task.name} needs --dataset FILE (alpaca-style jsonl)")


def _recipe_meta(
    shape_model: str,
    hp: dict,
    request: GenerateRequest,
    result: PlanResult,
    mean_fraction: float,
    profile: DatasetProfile | None,
) -> dict:
    """What the recipe's lfa-meta header records about how it was planned and what was predicted."""
    meta = {
        "model": shape_model,
        "effective_batch_size": int(hp["effective_batch_size"]),
        "mean_seq_fraction": round(mean_fraction, 4),
        "allow_packing": request.allow_packing,
        "predicted_reserved_gib": round(result.chosen.memory.reserved_gib, 2),
        "predicted_tokens_per_s": round(result.chosen.tokens_per_s),
        "predicted_host_gib": round(result.chosen.host.total_gib, 1),
    }
    if result.chosen.disk_gib:
        meta["predicted_disk_gib"] = round(result.chosen.disk_gib, 1)
    if profile:
        meta["dataset_rows"] = profile.rows
        meta["length_quantiles"] = list(profile.length_quantiles)
    return meta


def generate(request: GenerateRequest) -> Generated:
    if request.llamafactory_version and not LLAMAFACTORY_VERSION.fullmatch(request.llamafactory_version):
        raise UserError(
            f"--llamafactory-version '{comment_text(request.llamafactory_version)[:80]}': expected a version such "
            "as 0.9.5 or 0.9.4.dev0"
        )
    task = load_task(request.task)
    hardware = _hardware(request)
    recipe_model, shape_model = _models(request, task)
    spec = load_model_spec(shape_model)
    local_model = Path(recipe_model).is_dir() or bool(task.model_from_task and not request.model)
    if Path(recipe_model).is_dir():
        recipe_model = relative_to_dir(recipe_model, request.out_dir)
    chat_template = request.template or task.chat_template
    if not chat_template:
        raise UserError(f"task {task.name} needs --template (a LLaMA-Factory template name)")
    hp, extra = _hyperparameters(request, task)
    epochs, cutoff = float(hp.get("num_train_epochs", 1.0)), int(hp["cutoff_len"])
    dataset_file, mean_fraction, profile = _dataset(request, task, cutoff, shape_model)
    versions = installed_versions()
    liger_ok = spec.arch in LIGER_MODEL_TYPES and (
        request.hardware != "detect" or versions.get("liger-kernel") is not None
    )
    fixed = _pinned_fields(request)
    margin = planning_margin(spec, hardware, request.use_measured)
    options = PlanOptions(
        headroom=margin.headroom,
        activation_scale=margin.activation_scale,
        allow_packing=request.allow_packing,
        sort_steps=request.sort_steps,
        padding_free=request.padding_free,
        token_budget=request.token_budget,
        master_weights=request.master_weights,
        liger_available=liger_ok,
        launcher=request.launcher,
        flash_attn_available=request.hardware == "detect" and versions.get("flash-attn") is not None,
        mean_seq_fraction=mean_fraction,
        length_quantiles=profile.length_quantiles if profile else (),
        fixed=fixed,
        allow_optimizer_change=request.allow_optimizer_change,
    )
    rows = profile.rows if profile else None
    try:
        result = plan(spec, hardware, int(hp["effective_batch_size"]), cutoff, options)
    except NoPlanFits as exc:
        listing = options_listing(exc.priced, hardware, cutoff, mean_fraction, rows, epochs, fixed.get("optimizer"))
        raise NoPlanFits("\n".join([str(exc), *listing]), exc.priced) from None
    inputs = RecipeInputs(
        task=task,
        plan=result.chosen.plan,
        hardware=hardware,
        model_path=recipe_model,
        dataset_file=dataset_file,
        output_dir=f"saves/{task.name}",
        chat_template=chat_template,
        command=request.command or "lfa generate " + shlex.join(["--task", task.name]),
        recipe_name=request.name,
        hyperparameters=hp,
        extra=extra,
        offline=local_model,
        save_steps=request.save_steps,
        logging_steps=request.logging_steps,
        meta=_recipe_meta(shape_model, hp, request, result, mean_fraction, profile),
        llamafactory_version=request.llamafactory_version or versions.get("llamafactory") or DEFAULT_LLAMAFACTORY,
        transformers_version=request.transformers_version or versions.get("transformers") or DEFAULT_TRANSFORMERS,
        report_to=request.report_to,
        nvme=nvme_setup(result.chosen.plan, spec, hardware),
        memory_note=margin.note,
    )
    return Generated(
        files=render_recipe(inputs),
        result=result,
        model=spec,
        hardware=hardware,
        task=task,
        dataset=profile,
        hyperparameters=hp,
        listing=options_listing(result.priced, hardware, cutoff, mean_fraction, rows, epochs, fixed.get("optimizer")),
        memory_note=margin.note,
    )


def options_listing(
    priced,
    hardware: HardwareProfile,
    seq_len: int,
    mean_fraction: float,
    rows: int | None,
    epochs: float,
    pinned_optimizer: str | None = None,
) -> list[str]:
    options = machine_options(priced)
    basis = speed_basis(hardware, options[0].candidate.plan) if options else ""
    return format_machine_options(options, seq_len, mean_fraction, rows, epochs, basis, pinned_optimizer)
