"""`lfa doctor`: the supervisor's diagnosis for a run lfa did not supervise (a nohup'd `llamafactory-cli` log):
classify the log, show the evidence and the remedy, and with the recipe write the recipe the next attempt would run."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .. import UserError
from ..recipe.keys import LaunchEnv, export_line, launch_env, plan_keys
from ..recipe.read import Recipe, load_recipe, plan_from_recipe, recipe_hardware, recipe_workdir
from .monitor import Failure, LineReader, classify, failure_classes
from .preflight import recovery_context, trained_model_spec
from .remedies import Attempt, Remedy, next_remedy
from .resolved import key_changes, resolved_text, write_deepspeed_config


@dataclass
class Diagnosis:
    failure: Failure | None
    remedy: Remedy | None = None
    advice: str = ""
    written: list[str] = field(default_factory=list)  # files of the next attempt
    env: dict = field(default_factory=dict)  # variables the next attempt needs exported
    exports: list[str] = field(default_factory=list)  # the same as bash `export` lines, values quoted

    @property
    def exit_code(self) -> int:
        """0: a remedy exists; 1: not retriable, nothing fits, or no failure found."""
        return 0 if self.remedy is not None and self.remedy.attempt is not None else 1


def read_log(path: Path) -> list[str]:
    if not path.is_file():
        what = (
            "is a folder, not a log file"
            if path.is_dir()
            else "is not a regular file"
            if path.exists()
            else "does not exist"
        )
        raise UserError(f"log {path} {what}")
    reader = LineReader(tail=2000)
    try:
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                reader.feed(chunk)
    except OSError as exc:
        raise UserError(f"cannot read log {path}: {exc}") from None
    reader.flush()
    return list(reader.tail)


def diagnose(
    log: Path,
    recipe_path: Path | None = None,
    hardware: str | None = None,
    out: Path | None = None,
    allow_hparam_change: bool = False,
    workdir: Path | None = None,
) -> Diagnosis:
    """workdir: where llamafactory-cli ran, what its relative paths resolve against (lfa review's rule: --workdir,
    else the recipe's folder for lfa's recipes, else the current directory)."""
    failure = classify(read_log(log), None)
    if failure is None:
        return Diagnosis(None)
    advice = next((c.advice for c in failure_classes() if c.name == failure.kind), "")
    if recipe_path is None:
        return Diagnosis(failure, advice=advice or _generic_ladder(failure))
    recipe = load_recipe(recipe_path)
    hw = recipe_hardware(recipe, hardware)
    model_dir = recipe.folder / str(recipe.data.get("model_name_or_path", ""))
    # the log came from another machine: liger is there if the recipe used it
    context = recovery_context(
        recipe, hw, trained_model_spec(recipe), bool(recipe.data.get("enable_liger_kernel")), allow_hparam_change
    )
    attempt = Attempt(plan_from_recipe(recipe, hw, recipe_workdir(recipe, workdir)))
    remedy = next_remedy(attempt, failure, context, set())
    diagnosis = Diagnosis(failure, remedy, advice)
    if remedy is None or remedy.attempt is None:
        return diagnosis
    nxt = remedy.attempt
    changes = {**key_changes(recipe, nxt, plan_keys(attempt.plan))}
    target = out or recipe.path.with_name(recipe.path.stem + ".next.yaml")
    if nxt.plan.deepspeed and (changes.get("deepspeed") or nxt.own_deepspeed_config):
        changes["deepspeed"] = write_deepspeed_config(target.parent, nxt.plan, context.model, hw)
        diagnosis.written.append(str(target.parent / changes["deepspeed"]))
    # everything the next plan needs at launch: the seed's run was a plain llamafactory-cli, not lfa's launch.sh
    entries = [e for e in launch_env(nxt.plan, offline=model_dir.is_dir()) if e.name not in nxt.env]
    entries += [LaunchEnv(name, value, "the remedy") for name, value in nxt.env.items()]
    diagnosis.env = {e.name: e.value for e in entries}
    diagnosis.exports = [export_line(e) for e in entries]
    note = f"{failure.kind} in {log.name}; {remedy.action}: {remedy.why}"
    notes = [note, *diagnosis.exports]
    # the plan fields that are no LLaMA-Factory keys (sorted steps, allocator) travel in lfa's header, so that
    # `lfa train` runs the same plan
    meta = {
        **recipe.meta,
        "plan": nxt.plan.label(),
        "sorted_steps": nxt.plan.sorted_steps,
        "alloc_conf": nxt.plan.alloc_conf,
        "hardware": hw.to_dict(),
    }
    text = resolved_text(
        Recipe(
            recipe.path,
            recipe.data,
            meta,
            "\n".join(line for line in recipe.text.splitlines() if not line.startswith("# lfa-meta: ")),
        ),
        changes,
        notes,
    )
    text = text.replace("# lfa train resolved this recipe", "# lfa doctor wrote the next attempt of this recipe", 1)
    lines = text.splitlines()
    split = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    lines.insert(split, "# lfa-meta: " + json.dumps(meta, sort_keys=True))
    target.write_text("\n".join(lines) + "\n")
    diagnosis.written.insert(0, str(target))
    return diagnosis


def _generic_ladder(failure: Failure) -> str:
    cls = next(c for c in failure_classes() if c.name == failure.kind)
    if not cls.ladder:
        return ""
    return (
        "remedies lfa tries, in order: "
        + ", ".join(step.rstrip("*") for step in cls.ladder)
        + "; pass --recipe to get the next attempt's recipe"
        + (" (for an OOM, planned by the memory model)" if failure.kind == "cuda_oom" else "")
    )
