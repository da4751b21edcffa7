"""Before the first attempt: every check that can refuse a run (flags, output dir, dataset, resume, disk, locks)
and the run setup."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import UserError
from ..data import dataset_problems, row_lengths_from_meta
from ..guard import claim_output_dir
from ..hardware import HardwareProfile, installed_versions, nearest_existing
from ..memory import checkpoint_gib, disk_gib, disk_limit_gib
from ..model_spec import ModelSpec, load_model_spec
from ..plan import Plan
from ..planner import predict
from ..plugin import contract
from ..quoting import host_problem, port_problem, run_name_problem
from ..recipe.read import (
    Recipe,
    count_problems,
    dataset_entries,
    dataset_files,
    file_fingerprint,
    load_recipe,
    nvme_swap_folders,
    parse_sets,
    plan_from_recipe,
    recipe_cutoff,
    recipe_hardware,
    recipe_model_spec,
)
from ..throughput import speed_basis, within_checked_sizes
from .checkpoints import newest_complete_checkpoint, set_aside_previous_output
from .ledger import (
    LEDGER_NAME,
    RunLedger,
    read_ledger,
    write_ledger,
)
from .locks import end_orphaned_trainer, hold_run_locks, run_folders
from .process import (
    ray_node_address,
)
from .progress import Reporter
from .remedies import Attempt, Context, hub_mirror_from_env, ladder_problems
from .request import TrainRequest


def disk_shortfall(output_dir: Path, model: ModelSpec | None, plan: Plan, recipe: Recipe) -> str | None:
    """Before an attempt: the output_dir's disk must hold the next checkpoint (weights + optimizer state); without
    it the save fails after the work is done. None when it does, or when the model's size is unknown."""
    if model is None or str(recipe.data.get("save_strategy", "steps")).lower() == "no":
        return None
    need = checkpoint_gib(model, plan)
    free = shutil.disk_usage(output_dir).free / 2**30
    if free >= need * 1.05:
        return None
    return (
        f"{output_dir} has {free:.2f} GiB free, but one checkpoint of {model.name} takes about {need:.2f} GiB "
        f"({'16-bit weights + fp32 master and Adam state' if plan.deepspeed else 'fp32 weights + Adam state'}); "
        "free space or point output_dir at a larger disk (save_total_limit only removes old checkpoints after a "
        "new one is written)"
    )


def swap_shortfall(folder: Path, deepspeed_file: str | None, model: ModelSpec | None, plan: Plan) -> str | None:
    """Before an NVMe offload attempt: each swap folder of the DeepSpeed config (relative to the folder the trainer
    runs in) must hold what DeepSpeed swaps there. Swap files an earlier attempt left there are rewritten, so they
    count as free. None when it fits or nothing is swapped."""
    if model is None or not plan.offloads_to_nvme or not deepspeed_file:
        return None
    try:
        config = json.loads((folder / deepspeed_file).read_text())
    except (OSError, json.JSONDecodeError):
        return None  # the trainer reports an unreadable config itself
    need = disk_gib(model, plan)
    for swap in nvme_swap_folders(config if isinstance(config, dict) else {}):
        path = folder / swap
        existing = nearest_existing(path)
        reusable = (
            sum(f.stat().st_size for f in (path / "zero_stage_3").rglob("*") if f.is_file()) / 2**30
            if (path / "zero_stage_3").is_dir()
            else 0.0
        )
        free = shutil.disk_usage(existing).free / 2**30 + reusable
        if need > disk_limit_gib(free):
            return (
                f"NVMe offload swaps {need:.0f} GiB to {swap}, but {existing} has {free:.0f} GiB free "
                f"({disk_limit_gib(free):.0f} usable); point nvme_path at a larger local disk "
                "(lfa generate --nvme-path DIR)"
            )
    return None


def training_inputs(recipe: Recipe) -> dict:
    """What a run's checkpoints come from: the recipe's keys as the run uses them (--set keys applied) and a
    fingerprint of each dataset file."""
    return {
        "recipe": json.loads(json.dumps(recipe.data, default=str)),
        "datasets": {str(path.resolve()): file_fingerprint(path) for path in dataset_files(recipe)},
    }


def refuse_bad_dataset(recipe: Recipe) -> None:
    """The dataset files LLaMA-Factory will read, checked before anything starts (file:line for each problem)."""
    problems = [p for path, columns in dataset_entries(recipe) for p in dataset_problems(path, columns)]
    if problems:
        raise UserError(
            "the dataset would fail or lose rows in LLaMA-Factory; not started:\n"
            + "\n".join(f"  {p}" for p in problems)
        )


def refuse_changed_resume(request: TrainRequest, recipe: Recipe, ledger: RunLedger, output_dir: Path) -> dict:
    """This run's training inputs; UserError when checkpoints would be resumed under a changed recipe or dataset
    without --resume-anyway (or --fresh)."""
    now = training_inputs(recipe)
    if not request.fresh and not request.resume_anyway and newest_complete_checkpoint(output_dir, tidy=False):
        changed = changed_inputs(ledger.trained_from, now)
        if changed:
            raise UserError(
                f"the recipe or its data changed since this run's checkpoints were trained ("
                f"{'; '.join(changed)}): resuming would continue the old run under the new settings. "
                "Pass --resume-anyway to resume, or --fresh to start over (old checkpoints are renamed "
                "aside)"
            )
    return now


def changed_inputs(before: dict, now: dict) -> list[str]:
    """Each change between two training_inputs records, for one message (empty: nothing changed, or nothing was
    recorded before)."""
    if not before:
        return []
    old, new = before.get("recipe", {}), now.get("recipe", {})
    changes = [
        f"{key}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}"
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]
    old_data, new_data = before.get("datasets", {}), now.get("datasets", {})
    changes += [
        f"dataset {Path(path).name} "
        + ("removed" if path not in new_data else "added" if path not in old_data else "edited")
        for path in sorted(set(old_data) | set(new_data))
        if old_data.get(path) != new_data.get(path)
    ]
    return changes


def trained_model_spec(recipe: Recipe) -> ModelSpec | None:
    """The shape of the model the recipe trains (what is written to disk); None when lfa cannot know it."""
    try:
        return recipe_model_spec(recipe)
    except UserError:
        return None


def recovery_context(
    recipe: Recipe,
    hardware: HardwareProfile,
    trained: ModelSpec | None,
    liger_available: bool,
    allow_hparam_change: bool = False,
) -> Context:
    """What remedies need to know of a run: the recipe's schedule and model, the hardware, the shape OOM recovery
    plans for (None: the plain ladder). LFA_EMULATE_MODEL names another shape to plan for: fault-injection tests
    emulate a 6.7B OOM while a tiny model trains on the CPU."""
    emulated = os.environ.get(contract.EMULATE_MODEL)
    lr = recipe.data.get("learning_rate")
    kwargs = recipe.data.get("lr_scheduler_kwargs")
    model_dir = recipe.folder / str(recipe.data.get("model_name_or_path", ""))
    mean_fraction, quantiles = row_lengths_from_meta(recipe.meta)
    return Context(
        hardware=hardware,
        allow_hparam_change=allow_hparam_change,
        learning_rate=float(lr) if lr is not None else None,
        hub_mirror=hub_mirror_from_env(),
        model_cached=model_dir.is_dir(),
        scheduler_kwargs=kwargs if isinstance(kwargs, dict) else None,
        model=load_model_spec(emulated) if emulated else trained,
        seq_len=recipe_cutoff(recipe),
        mean_seq_fraction=mean_fraction,
        length_quantiles=quantiles,
        liger_available=liger_available,
        dataloader_workers=int(recipe.data["dataloader_num_workers"])
        if str(recipe.data.get("dataloader_num_workers", "")).isdigit()
        else None,
    )


def attempt_prediction(recipe: Recipe, hardware: HardwareProfile, plan: Plan, model: ModelSpec | None) -> dict:
    """What the memory and throughput models predict for an attempt's plan, kept beside what it measured."""
    if model is None:
        return {}
    seq_len = recipe_cutoff(recipe)
    c = predict(model, plan, hardware, seq_len, *row_lengths_from_meta(recipe.meta))
    # on a CPU the speed "model" is a rough FLOP rate, and far below the sizes it was checked on a step is bound by
    # kernel launches: no prediction to hold a measurement against
    return {
        "tokens_per_s": round(c.tokens_per_s) if hardware.has_gpu and within_checked_sizes(model) else None,
        "speed_basis": speed_basis(hardware, plan),
        "reserved_gib": round(c.memory.reserved_gib, 3),
        "budget_gib": c.memory.budget_gib,
        "limit_gib": c.memory.limit_gib,
        "memory_gib": {k: round(v, 3) for k, v in c.memory.items.items()},
        "host_gib": round(c.host.total_gib, 2),
        # for the report's MFU: 6N + attention at cutoff_len per token (bench/seed_scenario.py's accounting)
        "flops_per_token": model.flops_per_token(seq_len),
        "peak_tflops": hardware.gpu.peak_tflops_16bit * plan.world_size if hardware.has_gpu else None,
    }


@dataclass
class RunSetup:
    request: TrainRequest
    recipe: Recipe
    hardware: HardwareProfile
    name: str
    run_dir: Path
    output_dir: Path
    locks: list
    ledger: RunLedger
    reporter: Reporter
    user_keys: dict
    model_dir: Path
    trained_model: ModelSpec | None
    context: Context
    effective: Recipe  # the recipe with --set keys: what the first attempt's plan is read from
    attempt: Attempt
    launch_keys: dict
    rendezvous_env: dict
    ended_orphan: str | None

    def save(self) -> None:
        write_ledger(self.run_dir, self.ledger)


@dataclass
class Preflight:
    """The checks before anything starts, on the recipe as the run uses it (--set keys applied)."""

    recipe: Recipe  # the file
    hardware: HardwareProfile  # --hardware, else the recipe's own
    user_keys: dict  # --set
    effective: Recipe  # the recipe with --set keys: what every check and the first attempt's plan read
    name: str
    run_dir: Path
    output_dir: Path
    ledger: RunLedger
    trained_from: dict


def rendezvous_flag_problems(request: TrainRequest) -> list[str]:
    """--master-addr and --master-port reach the trainers' environment: a host name or address, a port."""
    problems = []
    if request.master_addr is not None and (problem := host_problem(request.master_addr)):
        problems.append(f"--master-addr {problem}")
    if request.master_port is not None and (problem := port_problem(request.master_port)):
        problems.append(f"--master-port {problem}")
    return problems


def preflight(request: TrainRequest, before_detach: bool = False) -> Preflight:
    """Read the recipe and its --set keys, make the run folder, and refuse (UserError, one message) an output_dir
    lfa may not write into, one in use, a dataset LLaMA-Factory would fail on, or a resume under changed inputs."""
    recipe = load_recipe(request.recipe)
    user_keys = parse_sets(request.overrides)
    problems = rendezvous_flag_problems(request)
    if problems:
        raise UserError("; ".join(problems))
    hardware = recipe_hardware(recipe, request.hardware)
    # --set keys are part of the recipe this run starts from: every check, the plan and every remedy start from
    # them, and a remedy's change wins over them on the next attempt
    effective = Recipe(recipe.path, {**recipe.data, **user_keys}, recipe.meta, recipe.text)
    if "output_dir" not in effective.data:
        raise UserError(f"{recipe.path} has no output_dir")
    problems = count_problems(effective)
    if problems:  # before any folder is made or locked
        raise UserError(f"{recipe.path}: " + "; ".join(problems))
    name = request.name or recipe.folder.resolve().name
    problem = run_name_problem(name)
    if problem:
        raise UserError(f"run name {problem}")
    run_dir, output_dir = run_folders(request, effective, name)
    try:
        ledger = read_ledger(run_dir) if (run_dir / LEDGER_NAME).is_file() else RunLedger(str(recipe.path.resolve()))
    except UserError:
        if before_detach:  # a damaged ledger is the background run's to report
            ledger = RunLedger("")
        else:
            raise
    refuse_bad_dataset(effective)  # both before anything is locked, created or renamed
    trained_from = refuse_changed_resume(request, effective, ledger, output_dir)
    return Preflight(recipe, hardware, user_keys, effective, name, run_dir, output_dir, ledger, trained_from)


def prepare(request: TrainRequest) -> RunSetup:
    """Everything before the first attempt: the recipe and its plan, the run folder and its locks, the ledger, what
    remedies need to know. Raises UserError on bad input, before anything runs."""
    problems = ladder_problems()  # a misspelled remedy would only be skipped in the middle of a failing run
    if problems:
        raise UserError("failures/classes.yaml: " + "; ".join(problems))
    checked = preflight(request)
    recipe, effective, user_keys = checked.recipe, checked.effective, checked.user_keys
    name, run_dir, output_dir, ledger = checked.name, checked.run_dir, checked.output_dir, checked.ledger
    hardware, trained_from = checked.hardware, checked.trained_from
    locks = hold_run_locks(run_dir, output_dir, request.node_rank)
    claim_output_dir(output_dir, run_dir, recipe.path)
    ended_orphan = end_orphaned_trainer(run_dir)
    if request.fresh:  # what earlier attempts wrote is moved aside, never deleted
        set_aside_previous_output(output_dir)
    ledger.trained_from = trained_from
    ledger.output_dir = str(output_dir)
    rendezvous_env = {
        name: str(value)
        for name, value in (
            ("NODE_RANK", request.node_rank),
            ("MASTER_ADDR", request.master_addr),
            ("MASTER_PORT", request.master_port),
        )
        if value is not None
    }
    if request.node_rank is not None and not 0 <= request.node_rank < hardware.nodes:
        raise UserError(f"--node-rank {request.node_rank}: the recipe's hardware has {hardware.nodes} node(s)")
    reporter = Reporter(request.json_events)
    model_dir = recipe.folder / str(effective.data.get("model_name_or_path", ""))
    trained_model = trained_model_spec(effective)
    context = recovery_context(
        effective,
        hardware,
        trained_model,
        liger_available=installed_versions().get("liger-kernel") is not None,
        allow_hparam_change=request.allow_hparam_change,
    )
    attempt = Attempt(plan_from_recipe(effective, hardware))
    launch_keys = {}
    if (
        attempt.plan.launcher == "ray"
        and "ray_run_name" not in recipe.data
        and "master_addr" not in recipe.data
        and "master_addr" not in user_keys
    ):
        address = ray_node_address()
        if address is None:
            raise UserError(
                f"{recipe.path} trains through Ray (USE_RAY=1) but ray is not installed here: pip install ray"
            )
        launch_keys["master_addr"] = address
    return RunSetup(
        request,
        recipe,
        hardware,
        name,
        run_dir,
        output_dir,
        locks,
        ledger,
        reporter,
        user_keys,
        model_dir,
        trained_model,
        context,
        effective,
        attempt,
        launch_keys,
        rendezvous_env,
        ended_orphan,
    )
