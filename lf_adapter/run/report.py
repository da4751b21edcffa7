"""Stage 11: `lfa report` and the summary that ends `lfa train`: what a run left (ledger.json, the plugin's
events.jsonl, the recipe) read into typed series, drawn with matplotlib into PNGs and one self-contained HTML page.
Works on finished, stopped, crashed and still-running runs: it draws whatever steps exist."""

from __future__ import annotations

import base64
import datetime as dt
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from .. import UserError
from .control import run_state

# per-step numbers of the plugin's step events, read into AttemptSeries lists of the same names
from .ledger import FINAL_STATES, AttemptRecord, RunLedger, read_ledger
from .monitor import json_record

FIGURES = ("loss", "throughput", "memory", "gpu", "lr")  # the PNGs figures.draw_figures writes
STEP_FIELDS = (
    "gpu_reserved_gib",
    "gpu_allocated_gib",
    "gpu_util_pct",
    "gpu_util_min",
    "gpu_util_max",
    "gpu_sm_clock_mhz",
    "gpu_power_w",
    "host_rss_gib",
)
WARMUP_STEPS = 3  # an attempt's first steps include compilation and allocator growth: not steady speed
FAILURE_LABELS = {"cuda_oom": "OOM", "nan_loss": "NaN", "loss_diverged": "diverged"}


@dataclass
class AttemptSeries:
    """What one attempt measured, per optimizer step (steps) and per logging step (log_steps)."""

    n: int
    steps: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    step_seconds: list[float | None] = field(default_factory=list)
    tokens_per_s: list[float | None] = field(default_factory=list)
    gpu_reserved_gib: list[float | None] = field(default_factory=list)
    gpu_allocated_gib: list[float | None] = field(default_factory=list)
    gpu_util_pct: list[float | None] = field(default_factory=list)  # mean over the step's NVML samples
    gpu_util_min: list[float | None] = field(default_factory=list)
    gpu_util_max: list[float | None] = field(default_factory=list)
    gpu_sm_clock_mhz: list[float | None] = field(default_factory=list)
    gpu_power_w: list[float | None] = field(default_factory=list)
    gpu_sampling: str | None = None  # how the utilization was sampled (gpu_stats.py)
    comm: dict | None = None  # the communication profiler's window (plugin/comm_profile.py)
    kernels: dict | None = None  # the kernel profile of that window (lfa train --kernel-profile)
    host_rss_gib: list[float | None] = field(default_factory=list)
    log_steps: list[int] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    grad_norm: list[float | None] = field(default_factory=list)
    lr: list[float | None] = field(default_factory=list)
    final: dict = field(default_factory=dict)  # train_runtime, train_loss, ... of a finished attempt
    world_size: int | None = None

    def steady_tokens_per_s(self) -> float | None:
        rates = [r for s, r in zip(self.steps, self.tokens_per_s) if r]
        rates = rates[WARMUP_STEPS:] or rates
        return statistics.median(rates) if rates else None

    def steady_gpu_util(self) -> float | None:
        """Mean GPU utilization over the steps after warm-up, each step's mean weighted by its duration."""
        pairs = [
            (u, t)
            for u, t in zip(
                self.gpu_util_pct[WARMUP_STEPS:] or self.gpu_util_pct,
                self.step_seconds[WARMUP_STEPS:] or self.step_seconds,
            )
            if u is not None and t
        ]
        return sum(u * t for u, t in pairs) / sum(t for _, t in pairs) if pairs else None


@dataclass
class RunReport:
    name: str
    run_dir: Path
    ledger: RunLedger
    state: str  # the ledger's status, or "running" / "dead" (the supervisor is gone without an end recorded)
    series: dict[int, AttemptSeries]
    recipe_diff: str | None = None
    output_dir: Path | None = None
    tensorboard_dir: Path | None = None
    notes: list[str] = field(default_factory=list)
    previous: RunReport | None = None  # the previous run of the same recipe (previous_run), read once by collect

    @property
    def attempts(self) -> list[AttemptRecord]:
        return self.ledger.attempts


def _finite(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _read_events(path: Path) -> tuple[list[dict], int]:
    """The plugin's events, and how many lines were not events (cut by a kill, or damaged)."""
    if not path.is_file():
        return [], 0
    events, skipped = [], 0
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        event = json_record(line)
        if event is None:
            skipped += line.strip() != ""
        else:
            events.append(event)
    return events, skipped


def _attempt_of(event: dict, attempts: list[AttemptRecord]) -> int | None:
    """The attempt an event belongs to: the plugin stamps it; older runs are placed by the attempts' times."""
    if isinstance(event.get("attempt"), int):
        return event["attempt"]
    t = event.get("time") or 0.0
    for a in reversed(attempts):
        if a.started_at is None or a.started_at <= t:
            return a.n
    return attempts[0].n if attempts else None


def split_events(events: list[dict], attempts: list[AttemptRecord]) -> dict[int, AttemptSeries]:
    series: dict[int, AttemptSeries] = {a.n: AttemptSeries(a.n) for a in attempts}
    for event in events:
        n = _attempt_of(event, attempts)
        if n is None:
            continue
        s = series.setdefault(n, AttemptSeries(n))
        kind = event.get("event")
        if kind == "train_begin":
            s.world_size = event.get("world_size")
        elif kind == "step" and isinstance(event.get("global_step"), int):  # anything else is not a step we drew
            s.steps.append(int(event["global_step"]))
            s.times.append(float(event.get("time") or 0.0))
            tokens, seconds = event.get("step_tokens"), event.get("step_time_s")
            s.tokens_per_s.append(tokens / seconds if tokens and seconds else None)
            s.step_seconds.append(_finite(seconds))
            for name in STEP_FIELDS:
                getattr(s, name).append(_finite(event.get(name)))
            s.gpu_sampling = event.get("gpu_sampling") or s.gpu_sampling
        elif kind == "comm":
            s.comm = event
        elif kind == "kernels":
            s.kernels = event
        elif kind == "log":
            if "train_runtime" in event:
                s.final = {k: v for k, v in event.items() if k.startswith("train_") or k == "total_flos"}
            elif "loss" in event:
                s.log_steps.append(int(event.get("global_step") or 0))
                s.loss.append(_finite(event.get("loss")))
                s.grad_norm.append(_finite(event.get("grad_norm")))
                s.lr.append(_finite(event.get("learning_rate")))
    return dict(sorted(series.items()))


def _recipe_diff(ledger: RunLedger) -> tuple[str | None, Path | None, Path | None, list[str]]:
    """The semantic diff between the recipe as the first and as the last attempt ran it; output_dir; TB folder."""
    from ..recipe.diff import format_diff, semantic_diff, semantic_view
    from ..recipe.read import Recipe, load_recipe

    first, last = (ledger.attempts[0], ledger.attempts[-1]) if len(ledger.attempts) > 1 else (None, None)
    try:
        recipe = load_recipe(ledger.recipe)
    except UserError as exc:
        overrides = (
            None
            if first is None
            else format_diff(semantic_diff(first.overrides, last.overrides), f"attempt {first.n}", f"attempt {last.n}")
        )
        return overrides, None, None, [f"recipe not readable ({exc}): the diff shows lfa's overrides only"]
    # the recipe as the newest attempt ran it (--set keys and remedies are its overrides)
    data = {**recipe.data, **(ledger.attempts[-1].overrides if ledger.attempts else {})}
    output_dir = Path(ledger.output_dir) if ledger.output_dir else (recipe.folder / str(data.get("output_dir", ".")))
    output_dir = output_dir.resolve()
    report_to = data.get("report_to")
    tensorboard = None
    if report_to == "tensorboard" or (isinstance(report_to, list) and "tensorboard" in report_to):
        logging_dir = data.get("logging_dir")
        tensorboard = (recipe.folder / str(logging_dir) if logging_dir else output_dir / "runs").resolve()
    diff = None
    if first is not None:
        views = [
            semantic_view(Recipe(recipe.path, {**recipe.data, **a.overrides}, recipe.meta, recipe.text))
            for a in (first, last)
        ]
        ignore = {"resume_from_checkpoint"}
        diff = format_diff(
            semantic_diff(*({k: v for k, v in view.items() if k not in ignore} for view in views)),
            f"attempt {first.n}",
            f"attempt {last.n}",
        )
    return diff, output_dir, tensorboard, []


def collect(run_dir: Path) -> RunReport:
    """Everything a report shows, read from the run folder; UserError when it holds no run."""
    if not run_dir.is_dir():
        raise UserError(f"no run folder {run_dir}")
    ledger = read_ledger(run_dir)
    state = run_state(ledger)
    state = state if state in FINAL_STATES or state == "dead" else "running"  # new/starting: running, for people
    events, skipped = _read_events(run_dir / "events.jsonl")
    series = split_events(events, ledger.attempts)
    diff, output_dir, tensorboard, notes = _recipe_diff(ledger)
    notes = notes + [f"attempt {a.n}: {a.memory_warning}" for a in ledger.attempts if a.memory_warning]
    bad_steps = sum(1 for e in events if e.get("event") == "step" and not isinstance(e.get("global_step"), int))
    if skipped or bad_steps:
        notes = [
            *notes,
            f"events.jsonl: {skipped} line(s) that are not events and {bad_steps} step event(s) "
            "without an integer step were left out of the plots",
        ]
    report = RunReport(
        ledger.name or run_dir.resolve().name, run_dir, ledger, state, series, diff, output_dir, tensorboard, notes
    )
    report.previous = previous_run(report)
    return report


# ---------------------------------------------------------------- convergence

PLATEAU_MIN_POINTS = 20  # fewer logged losses than this: too few to call a plateau
PLATEAU_TOLERANCE = 0.05  # share of the smoothed loss's whole fall that still counts as "not falling"


def smoothed(values: list[float], width: int) -> list[float]:
    """Running median over `width` points (logged losses are noisy step to step)."""
    half = width // 2
    return [statistics.median(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]


def plateau_step(steps: list[int], losses: list[float]) -> int | None:
    """The step from which the smoothed loss falls by less than PLATEAU_TOLERANCE of its whole fall until the end,
    when that is before the last tenth of the run; None while it is still falling (or too few points)."""
    if len(losses) < PLATEAU_MIN_POINTS:
        return None
    curve = smoothed(losses, max(5, len(losses) // 10))
    fall = max(curve) - min(curve)
    if fall <= 0:
        return None
    later_min = curve[:]
    for i in range(len(curve) - 2, -1, -1):
        later_min[i] = min(curve[i], later_min[i + 1])
    for i, value in enumerate(curve):
        if value - later_min[i] < PLATEAU_TOLERANCE * fall and value - curve[-1] < PLATEAU_TOLERANCE * fall:
            return steps[i] if i < 0.9 * len(curve) else None
    return None


def loss_points(report: RunReport) -> tuple[list[int], list[float]]:
    points = sorted(
        (step, v)
        for series in report.series.values()
        for step, v in zip(series.log_steps, series.loss)
        if v is not None
    )
    return [p[0] for p in points], [p[1] for p in points]


def previous_run(report: RunReport) -> RunReport | None:
    """The latest other run of the same recipe in the same runs folder that ended before this one began."""
    began = min((a.started_at for a in report.attempts if a.started_at), default=None)
    if began is None or not report.ledger.recipe:
        return None
    found = []
    for folder in report.run_dir.resolve().parent.iterdir():
        if folder == report.run_dir.resolve() or not (folder / "ledger.json").is_file():
            continue
        try:
            ledger = read_ledger(folder)
        except UserError:
            continue
        ended = max((a.ended_at for a in ledger.attempts if a.ended_at), default=None)
        if ledger.recipe == report.ledger.recipe and ended is not None and ended <= began:
            found.append((ended, folder))
    if not found:
        return None
    folder = max(found)[1]
    ledger = read_ledger(folder)
    events, _ = _read_events(folder / "events.jsonl")
    return RunReport(ledger.name or folder.name, folder, ledger, ledger.status, split_events(events, ledger.attempts))


# ---------------------------------------------------------------- numbers for people


def failure_label(attempt: AttemptRecord) -> str | None:
    if attempt.status == "stopped":
        return "stop"
    if attempt.failure:
        kind = attempt.failure.get("kind", "failed")
        return FAILURE_LABELS.get(kind, kind)
    return None


def resume_step(attempt: AttemptRecord) -> int | None:
    if not attempt.resumed_from:
        return None
    tail = Path(attempt.resumed_from).name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return str(dt.timedelta(seconds=round(seconds)))


def _wall_time(report: RunReport) -> float | None:
    starts = [a.started_at for a in report.attempts if a.started_at]
    ends = [a.ended_at for a in report.attempts if a.ended_at]
    durations = [a.duration_s for a in report.attempts if a.duration_s]
    return sum(durations) if durations else (max(ends) - min(starts) if starts and ends else None)


def headline(report: RunReport) -> dict:
    """The numbers of the summary block and the page's header (None where the run left nothing to measure)."""
    last = report.attempts[-1] if report.attempts else None
    s = report.series.get(last.n) if last else None
    predicted = last.predicted if last else {}
    steps, values = loss_points(report)
    losses = list(zip(steps, values))
    previous = report.previous
    previous_losses = list(zip(*loss_points(previous))) if previous else []
    gpu = [v for v in (s.gpu_reserved_gib if s else []) if v is not None]
    host = [v for v in (s.host_rss_gib if s else []) if v is not None]
    return {
        "state": report.state,
        "attempts": [
            (a.n, a.status or ("running" if report.state == "running" else "ended"), failure_label(a))
            for a in report.attempts
        ],
        "wall_time_s": _wall_time(report),
        "steady_tokens_per_s": s.steady_tokens_per_s() if s else None,
        "mfu": mfu(s, predicted),
        "gpu_util_mean": s.steady_gpu_util() if s else None,
        "gpu_sampling": s.gpu_sampling if s else None,
        "predicted_tokens_per_s": predicted.get("tokens_per_s"),
        "speed_basis": predicted.get("speed_basis"),
        "peak_gpu_reserved_gib": max(gpu) if gpu else None,
        "predicted_reserved_gib": predicted.get("reserved_gib"),
        "gpu_limit_gib": predicted.get("budget_gib"),
        "peak_host_rss_gib": max(host) if host else None,
        "predicted_host_gib": predicted.get("host_gib"),
        "final_loss": losses[-1][1] if losses else None,
        "final_step": losses[-1][0] if losses else None,
        "train_loss": (s.final.get("train_loss") if s else None),
        "plateau_step": plateau_step(steps, values),
        "previous_run": previous.name if previous else None,
        "previous_loss": previous_losses[-1] if previous_losses else None,
        "last_step": max((a.last_step or 0 for a in report.attempts), default=0) or None,
    }


def mfu(s: AttemptSeries | None, predicted: dict) -> float | None:
    """Model FLOPs utilization of the steady steps: tokens/s x FLOPs per token over the GPUs' 16-bit peak."""
    rate = s.steady_tokens_per_s() if s else None
    if not rate or not predicted.get("flops_per_token") or not predicted.get("peak_tflops"):
        return None
    return rate * predicted["flops_per_token"] / (predicted["peak_tflops"] * 1e12)


def _versus(measured: float | None, predicted: float | None, unit: str, digits: int = 0) -> str:
    if measured is None:
        return "not measured"
    text = f"{measured:,.{digits}f} {unit}"
    if predicted:
        text += f" (predicted {predicted:,.{digits}f}, {100 * (measured - predicted) / predicted:+.0f}%)"
    return text


def summary_lines(report: RunReport, report_path: Path | None) -> list[str]:
    """The block that ends `lfa train` and `lfa demo`."""
    h = headline(report)
    outcomes = (
        ", ".join(
            f"{n}: {status}" + (f" ({label})" if label and status != "stopped" else "")
            for n, status, label in h["attempts"]
        )
        or "none"
    )
    lines = [
        "",
        f"run {report.name}: {report.state}",
        f"  attempts     {outcomes}",
        f"  wall time    {_duration(h['wall_time_s'])}",
        f"  tokens/s     {_versus(h['steady_tokens_per_s'], h['predicted_tokens_per_s'], 'steady')}",
    ]
    if h["speed_basis"] and h["predicted_tokens_per_s"]:
        lines.append(f"               (prediction: {h['speed_basis']})")
    if h["gpu_util_mean"] is not None:
        lines.append(
            f"  GPU busy     {h['gpu_util_mean']:.0f}% of the time (NVML, {h['gpu_sampling']}, mean after "
            f"warm-up)" + (f"; MFU {h['mfu']:.1%}" if h["mfu"] is not None else "")
        )
    kernels = kernel_line(report)
    if kernels:
        lines.append(f"  profile      {kernels}")
    if h["peak_gpu_reserved_gib"] is not None:
        limit = f", card {h['gpu_limit_gib']:.1f} GiB" if h["gpu_limit_gib"] else ""
        lines.append(
            f"  GPU memory   {_versus(h['peak_gpu_reserved_gib'], h['predicted_reserved_gib'], 'GiB reserved', 2)}"
            f"{limit}"
        )
    else:
        lines.append(f"  host memory  {_versus(h['peak_host_rss_gib'], None, 'GiB trainer RSS (no GPU)', 2)}")
    lines += [f"  WARNING      attempt {a.n}: {a.memory_warning}" for a in report.ledger.attempts if a.memory_warning]
    loss = "-" if h["final_loss"] is None else f"{h['final_loss']:.4f} at step {h['final_step']}"
    lines.append(
        f"  final loss   {loss}"
        + (
            f"; the loss stopped falling around step {h['plateau_step']} (smoothed, "
            f"within {PLATEAU_TOLERANCE:.0%} of its fall)"
            if h["plateau_step"] is not None
            else ""
        )
    )
    if h["previous_loss"] is not None:
        step, value = h["previous_loss"]
        lines.append(f"  previous run {h['previous_run']} of this recipe: final loss {value:.4f} at step {step}")
    if report.output_dir is not None:
        checkpoints = sorted(Path(report.output_dir).glob("checkpoint-*")) if report.state != "succeeded" else []
        lines.append(
            f"  model        {report.output_dir}"
            + (
                ""
                if report.state == "succeeded"
                else f" (checkpoints only, newest {checkpoints[-1].name}: the run did not finish)"
                if checkpoints
                else " (nothing to use: the run did not finish and left no checkpoint)"
            )
        )
    if report_path is not None:
        lines.append(f"  report       {report_path}")
    return lines


# ---------------------------------------------------------------- figures


# ---------------------------------------------------------------- the page


def attempts_rows(report: RunReport) -> list[dict]:
    rows = []
    for a in report.attempts:
        failure = a.failure or {}
        rows.append(
            {
                "attempt": a.n,
                "plan": a.plan,
                "status": a.status or report.state,
                "failure": failure.get("kind"),
                "evidence": evidence_message(failure.get("evidence") or []),
                "remedy": f"{a.remedy['action']}: {a.remedy['why']}" if a.remedy else None,
                "duration": _duration(
                    a.duration_s or ((a.ended_at - a.started_at) if a.ended_at and a.started_at else None)
                ),
                "steps": f"{a.first_step}-{a.last_step}" if a.last_step is not None else "none",
                "resumed from": Path(a.resumed_from).name if a.resumed_from else None,
            }
        )
    return rows


def communication_note(report: RunReport) -> str:
    worlds = {s.world_size for s in report.series.values() if s.world_size}
    if not worlds or worlds == {1}:
        return "0: one process exchanges no gradients."
    measured = [(n, s.comm) for n, s in report.series.items() if s.comm and s.comm.get("share") is not None]
    if not measured:
        return (
            f"{max(worlds)} processes: not measured (the profiler's window, optimizer steps 3-4 unless "
            "LFA_COMM_PROFILE_STEPS says otherwise, was not reached, or was turned off)."
        )
    n, c = measured[-1]
    return (
        f"{c['world_size']} processes: collectives ran {c['share']:.1%} of optimizer steps {c['first_step']}-"
        f"{c['last_step']} of attempt {n} ({c['comm_s']:.3f} of {c['window_s']:.3f} s; torch profiler on rank 0: "
        f"{', '.join(c.get('kinds') or [])}). They overlap the backward, so this is the time spent in "
        "communication, not all of it time the step waited for."
    )


def kernel_profile(report: RunReport) -> dict | None:
    """The newest attempt's kernel profile (lfa train --kernel-profile) as shares of its window's wall time."""
    measured = [(n, s.kernels) for n, s in report.series.items() if s.kernels and s.kernels.get("window_s")]
    if not measured:
        return None
    n, k = measured[-1]
    wall = k["window_s"]
    on_gpu = k.get("device", "cuda") == "cuda"
    idle, idle_why = ("GPU idle", "no kernel running") if on_gpu else ("outside operators", "Python, data loading")
    rows = [(kind, seconds, seconds / wall) for kind, seconds in k["kinds_s"].items()]
    rows.append((f"{idle} ({idle_why})", k["gpu_idle_s"], k["gpu_idle_s"] / wall))
    source = "GPU kernels" if on_gpu else "CPU operators"
    return {
        "attempt": n,
        "steps": f"{k['first_step']}-{k['last_step']}",
        "window_s": wall,
        "source": source,
        "what": source if on_gpu else f"{source} (each without the operators it calls)",
        "idle": idle,
        "rows": rows,
        "top": k.get("top_kernels") or [],
        "gaps": k.get("longest_gaps") or [],  # [ms, ms since the first kernel, kernel before, kernel after]
        "gaps_of_1ms": (k.get("gaps_of_1ms"), k.get("gaps_of_1ms_s")),
        "kernels_span_s": k.get("kernels_span_s"),
    }


def kernel_line(report: RunReport) -> str | None:
    """One summary line: the kinds that took at least 5% of the profiled steps, and the idle share."""
    profile = kernel_profile(report)
    if profile is None:
        return None
    parts = [f"{kind} {share:.0%}" for kind, _, share in profile["rows"][:-1] if share >= 0.05]
    idle_share = profile["rows"][-1][2]
    return (
        f"steps {profile['steps']} of attempt {profile['attempt']} ({profile['source']}): "
        + ", ".join(parts)
        + f"; {profile['idle']} {idle_share:.0%}"
    )


def evidence_message(lines: list[str]) -> str | None:
    """The line of a failure's evidence that says what went wrong: the exception's message, not the source line
    that raised it."""
    stripped = [line.strip() for line in lines if line and line.strip()]
    messages = [line for line in stripped if not line.startswith(("raise ", "File ", "^"))]
    return (messages or stripped or [None])[-1]


# LLaMA-Factory's end-of-run figures that do not say what they are
FINAL_LABELS = {
    "train_loss": "train_loss (the mean over the whole run, not the last loss)",
    "train_runtime": "train_runtime (s, this attempt)",
}


def render_html(report: RunReport, figures: dict[str, Path]) -> str:
    """The self-contained page (templates/report/run.html.j2, autoescaped): every value below is escaped there."""
    import jinja2
    import markupsafe

    from .. import templates_dir
    from ..guard import REPORT_MARK

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir() / "report")),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    env.filters["cell"] = lambda value: "-" if value is None or value == "" else str(value)
    finals = {n: s.final for n, s in report.series.items() if s.final}
    final = None
    if finals:
        n, values = max(finals.items())
        final = {
            "attempt": n,
            "rows": [(FINAL_LABELS.get(k, k), round(v, 4) if isinstance(v, float) else v) for k, v in values.items()],
        }
    last = report.attempts[-1] if report.attempts else None
    memory = (
        {
            "attempt": last.n,
            "plan": last.plan,
            "rows": list(last.predicted["memory_gib"].items()),
            "reserved_gib": last.predicted["reserved_gib"],
        }
        if last and last.predicted.get("memory_gib")
        else None
    )
    return env.get_template(
        "run.html.j2"
    ).render(
        generator_mark=markupsafe.Markup(REPORT_MARK),  # what lets lfa report --out overwrite its own page
        name=report.name,
        state=report.state,
        recipe=report.ledger.recipe,
        run_dir=str(report.run_dir),
        output_dir=str(report.output_dir) if report.output_dir else None,
        tensorboard_dir=str(report.tensorboard_dir) if report.tensorboard_dir else None,
        summary="\n".join(summary_lines(report, None)[1:]),
        attempts=attempts_rows(report),
        error=report.ledger.error,
        notes=report.ledger.notes + report.notes,
        figures=[
            {"name": name, "data": base64.b64encode(figures[name].read_bytes()).decode()}
            for name in FIGURES
            if name in figures
        ],
        communication=communication_note(report),
        kernels=kernel_profile(report),
        final=final,
        memory=memory,
        recipe_diff=report.recipe_diff,
    )


def write_report(run_dir: Path, out_dir: Path | None = None) -> tuple[RunReport, Path]:
    """PNGs and report.html in out_dir (default: the run folder). Returns the report and the page's path."""
    from .figures import draw_figures  # figures reads this module's series

    report = collect(run_dir)
    out_dir = out_dir or run_dir
    try:
        figures = draw_figures(report, out_dir)
    except ImportError:
        raise UserError("lfa report draws with matplotlib: pip install matplotlib") from None
    page = out_dir / "report.html"
    staging = out_dir / ".report.html.lfa-tmp"
    staging.write_text(render_html(report, figures))
    os.replace(staging, page)
    return report, page
