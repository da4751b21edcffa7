"""`lfa` commands, runs: train, status, logs, stop, report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .. import UserError
from . import main, user_errors


@main.command()
@click.argument("recipe", type=click.Path())
@click.option("--run-dir", type=click.Path(file_okay=False), help="Where attempts are recorded (default runs/<name>).")
@click.option("--name", help="Run name (default: the recipe folder's name).")
@click.option(
    "--max-attempts",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Retry budget, the first try included.",
)
@click.option("--allow-hparam-change", is_flag=True, help="Let a NaN remedy lower the learning rate.")
@click.option("--json", "as_json", is_flag=True, help="JSON events on stdout instead of the progress line.")
@click.option("--detach", is_flag=True, help="Run in the background, surviving logout; see lfa status/logs/stop.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="LLaMA-Factory key=value overrides.")
@click.option("--node-rank", type=int, help="Multi-node: this node's rank; run one `lfa train` per node.")
@click.option("--master-addr", help="Multi-node: node 0's address (default: the hardware profile's).")
@click.option("--master-port", type=int, help="Multi-node: the rendezvous port (default: the profile's, 29500).")
@click.option(
    "--hardware",
    help="Plan OOM recovery for this profile (name or file) instead of the recipe's own "
    "(its lfa-meta header, or detect for hand-written recipes).",
)
@click.option(
    "--resume-anyway",
    is_flag=True,
    help="Resume from output_dir's checkpoints although the recipe file "
    "or its dataset changed since they were trained (lfa refuses otherwise).",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="Start from step 0: everything an earlier run left in output_dir "
    "(checkpoints, the final model) moves into superseded-TIME/ there, never deleted.",
)
@click.option(
    "--stop-on-divergence",
    is_flag=True,
    help="Stop the attempt (and retry with a lower learning rate "
    "if --allow-hparam-change) when the loss sits at ln(vocab) or rises for 10 logs; without it lfa warns.",
)
@click.option(
    "--kernel-profile",
    is_flag=True,
    help="Profile optimizer steps 3-4 with the torch profiler (a GPU's kernels, else the CPU's operators): time by "
    "kind and GPU idle, in the summary and report.html (those two steps run a little slower).",
)
@user_errors
def train(
    recipe,
    run_dir,
    name,
    max_attempts,
    allow_hparam_change,
    as_json,
    detach,
    sets,
    node_rank,
    master_addr,
    master_port,
    hardware,
    resume_anyway,
    fresh,
    stop_on_divergence,
    kernel_profile,
):
    """Run RECIPE with llamafactory-cli, watch it, classify failures, retry and resume.

    Example: lfa train recipes/pseudo2norm/v100-32g/train.yaml --max-attempts 3
    """
    from ..run.request import TrainRequest
    from ..run.supervisor import start_detached, supervise

    request = TrainRequest(
        recipe=Path(recipe),
        run_dir=Path(run_dir) if run_dir else None,
        name=name,
        max_attempts=max_attempts,
        allow_hparam_change=allow_hparam_change,
        json_events=as_json,
        overrides=tuple(sets),
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        hardware=hardware,
        fresh=fresh,
        resume_anyway=resume_anyway,
        stop_on_divergence=stop_on_divergence,
        kernel_profile=kernel_profile,
    )
    if detach:
        _refuse_broken_recipe(Path(recipe), hardware)
        run = start_detached(request)
        click.echo(
            f"started run {run.name} in the background (pid {run.pid}); follow it with: lfa status {run.dir}; "
            f"lfa logs -f {run.dir}; lfa stop {run.dir}"
        )
        return
    sys.exit(supervise(request))


def _refuse_broken_recipe(recipe: Path, hardware: str | None) -> None:
    """Before detaching: a recipe LLaMA-Factory or lfa's rules reject would only fail in the background, where the
    user does not see it."""
    from ..review.core import review_recipe

    # what no retry can fix (failures lfa recovers from, like a predicted OOM or bf16 on a V100, do not block)
    fatal = {
        "unreadable_recipe",
        "not_a_count",
        "unknown_key",
        "wrong_type",
        "yaml_boolean",
        "llamafactory_check",
        "dataset_info_missing",
        "dataset_info_invalid",
        "dataset_undefined",
        "model_missing",
        "deepspeed_config",
        "unknown_template",
    }
    errors = [f for f in review_recipe(recipe, hardware=hardware).errors if f.rule in fatal]
    if errors:
        raise UserError(
            f"{recipe} would fail; not started:\n"
            + "\n".join(f"  {f.file}:{f.line}: [{f.rule}] {f.message}" for f in errors)
        )


@main.command()
@click.argument("runs", nargs=-1)
@click.option("--json", "as_json", is_flag=True)
@user_errors
def status(runs, as_json):
    """State of runs (default: every run under ./runs): attempts, step, loss, tokens/s, GPU memory, last failure.

    Example: lfa status runs/v100-32g
    """
    import math

    from ..run.control import all_runs, resolve_run_dir, run_status

    dirs = [resolve_run_dir(r) for r in runs] or all_runs()
    statuses, unreadable = [], []
    for d in dirs:  # one damaged ledger must not hide the other runs
        try:
            statuses.append(run_status(d))
        except UserError as exc:
            unreadable.append(str(exc))
    if as_json:
        finite = lambda v: None if isinstance(v, float) and not math.isfinite(v) else v  # noqa: E731
        click.echo(
            json.dumps(
                [{k: finite(v) for k, v in s.to_dict().items()} for s in statuses]
                + [{"state": "unreadable", "error": e} for e in unreadable],
                indent=2,
                allow_nan=False,
            )
        )
        sys.exit(1 if unreadable else 0)
    if not statuses and not unreadable:
        click.echo("no runs under ./runs")
    for error in unreadable:
        click.echo(f"lfa: {error}", err=True)
    if statuses:
        click.echo(status_table(statuses))
    sys.exit(1 if unreadable else 0)


def status_table(statuses) -> str:
    """One row per run: run, state, attempt, step/total, loss, tok/s, GPU, ETA, started, last failure."""
    import datetime as dt
    import math

    def number(value, fmt):
        return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, fmt)

    header = ("run", "state", "attempt", "step", "loss", "tok/s", "GPU GiB", "ETA", "started", "last failure")
    rows = [header] + [
        (
            s.name,
            s.state,
            str(s.attempts),
            f"{s.step}/{s.total_steps or '-'}" if s.step is not None else "-",
            number(s.loss, ".4f"),
            number(s.tokens_per_s, ",.0f"),
            number(s.gpu_reserved_gib, ".1f"),
            str(dt.timedelta(seconds=round(s.eta_s))) if s.eta_s is not None else "-",
            (s.started or "-").replace("T", " "),
            s.failure or "-",
        )
        for s in statuses
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


@main.command()
@click.argument("run")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the run ends (across retries).")
@click.option(
    "-n",
    "--lines",
    type=click.IntRange(min=0),
    default=40,
    show_default=True,
    help="Lines of the newest attempt log first.",
)
@user_errors
def logs(run, follow, lines):
    """The newest attempt's log of RUN (a run directory or a name under ./runs).

    Example: lfa logs -f v100-32g
    """
    from ..run.control import follow_logs, resolve_run_dir

    try:
        follow_logs(resolve_run_dir(run), follow, lines, sys.stdout)
    except KeyboardInterrupt:
        sys.exit(130)


@main.command()
@click.argument("run")
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds for the graceful stop before everything left is killed.",
)
@user_errors
def stop(run, timeout_s):
    """Stop RUN: the supervisor ends the trainer's whole process group (SIGINT, then SIGTERM, then SIGKILL);
    after --timeout everything left is killed. Exit 1 if a process of the trainer's group survives.

    Example: lfa stop v100-32g
    """
    from ..run.control import resolve_run_dir, stop_run

    what, left = stop_run(resolve_run_dir(run), timeout_s)
    click.echo(f"{run}: {what}" + ("; processes of the trainer's group are still alive" if left else ""))
    sys.exit(1 if left else 0)


@main.command()
@click.argument("run")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    help="Where report.html and the PNGs go (default: the run folder).",
)
@user_errors
def report(run, out_dir):
    """Draw RUN (a run folder or a name under ./runs) into report.html and PNGs: loss, grad norm, tokens/s and
    GPU memory against the plan's prediction, GPU utilization and power, learning rate, the attempts table and the
    recipe diff between the first and last attempt. Works on finished, stopped, crashed and running runs.

    Example: lfa report runs/v100-32g
    """
    from ..guard import report_dir_problem
    from ..run.control import resolve_run_dir
    from ..run.report import summary_lines, write_report

    run_dir = resolve_run_dir(run)
    target = Path(out_dir) if out_dir else None
    problem = report_dir_problem(target.resolve()) if target is not None else None
    if problem:
        raise UserError(problem)
    try:
        result, page = write_report(run_dir, target)
    except PermissionError as exc:
        raise UserError(f"cannot write the report: {exc}") from None
    for line in summary_lines(result, page)[1:]:
        click.echo(line)
