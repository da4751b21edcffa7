"""`lfa` commands, plans: generate, estimate, and the plan printout they share with demo."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from pathlib import Path

import click

from .. import UserError
from ..plan import pin_help
from ..recipe.keys import REPORT_TO
from . import main, user_errors


def print_plan(gen_or_result, model, hardware) -> None:
    result = gen_or_result
    c = result.chosen
    click.echo(f"plan: {c.plan.label()}  ({model.name}, {model.num_params / 1e9:.2f} B params, on {hardware.name})")
    for key, why in c.plan.reasons.items():
        click.echo(f"  {key}: {why}")
    print_memory(c.memory, hardware)
    print_host(c.host)
    if result.runners_up:
        click.echo("runners-up:")
        for r in result.runners_up:
            click.echo(
                f"  {r.plan.label():50s} {r.memory.reserved_gib:7.2f} GiB  host {r.host.total_gib:6.1f} GiB  "
                f"{r.tokens_per_s:10,.0f} tok/s"
            )
    if result.rejected:
        click.echo("rejected (do not fit):")
        for r in result.rejected[:3]:
            why = "GPU" if not r.memory.fits else "host RAM"
            click.echo(
                f"  {r.plan.label():50s} {r.memory.reserved_gib:7.2f} GiB  host {r.host.total_gib:6.1f} GiB ({why})"
            )


def print_memory(memory, hardware, verdict: bool = False) -> None:
    """The predicted memory items and the peak against the limit (with verdict: whether it fits)."""
    if hardware.has_gpu:
        click.echo("memory per GPU (GiB, predicted):")
    else:
        click.echo("memory of each training process (GiB of host RAM, predicted; no GPU):")
    for item, gib in memory.items.items():
        click.echo(f"  {gib:8.2f}  {item}")
    limit = memory.limit_gib
    fits = (": fits" if memory.fits else ": DOES NOT FIT") if verdict else ""
    click.echo(f"  {memory.reserved_gib:8.2f}  reserved at peak" + (f" (limit {limit:.2f}){fits}" if limit else ""))


def print_host(host) -> None:
    click.echo(f"host RAM per node (GiB, {host.phase} peaks):")
    for item, gib in host.items.items():
        click.echo(f"  {gib:8.2f}  {item}")
    limit = host.limit_gib
    click.echo(
        f"  {host.total_gib:8.2f}  at peak"
        + (f" (limit {limit:.2f} of {host.ram_gib:.0f}): " + ("fits" if host.fits else "DOES NOT FIT") if limit else "")
    )


@main.command()
@click.option("--task", help="Task name (see `lfa tasks`).")
@click.option("--model", help="Local model folder or a catalog hub id (default: the task's model).")
@click.option("--dataset", type=click.Path(), help="Alpaca-style jsonl (default: data/<task file> beside the recipe).")
@click.option("--template", help="LLaMA-Factory chat template (default: the task's).")
@click.option("--hardware", default="detect", show_default=True, help="Profile name (`lfa profiles`), file, or detect.")
@click.option("--gpus", type=int, help="Use only this many GPUs of the profile.")
@click.option("--precision", type=click.Choice(["bf16", "fp16", "fp32"]), help="Pin the precision.")
@click.option("--allow-packing", is_flag=True, help="Let the planner pack rows (faster; a batch is no longer N rows).")
@click.option(
    "--pin",
    "pins",
    multiple=True,
    metavar="FIELD=VALUE",
    help=pin_help(),
)
@click.option(
    "--allow-optimizer-change",
    is_flag=True,
    help="Let the planner choose a memory-light optimizer (8-bit AdamW, BAdam) when it is faster or the only "
    "thing that fits. It changes what is trained (not the paper's AdamW); `lfa review` flags it.",
)
@click.option("--nvme-path", metavar="DIR", help="Swap folder for NVMe offload (default: the profile's disk path).")
@click.option(
    "--launcher",
    type=click.Choice(["torchrun", "ray"]),
    default="torchrun",
    show_default=True,
    help="How several GPUs/nodes start: LLaMA-Factory's torchrun relaunch or its Ray workers (USE_RAY=1).",
)
@click.option(
    "--llamafactory-version",
    metavar="X.Y.Z",
    help="Write keys for this LLaMA-Factory (default: the installed one; Ray keys changed in 0.9.5).",
)
@click.option(
    "--no-sorted-steps",
    is_flag=True,
    help="Keep random micro-batches (default: sort each step's rows by length into micro-batches).",
)
@click.option(
    "--no-padding-free",
    is_flag=True,
    help="Pad every micro-batch (default on sm80+ GPUs: rows flattened into one sequence, attention kept per row; "
    "exact, no compute on padding).",
)
@click.option(
    "--no-token-budget",
    is_flag=True,
    help="Fixed micro-batches of N rows (default on GPU plans without DeepSpeed: each step's rows cut into "
    "micro-batches by a token budget sized from memory).",
)
@click.option(
    "--no-master-weights",
    is_flag=True,
    help="Keep LLaMA-Factory's fp32 weights under autocast (default on one GPU in bf16/fp16: 16-bit weights in the "
    "model, fp32 master weights, gradients and Adam states in the optimizer, as DeepSpeed keeps them).",
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a task hyper-parameter (learning_rate, effective_batch_size, max_steps...) or add an LF key.",
)
@click.option(
    "--effective-batch",
    type=int,
    help="Rows per optimizer step (default: the task's; pseudo2norm's 64 "
    "= the paper's 8 per device x 8 accumulation, world size unknown). Changing it is a hyper-parameter change.",
)
@click.option("--save-steps", type=int, default=500, show_default=True)
@click.option("--logging-steps", type=int, default=10, show_default=True)
@click.option(
    "--report-to",
    type=click.Choice(["none", "tensorboard", "wandb", "swanlab"]),
    default="none",
    show_default=True,
    help="Experiment tracker, written as LLaMA-Factory's report_to (W&B offline and "
    "SwanLab local unless you say otherwise: this machine may have no internet).",
)
@click.option(
    "-o", "--out", "out_dir", type=click.Path(file_okay=False), help="Recipe folder (default recipes/<task>)."
)
@click.option("--force", is_flag=True, help="Overwrite files in the recipe folder.")
@click.option("--check", is_flag=True, help="Regenerate every golden recipe in recipes/ and fail on drift.")
@click.option("--json", "as_json", is_flag=True)
@user_errors
def generate(
    task,
    model,
    dataset,
    template,
    hardware,
    gpus,
    precision,
    allow_packing,
    pins,
    allow_optimizer_change,
    nvme_path,
    launcher,
    llamafactory_version,
    no_sorted_steps,
    no_padding_free,
    no_token_budget,
    no_master_weights,
    sets,
    effective_batch,
    save_steps,
    logging_steps,
    report_to,
    out_dir,
    force,
    check,
    as_json,
):
    """Render a LLaMA-Factory recipe folder for TASK tailored to the hardware.

    Example: lfa generate --task pseudo2norm --model LLM4Binary/llm4decompile-1.3b-v2 --hardware v100-32g -o out/
    """
    from ..recipe.generate import GenerateRequest
    from ..recipe.generate import generate as run_generate
    from ..recipe.render import write_recipe_dir

    if check:
        _check_goldens(Path(out_dir or "recipes"))
    if not task:
        raise click.UsageError("--task is required (or --check)")
    if effective_batch is not None:
        if effective_batch < 1:
            raise UserError(
                f"--effective-batch {effective_batch}: must be a positive number of rows per optimizer step"
            )
        sets = (*sets, f"effective_batch_size={effective_batch}")
    out = Path(out_dir or f"recipes/{task}")
    request = GenerateRequest(
        task=task,
        out_dir=out,
        model=model,
        dataset=dataset,
        template=template,
        hardware=hardware,
        gpus=gpus,
        allow_packing=allow_packing,
        precision=precision,
        sort_steps=not no_sorted_steps,
        padding_free=not no_padding_free,
        token_budget=not no_token_budget,
        master_weights=not no_master_weights,
        pins=tuple(pins),
        launcher=launcher,
        llamafactory_version=llamafactory_version,
        sets=tuple(sets),
        save_steps=save_steps,
        logging_steps=logging_steps,
        report_to=report_to,
        allow_optimizer_change=allow_optimizer_change,
        nvme_path=nvme_path,
    )
    request.command = "lfa generate " + shlex.join(request.argv())
    gen = run_generate(request)
    written = write_recipe_dir(gen.files, out, force=force)
    if as_json:
        _echo_generated_json(gen, written)
    else:
        _echo_generated(gen, written, report_to)


def _check_goldens(root: Path) -> None:
    """`lfa generate --check`: every golden recipe regenerated and compared; exits 1 on drift."""
    from ..recipe.goldens import check_goldens

    drift = check_goldens(root)
    for line in drift:
        click.echo(line)
    click.echo("golden recipes: " + ("DRIFT" if drift else "up to date"))
    sys.exit(1 if drift else 0)


def _echo_generated_json(gen, written: list[Path]) -> None:
    c = gen.result.chosen
    click.echo(
        json.dumps(
            {
                "files": [str(p) for p in written],
                "plan": c.plan.label(),
                "reasons": c.plan.reasons,
                "memory": c.memory.to_dict(),
                "host": c.host.to_dict(),
                "disk_gib": round(c.disk_gib, 1),
                "predicted_tokens_per_s": c.tokens_per_s,
                "machine_options": gen.listing,
            },
            indent=2,
        )
    )


def _echo_generated(gen, written: list[Path], report_to: str) -> None:
    """The plan, what else runs here, the data report, the files written and a missing tracker package."""
    print_plan(gen.result, gen.model, gen.hardware)
    if gen.memory_note:
        click.echo(f"memory model: {gen.memory_note}")
    for line in gen.listing:
        click.echo(line)
    if gen.dataset is not None:
        hp = gen.hyperparameters
        click.echo(
            gen.dataset.report(
                int(hp["cutoff_len"]), int(hp["effective_batch_size"]), float(hp.get("num_train_epochs", 1.0))
            )
        )
    click.echo("wrote: " + ", ".join(str(p) for p in written))
    tracker = REPORT_TO[report_to]
    if tracker and importlib.util.find_spec(tracker) is None:
        click.echo(
            f"note: --report-to {report_to} needs the {tracker} package where training runs: pip install {tracker}",
            err=True,
        )


@main.command()
@click.argument("recipe", required=False, type=click.Path())
@click.option("--task")
@click.option("--model")
@click.option("--hardware", help="Profile name, file or detect (default: the recipe's).")
@click.option("--allow-packing", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@user_errors
def estimate(recipe, task, model, hardware, allow_packing, as_json):
    """Memory breakdown per GPU of RECIPE, or of the best plan for --task on --hardware.

    Example: lfa estimate recipes/pseudo2norm/v100-32g/train.yaml
    """
    from ..hardware import load_profile
    from ..measured import generate_headroom
    from ..memory import estimate as run_estimate
    from ..memory import host_memory
    from ..model_spec import load_model_spec
    from ..planner import PlanOptions, plan
    from ..recipe.read import load_recipe, plan_from_recipe, recipe_cutoff, recipe_hardware, recipe_model_spec
    from ..tasks import load_task

    if recipe:
        r = load_recipe(recipe)
        hw = recipe_hardware(r, hardware)
        p = plan_from_recipe(r, hw)
        spec = recipe_model_spec(r, model=model)
        mem = run_estimate(
            spec, p, recipe_cutoff(r), hw.gpu.vram_gib if hw.has_gpu else None,
            generate_headroom(spec, hw),
        )  # fmt: skip
        host = host_memory(spec, p, hw)
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "plan": p.label(),
                        "model": spec.name,
                        "params": spec.num_params,
                        **mem.to_dict(),
                        "host": host.to_dict(),
                    },
                    indent=2,
                )
            )
            sys.exit(0 if mem.fits and host.fits else 1)
        click.echo(f"{r.path}: {p.label()} ({spec.name}, {spec.num_params / 1e9:.2f} B params, on {hw.name})")
        print_memory(mem, hw, verdict=True)
        print_host(host)
        sys.exit(0 if mem.fits and host.fits else 1)
    if not task:
        raise UserError("give a RECIPE or --task")
    t = load_task(task)
    hw = load_profile(hardware or "detect")
    spec = load_model_spec(model or t.default_model)
    options = PlanOptions(allow_packing=allow_packing, headroom=generate_headroom(spec, hw))
    result = plan(spec, hw, t.effective_batch_size, t.cutoff_len, options)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "plan": result.chosen.plan.label(),
                    "memory": result.chosen.memory.to_dict(),
                    "runners_up": [
                        {"plan": c.plan.label(), "memory": c.memory.to_dict(), "tokens_per_s": c.tokens_per_s}
                        for c in result.runners_up
                    ],
                },
                indent=2,
            )
        )
        return
    print_plan(result, spec, hw)
