"""`lfa` commands, the machine and the data: detect, profiles, tasks, data, demo."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .. import UserError
from . import main, user_errors
from .plans import print_plan


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--save", type=click.Path(dir_okay=False), help="Save the hardware profile (YAML) for --hardware FILE.")
@click.option("--no-network", is_flag=True, help="Skip the hub reachability check.")
@click.option(
    "--measure-disk",
    is_flag=True,
    help="Measure the swap disk's sequential O_DIRECT write/read rates "
    "(1 GiB through a folder lfa creates and removes) for NVMe offload plans; --save keeps them.",
)
@click.option("--force", is_flag=True, help="Let --save replace an existing file.")
@user_errors
def detect(as_json, save, no_network, measure_disk, force):
    """GPUs, CPU, disk, installed training stack and hub reachability.

    Example: lfa detect --save my-box.yaml && lfa generate --task pseudo2norm --hardware my-box.yaml
    """
    from ..hardware import detect as run_detect
    from ..hardware import save_profile

    if save and Path(save).exists() and not force:  # before detecting: a recipe or a hand-edited profile stays
        raise UserError(f"--save {save}: the file exists; pass --force to replace it, or save under another name")
    report = run_detect(check_network=not no_network, measure=measure_disk)
    if save:
        save_profile(report.profile, Path(save))
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    p = report.profile
    if p.has_gpu:
        click.echo(f"GPUs: {p.gpus_per_node} x {p.gpu.name}, interconnect {p.interconnect}")
        for g in report.gpus:
            click.echo(
                f"  [{g['index']}] {g['name']}  {g['total_gib']:.1f} GiB total, {g['free_gib']:.1f} GiB free, "
                f"sm{g['compute_capability']}, bf16={'yes' if g['bf16'] else 'no'}, "
                f"fp16={'yes' if g['fp16'] else 'no'}, NVLink links={g['nvlink_links']}"
            )
    else:
        click.echo("GPUs: none (CPU only)")
    click.echo(f"CPU: {p.cpu_cores} cores, {p.ram_gib:.1f} GiB RAM; disk free: {report.disk_free_gib:.1f} GiB")
    for disk in report.disks:
        kind = {True: "rotational", False: "solid-state", None: "kind unknown"}[disk["rotational"]]
        click.echo(
            f"  disk {disk['device']} at {disk['mountpoint']} ({disk['fstype']}, {kind}): "
            f"{disk['free_gib']:.1f} GiB free"
        )
    if p.disk is not None:
        rates = (
            f"{p.disk.read_gbs:.2f} GB/s read, {p.disk.write_gbs:.2f} GB/s write"
            if p.disk.known_rates
            else "rates not measured (--measure-disk)"
        )
        click.echo(f"NVMe offload would swap to {p.disk.path}: {p.disk.free_gib:.1f} GiB free, {rates}")
    click.echo("software: " + ", ".join(f"{k} {v or '-'}" for k, v in report.software.items()))
    hub = report.hub
    reach = {True: "reachable", False: "NOT reachable", None: "not checked"}[hub["reachable"]]
    click.echo(
        f"hub: {hub['endpoint']} {reach}; HF_ENDPOINT={hub['HF_ENDPOINT'] or '-'} "
        f"HF_HUB_OFFLINE={hub['HF_HUB_OFFLINE'] or '-'}"
    )
    for note in report.notes:
        click.echo(f"note: {note}")


@main.command("tasks")
@click.option("--json", "as_json", is_flag=True)
@user_errors
def tasks_cmd(as_json):
    """List the task definitions (catalog/tasks/*.yaml)."""
    from ..tasks import list_tasks

    tasks = list_tasks()
    if as_json:
        click.echo(
            json.dumps(
                [
                    {
                        "name": t.name,
                        "description": t.description,
                        "default_model": t.default_model,
                        "chat_template": t.chat_template,
                        "hyperparameters": t.hyperparameters,
                    }
                    for t in tasks
                ],
                indent=2,
            )
        )
        return
    for t in tasks:
        hp = t.hyperparameters
        click.echo(f"{t.name:12s} {t.description}")
        click.echo(
            f"{'':12s} model={t.default_model or '(--model)'} template={t.chat_template or '(--template)'} "
            f"lr={hp['learning_rate']} epochs={hp['num_train_epochs']} batch={hp['effective_batch_size']} "
            f"cutoff={hp['cutoff_len']}"
        )


@main.command("profiles")
def profiles_cmd():
    """List the built-in hardware profiles usable with --hardware NAME."""
    from ..hardware import builtin_profiles, load_profile

    for name in builtin_profiles():
        click.echo(f"{name:14s} {load_profile(name).description}")


@main.command("data")
@click.argument("dataset", type=click.Path())
@click.option("--task", default="pseudo2norm", show_default=True, help="Task whose columns, cutoff and batch apply.")
@click.option("--model", help="Local model folder whose tokenizer counts the tokens (default: chars/3, labelled).")
@click.option("--json", "as_json", is_flag=True)
@user_errors
def data_cmd(dataset, task, model, as_json):
    """Token lengths of an alpaca-style jsonl: p50/p90/max, rows truncated at cutoff_len, tokens and steps.

    Example: lfa data data/pseudo2norm.jsonl --model ./llm4decompile-6.7b-v2
    """
    from ..data import profile_dataset
    from ..tasks import load_task

    t = load_task(task)
    cutoff = int(t.hyperparameters["cutoff_len"])
    profile = profile_dataset(dataset, t.dataset.columns, cutoff, model)
    if as_json:
        import dataclasses

        click.echo(
            json.dumps(
                {
                    **dataclasses.asdict(profile),
                    "cutoff_len": cutoff,
                    "steps": profile.steps(
                        t.effective_batch_size, float(t.hyperparameters.get("num_train_epochs", 1.0))
                    ),
                },
                indent=2,
            )
        )
        return
    click.echo(profile.report(cutoff, t.effective_batch_size, float(t.hyperparameters.get("num_train_epochs", 1.0))))


@main.command()
@click.option(
    "--dir",
    "root",
    type=click.Path(file_okay=False),
    default=".lfa/demo",
    show_default=True,
    help="Where the tiny model, sample data, recipe and run go.",
)
@click.option("--rows", type=int, default=256, show_default=True)
@click.option("--max-steps", type=int, default=40, show_default=True)
@user_errors
def demo(root, rows, max_steps):
    """Build the embedded default (tiny DeepSeek-Coder-shaped model + sample pseudo2norm data) and train it.

    Runs on the CPU in about a minute: generate --hardware cpu, then lfa train, then prints the loss curve.
    The demo lowers the effective batch to 8 and raises the learning rate (a random tiny model needs it);
    both overrides are written as comments into the recipe.
    """
    from ..demo import build_demo_assets
    from ..recipe.generate import GenerateRequest
    from ..recipe.generate import generate as run_generate
    from ..recipe.render import write_recipe_dir
    from ..run.progress import Reporter
    from ..run.request import TrainRequest
    from ..run.supervisor import finish_run, supervise

    root_path = Path(root)
    model, data = build_demo_assets(root_path, rows)
    out = root_path / "recipe"
    sets = ("effective_batch_size=8", "learning_rate=1.0e-3", f"max_steps={max_steps}", "cutoff_len=1024")
    gen = run_generate(
        GenerateRequest(
            task="pseudo2norm",
            out_dir=out,
            model=str(model),
            dataset=str(data),
            hardware="cpu",
            sets=sets,
            save_steps=20,
            logging_steps=5,
            command="lfa demo",
        )
    )
    write_recipe_dir(gen.files, out, force=True)
    print_plan(gen.result, gen.model, gen.hardware)
    code = supervise(
        TrainRequest(recipe=out / "train.yaml", run_dir=root_path / "run", name="demo", max_attempts=2, fresh=True),
        finish=False,
    )
    log = out / "saves" / "pseudo2norm" / "trainer_log.jsonl"
    if log.is_file():
        click.echo("loss curve (trainer_log.jsonl):")
        click.echo(loss_curve_text(log))
    finish_run(root_path / "run", Reporter(json_events=False))
    click.echo(
        f"this run: lfa status {root_path / 'run'}; lfa logs {root_path / 'run'}; lfa report {root_path / 'run'}"
    )
    sys.exit(code)


def loss_curve_text(trainer_log: Path, width: int = 40) -> str:
    """One line per logged step: step, loss and a bar scaled between the lowest and highest loss."""
    from ..run.monitor import json_record

    points = []
    for record in filter(None, map(json_record, trainer_log.read_text(errors="replace").splitlines())):
        if isinstance(record.get("loss"), (int, float)) and record["loss"] == record["loss"]:
            points.append((record.get("current_steps"), float(record["loss"])))
    if not points:
        return "  (no loss logged)"
    low, high = min(p[1] for p in points), max(p[1] for p in points)
    span = (high - low) or 1.0
    return "\n".join(
        f"  step {step:>5}  loss {loss:8.4f}  " + "#" * max(1, round(width * (loss - low) / span))
        for step, loss in points
    )
