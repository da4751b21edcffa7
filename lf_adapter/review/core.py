"""`lfa review`: validate recipes with LLaMA-Factory's own argument parsing plus lfa's rules, and summarize them
for a pull request (plan, memory against the budget, tokens per step, predicted speed and wall time, and what
changed against the base branch)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from .. import UserError
from ..model_spec import ModelSpec
from ..recipe.diff import semantic_diff, semantic_view
from ..recipe.read import (
    COUNT_KEYS,
    Recipe,
    deepspeed_setup,
    is_positive_int,
    load_recipe,
    plan_from_recipe,
    recipe_hardware,
    recipe_model_spec,
    recipe_workdir,
)
from .findings import SEVERITIES, Finding, RecipeReview, key_lines
from .lf_checks import llamafactory_findings
from .rules import lfa_findings
from .summary import summarize


def _model_spec(recipe: Recipe, model: str | None, workdir: Path) -> ModelSpec | None:
    try:
        return recipe_model_spec(recipe, workdir, model)
    except UserError:
        return None


def _base_view(path: Path, base_ref: str) -> tuple[dict | None, str]:
    """semantic_view of the recipe as it is at a git ref (e.g. origin/main): the 'what changed' of a PR review."""
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=path.parent, capture_output=True, text=True, check=True
        ).stdout.strip()
        rel = path.resolve().relative_to(Path(top).resolve()).as_posix()
        shown = subprocess.run(["git", "show", f"{base_ref}:{rel}"], cwd=top, capture_output=True, text=True)
    except (subprocess.CalledProcessError, ValueError, OSError) as exc:
        raise UserError(f"--base {base_ref}: {path} is not in a git checkout ({exc})") from None
    if shown.returncode != 0:
        return None, "new recipe"
    with tempfile.TemporaryDirectory() as scratch:  # the base's DeepSpeed JSON is read from the same ref
        base_file = Path(scratch) / path.name
        base_file.write_text(shown.stdout)
        try:
            recipe = load_recipe(base_file)
        except UserError as exc:  # the base's own header or YAML: no diff, said so, the review goes on
            return None, f"the recipe at {base_ref} could not be read: {str(exc).removeprefix(str(base_file) + ': ')}"
        ds = recipe.data.get("deepspeed")
        if ds:
            ds_rel = (Path(rel).parent / str(ds)).as_posix()
            ds_text = subprocess.run(["git", "show", f"{base_ref}:{ds_rel}"], cwd=top, capture_output=True, text=True)
            if ds_text.returncode == 0:
                (Path(scratch) / str(ds)).parent.mkdir(parents=True, exist_ok=True)
                (Path(scratch) / str(ds)).write_text(ds_text.stdout)
        try:
            return semantic_view(recipe), base_ref
        except UserError as exc:
            return None, f"the recipe at {base_ref} could not be read: {exc}"


def review_recipe(
    path: str | Path,
    hardware: str | None = None,
    model: str | None = None,
    base_ref: str | None = None,
    workdir: str | Path | None = None,
) -> RecipeReview:
    """Every rule runs on any recipe lfa can parse: a missing or unreadable file is one finding, never an abort (the
    other recipes of the same review are still reviewed)."""
    try:
        recipe = load_recipe(path)
        hw = recipe_hardware(recipe, hardware)
    except UserError as exc:
        return RecipeReview(path=str(path), findings=[Finding("error", "unreadable_recipe", str(exc), str(path))])
    lines = key_lines(recipe.text)
    where = recipe_workdir(recipe, workdir)
    unreadable_ds = None
    try:
        plan = plan_from_recipe(recipe, hw, where)
    except UserError:  # an unreadable DeepSpeed JSON or a batch key that is no integer: each has its own finding;
        # the summary plans without what cannot be read
        unreadable_ds = bool(recipe.data.get("deepspeed"))
        readable = {
            k: v for k, v in recipe.data.items() if k != "deepspeed" and (k not in COUNT_KEYS or is_positive_int(v))
        }
        plan = plan_from_recipe(Recipe(recipe.path, readable, recipe.meta, recipe.text), hw)
        try:
            stage, offload = deepspeed_setup(recipe, where)
            plan, unreadable_ds = plan.replace(sharding=stage or "none", offload=offload), False
        except UserError:
            pass
    spec = _model_spec(recipe, model, where)
    review = RecipeReview(path=str(recipe.path))
    review.findings = llamafactory_findings(recipe, lines) + lfa_findings(recipe, hw, plan, lines, spec, where)
    if unreadable_ds:
        review.findings.append(
            Finding(
                "info",
                "memory_without_deepspeed",
                "memory and speed below assume no DeepSpeed: its config could not be read",
                str(recipe.path),
                lines.get("deepspeed", 1),
            )
        )
    review.findings.sort(key=lambda f: (SEVERITIES.index(f.severity), f.line))
    review.summary = summarize(recipe, hw, plan, spec, where)
    if base_ref:
        base, review.base = _base_view(recipe.path, base_ref)
        if base is not None:
            review.diff = semantic_diff(base, semantic_view(recipe))
    return review
