"""Stage 6: plan + task -> recipe folder (YAML recipe, DeepSpeed JSON, dataset_info.json, launch.sh) via Jinja."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from .. import UserError, __version__, templates_dir
from ..hardware import HardwareProfile
from ..memory import NvmeSettings, nvme_settings
from ..model_spec import ModelSpec
from ..plan import Plan
from ..quoting import comment_text, shell_word, yaml_float, yaml_scalar
from ..tasks import TaskSpec, chat_template_files
from .keys import (
    OPTIMIZER_KEYS,
    PLUGIN_SETTINGS,
    deepspeed_file_name,
    export_line,
    launch_env,
    plan_keys,
    version_tuple,
    warmup_key,
)


def _environment() -> jinja2.Environment:
    """Templates write values through filters: yaml_scalar where a value is a YAML value, sh where it is a shell
    word, comment_text (also the fallback for every other expression) so that no value can start a line."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        finalize=lambda value: comment_text(value) if isinstance(value, str) else value,
    )
    env.filters["yaml_float"] = yaml_float
    env.filters["yaml_scalar"] = yaml_scalar
    env.filters["sh"] = shell_word
    env.filters["comment"] = comment_text
    return env


# the README stack's versions: what a recipe is written for when neither a flag nor the installed packages say
DEFAULT_LLAMAFACTORY = "0.9.5"
DEFAULT_TRANSFORMERS = "5.6.0"


@dataclass
class RecipeInputs:
    task: TaskSpec
    plan: Plan
    hardware: HardwareProfile
    model_path: str
    dataset_file: str  # as it should appear in dataset_info.json (relative to the recipe folder, or absolute)
    output_dir: str
    chat_template: str
    command: str  # the lfa command that regenerates this recipe
    recipe_name: str = "train"
    hyperparameters: dict = field(default_factory=dict)  # task's, with --set overrides applied
    extra: dict = field(default_factory=dict)  # raw LF keys from --set that are not task hyper-parameters
    offline: bool = True
    save_steps: int = 500
    logging_steps: int = 10
    meta: dict = field(default_factory=dict)
    llamafactory_version: str = DEFAULT_LLAMAFACTORY  # which LLaMA-Factory's keys to write (Ray keys changed in 0.9.5)
    transformers_version: str = DEFAULT_TRANSFORMERS  # which warmup key to write (keys.warmup_key)
    report_to: str = "none"  # one of REPORT_TO
    nvme: NvmeSetup | None = None  # the swap folder of an NVMe offload plan
    memory_note: str = ""  # extra headroom or a measured peak the plan rests on


@dataclass(frozen=True)
class NvmeSetup:
    path: str  # nvme_path: the swap folder
    settings: NvmeSettings


def nvme_setup(
    plan: Plan, model: ModelSpec | None, hardware: HardwareProfile | None, nvme_path: str | None = None
) -> NvmeSetup | None:
    """The swap folder and buffer settings of an NVMe offload plan; None for other plans."""
    if not plan.offloads_to_nvme:
        return None
    path = nvme_path or (hardware.disk.path if hardware is not None and hardware.disk is not None else None)
    if model is None or path is None:
        raise UserError(
            f"{plan.label()} swaps to a disk: the hardware profile needs a disk entry (lfa detect "
            "--measure-disk --save FILE, or disk: {path: DIR, free_gib: N} in the profile) and the model "
            "shape must be known"
        )
    return NvmeSetup(path=path, settings=nvme_settings(model))


def render_deepspeed(plan: Plan, nvme: NvmeSetup | None = None) -> tuple[str, str]:
    if plan.offloads_to_nvme and nvme is None:
        raise UserError(f"{plan.label()}: NVMe offload needs its swap folder")
    text = (
        _environment()
        .get_template(plan.strategy.config_template)
        .render(
            stage=plan.deepspeed_stage,
            offload_optimizer=plan.offloads_optimizer,
            offload_param=plan.offloads_parameters and plan.shards_parameters,
            device=plan.offload_kind.device,
            nvme=nvme,
        )
    )
    json.loads(text)  # the template must stay valid JSON
    return deepspeed_file_name(plan), text


def render_accelerate_config(plan: Plan) -> tuple[str, str] | None:
    """(file name, text) of the accelerate config an FSDP2 plan launches with; None for other strategies."""
    if plan.strategy.started_by != "accelerate":
        return None
    text = (
        _environment()
        .get_template(plan.strategy.config_template)
        .render(
            lfa_version=__version__,
            on_cpu=plan.on_cpu,
            mixed_precision={"bf16": "bf16", "fp16": "fp16"}.get(plan.precision, "'no'"),
        )
    )
    return plan.strategy.config_file, text


def recipe_meta(inputs: RecipeInputs) -> dict:
    """The recipe's lfa-meta header: what lfa planned it from, and the plan's settings LLaMA-Factory has no key for."""
    plan = inputs.plan
    meta = {
        "lfa_version": __version__,
        "task": inputs.task.name,
        "hardware": inputs.hardware.to_dict(),
        "plan": plan.label(),
        "alloc_conf": plan.alloc_conf,
        "launcher": plan.launcher,
        "llamafactory_version": inputs.llamafactory_version,
        **inputs.meta,
    }
    for setting in PLUGIN_SETTINGS:  # lfa's plugin, not LLaMA-Factory keys: the header carries them
        value = setting.header_value(plan)
        if value is not None:
            meta[setting.field] = value
    if plan.strategy.header_key:  # lives outside train.yaml (accelerate's config): the header says how it starts
        meta.update({plan.strategy.header_key: plan.sharding, "accelerate_config": plan.strategy.config_file})
    return meta


def _train_yaml(env: jinja2.Environment, inputs: RecipeInputs, keys: dict) -> str:
    plan = inputs.plan
    text = env.get_template("recipe/train.yaml.j2").render(
        lfa_version=__version__,
        task=inputs.task,
        hardware=inputs.hardware,
        command=inputs.command,
        meta_json=json.dumps(recipe_meta(inputs), sort_keys=True),
        model_path=inputs.model_path,
        keys=keys,
        model_from_task=inputs.task.model_from_task,
        plan=plan,
        deepspeed_file=keys["deepspeed"],
        dataset_name=inputs.task.dataset.name,
        dataset_dir=".",
        chat_template=inputs.chat_template,
        plugin_template=inputs.chat_template in chat_template_files(),
        hp=dict(inputs.hyperparameters),
        preprocessing_workers=1 if plan.on_cpu else 8,
        dataloader_workers=0 if plan.on_cpu else 4,
        output_dir=inputs.output_dir,
        logging_steps=inputs.logging_steps,
        save_steps=inputs.save_steps,
        save_total_limit=3,
        ray_keys="0.9.5" if version_tuple(inputs.llamafactory_version) >= (0, 9, 5) else "0.9.4",
        ray_logical_cpus=ray_logical_cpus(inputs.hardware),
        warmup_key=warmup_key(inputs.transformers_version),
        transformers_version=inputs.transformers_version,
        report_to=inputs.report_to,
        optimizer_keys=OPTIMIZER_KEYS[plan.optimizer],
        memory_note=inputs.memory_note,
    )
    if not inputs.extra:
        return text
    # --set keys: a key the template writes is replaced in place, never written twice
    return set_top_level_keys(
        text, inputs.extra, "  # --set: not the task's value", "  # --set: not part of the task's recipe"
    )


def _launch_scripts(
    env: jinja2.Environment, inputs: RecipeInputs, recipe_file: str, accelerate_file: str | None
) -> dict[str, str]:
    """launch.sh, and per node, Slurm or Ray cluster scripts where the plan spans several processes."""
    plan, hw = inputs.plan, inputs.hardware
    exports = launch_env(
        plan, offline=inputs.offline, master_port=hw.master_port, master_addr=hw.master_addr, report_to=inputs.report_to
    )
    env_entries = [(export_line(e), e.why) for e in exports]
    files = {
        "launch.sh": env.get_template("launch/launch.sh.j2").render(
            lfa_version=__version__,
            recipe_file=recipe_file,
            env=env_entries,
            accelerate_config=accelerate_file,
            world=plan.world_size,
            nodes=hw.nodes,
            master_port=hw.master_port,
        )
    }
    common = dict(
        lfa_version=__version__,
        recipe_file=recipe_file,
        nodes=hw.nodes,
        world=plan.world_size,
        per_node=plan.world_size // max(1, hw.nodes),
        master_addr=hw.master_addr or "NODE0_ADDRESS",
        master_port=hw.master_port,
        run_name=inputs.task.name,
        hosts=list(hw.hosts),
    )
    if hw.nodes > 1 and plan.launcher == "torchrun":
        for rank in range(hw.nodes):
            files[f"launch-node-{rank}.sh"] = env.get_template("launch/node.sh.j2").render(
                rank=rank, host=hw.hosts[rank] if rank < len(hw.hosts) else None, **common
            )
    if hw.has_gpu and plan.world_size > 1 and plan.launcher == "torchrun":
        job_name = re.sub(r"[^A-Za-z0-9._-]", "_", inputs.task.name)  # an #SBATCH line takes no quoting
        files["sbatch.sh"] = env.get_template("launch/sbatch.sh.j2").render(
            cpus=hw.cpu_cores, job_name=job_name, **common
        )
    if plan.launcher == "ray" and hw.nodes > 1:
        files["ray-cluster.sh"] = env.get_template("launch/ray-cluster.sh.j2").render(
            ray_port=6379,
            ray_logical_cpus=ray_logical_cpus(hw),
            env=[e for e in env_entries if not e[0].startswith("export USE_RAY=")],
            **common,
        )
    return files


def render_recipe(inputs: RecipeInputs) -> dict[str, str]:
    """Pure: file name -> text for the whole recipe folder."""
    env = _environment()
    plan = inputs.plan
    files: dict[str, str] = {}
    keys = plan_keys(plan)
    if keys["deepspeed"]:
        files[keys["deepspeed"]] = render_deepspeed(plan, inputs.nvme)[1]
    accelerate_config = render_accelerate_config(plan)
    if accelerate_config:
        files[accelerate_config[0]] = accelerate_config[1]
    recipe_file = f"{inputs.recipe_name}.yaml"
    files[recipe_file] = _train_yaml(env, inputs, keys)
    files["dataset_info.json"] = (
        json.dumps(inputs.task.dataset.dataset_info_entry(inputs.dataset_file), indent=2) + "\n"
    )
    accelerate_file = accelerate_config[0] if accelerate_config else None
    return {**files, **_launch_scripts(env, inputs, recipe_file, accelerate_file)}


def set_top_level_keys(text: str, values: dict, changed_mark: str, added_mark: str) -> str:
    """The recipe text with each top-level key of values set to it (a nested old value removed), the rest appended;
    each changed or added line carries its mark (a YAML comment)."""
    lines: list[str | None] = text.splitlines()
    remaining = dict(values)
    replacing_block = False
    for i, line in enumerate(lines):
        if replacing_block and (line.startswith((" ", "\t")) or not line.strip()):
            lines[i] = None  # the replaced key's old nested value
            continue
        replacing_block = False
        match = re.match(r"^([A-Za-z_][A-Za-z0-9_]*):(\s.*)?$", line)
        if match and match.group(1) in remaining:
            key = match.group(1)
            lines[i] = f"{key}: {yaml_scalar(remaining.pop(key))}{changed_mark}"
            replacing_block = not (match.group(2) or "").split("#")[0].strip()
    added = [f"{key}: {yaml_scalar(value)}{added_mark}" for key, value in remaining.items()]
    return "\n".join([line for line in lines if line is not None] + added) + "\n"


def ray_logical_cpus(hw) -> int:
    """CPUs a node must declare to Ray: LLaMA-Factory 0.9.5 places one {CPU: 10, GPU: 1} bundle per GPU of the
    cluster (trainer_utils.get_placement_group) and waits forever when a node has fewer than 10 CPUs per GPU.
    Ray CPUs are logical, so declaring more than the cores only affects Ray's bookkeeping."""
    return max(hw.cpu_cores, 10 * hw.gpus_per_node)


def write_recipe_dir(files: dict[str, str], out_dir: Path, force: bool = False) -> list[Path]:
    """Write the recipe folder through a temporary folder beside it: a new folder appears whole (one rename), an
    existing one gets each file by rename, so no reader sees half a file and two generates cannot interleave
    their writes inside one file."""
    import shutil
    import tempfile

    try:
        existing = [name for name in files if (out_dir / name).exists()]
        if existing and not force:
            raise UserError(f"{out_dir} already holds {', '.join(existing)}; pass --force to overwrite")
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.lfa-", dir=out_dir.parent))
        try:
            for name, text in files.items():
                path = staging / name
                path.write_text(text)
                if name.endswith(".sh"):
                    path.chmod(0o755)
            if not out_dir.exists():
                staging.chmod(0o755)
                staging.rename(out_dir)
            else:
                for name in files:
                    os.replace(staging / name, out_dir / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        raise UserError(f"cannot write the recipe into {out_dir}: {exc.strerror or exc}") from None
    return [out_dir / name for name in files]


def relative_to_dir(target: str, directory: Path) -> str:
    """A path as seen from the recipe folder: relative when both are local, so recipes stay portable."""
    try:
        return os.path.relpath(Path(target).resolve(), directory.resolve())
    except ValueError:
        return str(Path(target).resolve())
