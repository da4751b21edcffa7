"""`lfa` command line (Click): parse, call the stage functions, print. Exit codes: 0 ok, 1 failed run or
findings, 2 usage or input error."""

from __future__ import annotations

import errno
import functools
import importlib.util
import json
import shlex
import sys
from pathlib import Path

import click

from . import UserError, __version__
from .quoting import comment_text, has_surrogates
from .recipe.keys import REPORT_TO


def _not_utf8_flags(kwargs: dict) -> list[str]:
    """The options and arguments whose value holds bytes that are not UTF-8 (Python's surrogate escapes)."""
    params = {p.name: p for p in click.get_current_context().command.params}
    found = []
    for name, value in kwargs.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, str) and has_surrogates(v) for v in values):
            param = params.get(name)
            found.append(max(param.opts, key=len) if param is not None and param.opts else name)
    return found


def user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            not_text = _not_utf8_flags(kwargs)
            if not_text:  # paths and names lfa writes into recipes and scripts are text
                raise UserError(f"{', '.join(not_text)}: the value is not valid UTF-8 text")
            return fn(*args, **kwargs)
        except UserError as exc:  # messages quote what the user gave: no escape sequence reaches the terminal
            click.echo(f"lfa: error: {comment_text(exc, keep=chr(10))}", err=True)
            sys.exit(2)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:  # a path too long, a folder not writable: one message, no traceback
                where = f" ({comment_text(exc.filename)[:200]})" if exc.filename else ""
                click.echo(f"lfa: error: {exc.strerror or exc}{where}", err=True)
                sys.exit(2)
            click.echo(
                f"lfa: error: the disk is full ({exc.filename or 'writing'}): free space and run the command "
                "again (a training run resumes from its newest complete checkpoint)",
                err=True,
            )
            sys.exit(1)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="lfa")
def main():
    """Fit a paper's full-SFT LLaMA-Factory recipe to your hardware, then keep the run alive.

    \b
    Example:
      lfa detect
      lfa generate --task pseudo2norm --hardware v100-32g -o recipes/mine
      lfa train recipes/mine/train.yaml
    """


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
@user_errors
def detect(as_json, save, no_network, measure_disk):
    """GPUs, CPU, disk, installed training stack and hub reachability.

    Example: lfa detect --save my-box.yaml && lfa generate --task pseudo2norm --hardware my-box.yaml
    """
    from .hardware import detect as run_detect
    from .hardware import save_profile

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
    from .tasks import list_tasks

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
    from .hardware import builtin_profiles, load_profile

    for name in builtin_profiles():
        click.echo(f"{name:14s} {load_profile(name).description}")


def _print_plan(gen_or_result, model, hardware) -> None:
    result = gen_or_result
    c = result.chosen
    click.echo(f"plan: {c.plan.label()}  ({model.name}, {model.num_params / 1e9:.2f} B params, on {hardware.name})")
    for key, why in c.plan.reasons.items():
        click.echo(f"  {key}: {why}")
    click.echo(_memory_heading(hardware))
    for item, gib in c.memory.items.items():
        click.echo(f"  {gib:8.2f}  {item}")
    limit = c.memory.limit_gib
    click.echo(f"  {c.memory.reserved_gib:8.2f}  reserved at peak" + (f" (limit {limit:.2f})" if limit else ""))
    _print_host(c.host)
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


def _memory_heading(hardware) -> str:
    if hardware.has_gpu:
        return "memory per GPU (GiB, predicted):"
    return "memory of each training process (GiB of host RAM, predicted; no GPU):"


def _print_host(host) -> None:
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
    help="Fix a plan field the planner would choose: micro_batch_size, gradient_checkpointing, liger, "
    "attention, deepspeed (zero2|zero3|none), sharding (none|ddp|zero1|zero2|zero3|fsdp2), offload "
    "(none|optimizer|all|nvme-optimizer|nvme-all), optimizer (adamw|adamw_8bit|badam: changes what is "
    "trained), padding_free, token_budget (tokens per micro-batch, 0: fixed micro-batches), checkpoint_layers "
    "(the first k decoder layers recompute, the rest keep activations), alloc_conf.",
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
    from .recipe.generate import GenerateRequest
    from .recipe.generate import generate as run_generate
    from .recipe.render import write_recipe_dir

    if check:
        from .recipe.goldens import check_goldens

        drift = check_goldens(Path(out_dir or "recipes"))
        for line in drift:
            click.echo(line)
        click.echo("golden recipes: " + ("DRIFT" if drift else "up to date"))
        sys.exit(1 if drift else 0)
    if not task:
        raise click.UsageError("--task is required (or --check)")
    if effective_batch is not None:
        if effective_batch < 1:
            raise UserError(
                f"--effective-batch {effective_batch}: must be a positive number of rows per optimizer step"
            )
        sets = (*sets, f"effective_batch_size={effective_batch}")
    out = Path(out_dir or f"recipes/{task}")
    args = (
        ["--task", task]
        + (["--model", model] if model else [])
        + (["--dataset", dataset] if dataset else [])
        + (["--template", template] if template else [])
        + ["--hardware", hardware]
        + (["--gpus", str(gpus)] if gpus else [])
        + (["--precision", precision] if precision else [])
        + (["--allow-packing"] if allow_packing else [])
        + (["--no-sorted-steps"] if no_sorted_steps else [])
        + (["--no-padding-free"] if no_padding_free else [])
        + (["--no-token-budget"] if no_token_budget else [])
        + [x for s in pins for x in ("--pin", s)]
        + (["--allow-optimizer-change"] if allow_optimizer_change else [])
        + (["--nvme-path", nvme_path] if nvme_path else [])
        + (["--launcher", launcher] if launcher != "torchrun" else [])
        + (["--llamafactory-version", llamafactory_version] if llamafactory_version else [])
        + [x for s in sets for x in ("--set", s)]
        + (["--report-to", report_to] if report_to != "none" else [])
    )
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
        pins=tuple(pins),
        launcher=launcher,
        llamafactory_version=llamafactory_version,
        sets=tuple(sets),
        save_steps=save_steps,
        logging_steps=logging_steps,
        command="lfa generate " + shlex.join(args),
        report_to=report_to,
        allow_optimizer_change=allow_optimizer_change,
        nvme_path=nvme_path,
    )
    gen = run_generate(request)
    written = write_recipe_dir(gen.files, out, force=force)
    if as_json:
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
        return
    _print_plan(gen.result, gen.model, gen.hardware)
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
    from .data import profile_dataset
    from .tasks import load_task

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
    from .hardware import load_profile
    from .memory import estimate as run_estimate
    from .memory import host_memory
    from .model_spec import load_model_spec
    from .planner import PlanOptions, plan
    from .recipe.read import load_recipe, plan_from_recipe, recipe_hardware, recipe_model_spec
    from .tasks import load_task

    if recipe:
        r = load_recipe(recipe)
        hw = recipe_hardware(r, hardware)
        p = plan_from_recipe(r, hw)
        spec = recipe_model_spec(r, model=model)
        mem = run_estimate(spec, p, int(r.data.get("cutoff_len", 2048)), hw.gpu.vram_gib if hw.has_gpu else None)
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
        click.echo(_memory_heading(hw))
        for item, gib in mem.items.items():
            click.echo(f"  {gib:8.2f}  {item}")
        limit = mem.limit_gib
        click.echo(
            f"  {mem.reserved_gib:8.2f}  reserved at peak"
            + (f" (limit {limit:.2f}): " + ("fits" if mem.fits else "DOES NOT FIT") if limit else "")
        )
        _print_host(host)
        sys.exit(0 if mem.fits and host.fits else 1)
    if not task:
        raise UserError("give a RECIPE or --task")
    t = load_task(task)
    hw = load_profile(hardware or "detect")
    spec = load_model_spec(model or t.default_model)
    result = plan(spec, hw, t.effective_batch_size, t.cutoff_len, PlanOptions(allow_packing=allow_packing))
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
    _print_plan(result, spec, hw)


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
    from .review.core import review_recipe
    from .review.formats import format_reviews

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
    from .run.doctor import diagnose

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
    from .recipe.diff import format_diff, semantic_diff, semantic_view
    from .recipe.read import load_recipe

    entries = semantic_diff(semantic_view(load_recipe(old)), semantic_view(load_recipe(new)))
    click.echo(format_diff(entries, old, new, fmt), nl=fmt == "json" or fmt == "markdown")


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
):
    """Run RECIPE with llamafactory-cli, watch it, classify failures, retry and resume.

    Example: lfa train recipes/pseudo2norm/v100-32g/train.yaml --max-attempts 3
    """
    from .run.supervisor import TrainRequest, start_detached, supervise

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
    from .review.core import review_recipe

    # what no retry can fix (failures lfa recovers from, like a predicted OOM or bf16 on a V100, do not block)
    fatal = {
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

    from .run.control import all_runs, resolve_run_dir, run_status

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
@click.option("-n", "--lines", type=int, default=40, show_default=True, help="Lines of the newest attempt log first.")
@user_errors
def logs(run, follow, lines):
    """The newest attempt's log of RUN (a run directory or a name under ./runs).

    Example: lfa logs -f v100-32g
    """
    from .run.control import follow_logs, resolve_run_dir

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
    from .run.control import resolve_run_dir, stop_run

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
    from .guard import report_dir_problem
    from .run.control import resolve_run_dir
    from .run.report import summary_lines, write_report

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
    from .demo import build_demo_assets
    from .recipe.generate import GenerateRequest
    from .recipe.generate import generate as run_generate
    from .recipe.render import write_recipe_dir
    from .run.progress import Reporter
    from .run.supervisor import TrainRequest, finish_run, supervise

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
    _print_plan(gen.result, gen.model, gen.hardware)
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
    points = []
    for line in trainer_log.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
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


if __name__ == "__main__":
    main()
