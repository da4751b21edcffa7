"""`lfa` commands, checks of recipes and logs: review, diff, doctor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .. import UserError
from . import main, user_errors


@main.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path())
@click.option("--hardware", help="Review against this profile (name, file or detect); default: each recipe's own.")
@click.option("--model", help="Model whose shape to use for memory and speed (default: the recipe's).")
@click.option(
    "--base", "base_ref", metavar="GIT_REF", help="Also show what changed against this git ref (e.g. origin/main)."
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "markdown", "github", "json"]),
    default="text",
    show_default=True,
    help="markdown for a PR comment, github for workflow annotations.",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    help="Where llamafactory-cli will run: LLaMA-Factory "
    "resolves relative paths (deepspeed, dataset_dir, model) against it (default: the recipe's folder for "
    "lfa recipes, else the current directory).",
)
@user_errors
def review(recipes, hardware, model, base_ref, fmt, workdir):
    """Validate recipes with LLaMA-Factory's own argument parsing plus lfa's rules; summarize them for a PR.

    Exit 1 when any recipe has an error finding (file:line in the output).

    Example: lfa review recipes/pseudo2norm/*/train.yaml --base origin/main --format markdown > review.md
    """
    from ..hardware import load_profile
    from ..model_spec import load_model_spec
    from ..review.core import review_recipe
    from ..review.formats import format_reviews

    if hardware:  # a wrong flag is bad input once, not a finding on every recipe
        load_profile(hardware)
    if model:
        load_model_spec(model)
    reviews = [
        review_recipe(path, hardware=hardware, model=model, base_ref=base_ref, workdir=workdir) for path in recipes
    ]
    click.echo(format_reviews(reviews, fmt), nl=False)
    sys.exit(1 if any(r.errors for r in reviews) else 0)


@main.command()
@click.argument("log", type=click.Path())
@click.option(
    "--recipe", type=click.Path(), help="The recipe that produced LOG: write the recipe the next attempt runs."
)
@click.option("--hardware", help="Profile to plan for (default: the recipe's lfa-meta header, or detect).")
@click.option(
    "--out", type=click.Path(dir_okay=False), help="Where to write the next recipe (default: RECIPE.next.yaml)."
)
@click.option("--allow-hparam-change", is_flag=True, help="Let a NaN remedy lower the learning rate.")
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    help="Where llamafactory-cli ran: relative paths in the "
    "recipe resolve against it (default: the recipe's folder for lfa's recipes, else the current directory).",
)
@click.option("--json", "as_json", is_flag=True)
@user_errors
def doctor(log, recipe, hardware, out, allow_hparam_change, workdir, as_json):
    """Diagnose a training log from a run lfa did not supervise (e.g. a nohup'd llamafactory-cli).

    Exit 0 when a remedy exists, 1 when the failure is not retriable, nothing fits or no failure was found, 2 on
    bad input.

    Example: lfa doctor nohup.out --recipe train.yaml --hardware v100-32g
    """
    from ..run.doctor import diagnose

    try:
        d = diagnose(
            Path(log),
            Path(recipe) if recipe else None,
            hardware,
            Path(out) if out else None,
            allow_hparam_change,
            Path(workdir) if workdir else None,
        )
    except UserError as exc:
        if not as_json:
            raise
        click.echo(json.dumps({"error": str(exc)}, indent=2))
        sys.exit(2)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "failure": d.failure.to_dict() if d.failure else None,
                    "remedy": None
                    if d.remedy is None
                    else {
                        "action": d.remedy.action,
                        "why": d.remedy.why,
                        "plan": d.remedy.attempt.plan.label() if d.remedy.attempt else None,
                    },
                    "advice": d.advice,
                    "written": d.written,
                    "env": d.env,
                },
                indent=2,
            )
        )
        sys.exit(d.exit_code)
    if d.failure is None:
        click.echo(f"{log}: no known failure in the log (lfa's classes: catalog/failures/classes.yaml)")
        sys.exit(1)
    f = d.failure
    click.echo(f"{log}: {f.kind} ({'retriable' if f.retriable else 'not retriable'})")
    for line in f.evidence:
        click.echo(f"  evidence: {line.strip()[:400]}")
    if f.details:
        click.echo("  details: " + ", ".join(f"{k} {v}" for k, v in f.details.items()))
    if d.remedy is not None:
        click.echo(("remedy" if d.remedy.attempt else "stop") + f" ({d.remedy.action}): {d.remedy.why}")
    elif d.advice:
        click.echo(d.advice)
    elif recipe:
        click.echo("no remedy applies to this recipe")
    for path in d.written:
        click.echo(f"wrote {path}")
    for line in d.exports:
        click.echo(line)
    if d.written:
        click.echo(f"run it with: lfa train {d.written[0]} (lfa sets these variables and supervises the retries)")
    sys.exit(d.exit_code if recipe else 0 if f.retriable else 1)


@main.command("diff")
@click.argument("old", type=click.Path())
@click.argument("new", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["text", "markdown", "json"]), default="text", show_default=True)
@user_errors
def diff_cmd(old, new, fmt):
    """Semantic diff of two recipes: changes to training results first, then speed/memory, then bookkeeping.

    Example: lfa diff recipes/pseudo2norm/v100-32g/train.yaml recipes/pseudo2norm/v100-32g/train.resolved.yaml
    """
    from ..recipe.diff import format_diff, semantic_diff, semantic_view
    from ..recipe.read import load_recipe

    entries = semantic_diff(semantic_view(load_recipe(old)), semantic_view(load_recipe(new)))
    click.echo(format_diff(entries, old, new, fmt), nl=fmt == "json" or fmt == "markdown")
