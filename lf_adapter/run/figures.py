"""The run report's figures (matplotlib, PNG): loss, learning rate, speed, memory, one panel per attempt series."""

from __future__ import annotations

import os
from pathlib import Path

from .report import RunReport, failure_label, loss_points, plateau_step, resume_step


def _figure(title: str, rows: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, 1, figsize=(9, 3.2 * rows), sharex=True, squeeze=False)
    fig.suptitle(title)
    return fig, [ax for (ax,) in axes]


def _mark_attempts(ax, report: RunReport) -> None:
    """Attempt boundaries (dotted), resume points (green) and failure markers (red) on a per-step axis."""
    for a in report.attempts:
        s = report.series.get(a.n)
        start = resume_step(a) if resume_step(a) is not None else (s.steps[0] - 1 if s and s.steps else None)
        if start is not None and a.n > 1:
            ax.axvline(start, color="grey", linestyle=":", linewidth=1)
            ax.annotate(
                f"attempt {a.n}",
                (start, 1.0),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                color="grey",
                ha="left",
                va="top",
                rotation=90,
            )
        if resume_step(a) is not None:
            ax.axvline(resume_step(a), color="tab:green", linewidth=1.2, alpha=0.7)
        label = failure_label(a)
        if label:
            at = a.last_step if a.last_step is not None else (s.steps[-1] if s and s.steps else (start or 0))
            ax.axvline(at, color="tab:red", linewidth=1.2, alpha=0.8)
            ax.annotate(
                label,
                (at, 0.5),
                xycoords=("data", "axes fraction"),
                fontsize=8,
                color="tab:red",
                ha="right",
                va="center",
                rotation=90,
            )


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10, color="dimgrey", wrap=True)
    ax.set_yticks([])


def _plot_series(ax, report: RunReport, x: str, y: str, label: str) -> bool:
    drawn = False
    for n, s in report.series.items():
        points = [(a, b) for a, b in zip(getattr(s, x), getattr(s, y)) if b is not None]
        if points:
            ax.plot(
                *zip(*points),
                marker="." if len(points) < 40 else None,
                linewidth=1.2,
                label=f"{label}, attempt {n}" if len(report.series) > 1 else label,
            )
            drawn = True
    return drawn


def _panel(
    ax,
    report: RunReport,
    x: str,
    series: list[tuple[str, str]],
    ylabel: str,
    empty: str,
    references: list[tuple[float, str, str | None]] = (),
    xlabel: str | None = None,
) -> bool:
    """One plot of per-step series (each attempt its own line), horizontal reference lines (value, label, colour),
    the attempts' markers; or a note when there is nothing to draw yet."""
    drawn = False
    for attr, label in series:
        drawn = _plot_series(ax, report, x, attr, label) or drawn
    if drawn:
        for value, label, color in references:
            ax.axhline(value, color=color, linestyle="--", linewidth=1, label=label)
        if len(ax.get_legend_handles_labels()[0]) > 1 or references:
            ax.legend(fontsize=8, loc="best")
        _mark_attempts(ax, report)
    else:
        _no_data(ax, empty)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    return drawn


STEP_AXIS = "optimizer step"


def draw_figures(report: RunReport, out_dir: Path) -> dict[str, Path]:
    """The run's figures as PNGs in out_dir: loss and gradient norm, speed, memory, the GPU's NVML samples, the
    learning rate."""
    last = report.attempts[-1] if report.attempts else None
    predicted = last.predicted if last else {}
    figures = {
        "loss": _loss_figure(report),
        "throughput": _speed_figure(report),
        "memory": _memory_figure(report, predicted),
        "gpu": _gpu_figure(report),
        "lr": _lr_figure(report),
    }
    return _save_figures(figures, out_dir)


def _loss_figure(report: RunReport):
    fig, (ax_loss, ax_grad) = _figure("loss and gradient norm per step", rows=2)
    if _panel(
        ax_loss,
        report,
        "log_steps",
        [("loss", "loss")],
        "loss",
        "no loss logged yet (LLaMA-Factory logs every logging_steps)",
    ):
        steps, values = loss_points(report)
        plateau = plateau_step(steps, values)
        if plateau is not None:
            ax_loss.axvline(plateau, color="tab:orange", linewidth=1.2, alpha=0.8)
            ax_loss.annotate(
                "stopped falling",
                (plateau, 0.95),
                xycoords=("data", "axes fraction"),
                fontsize=8,
                color="tab:orange",
                ha="left",
                va="top",
            )
        previous = report.previous
        if previous is not None and loss_points(previous)[0]:
            ax_loss.plot(
                *loss_points(previous), color="grey", linestyle="--", linewidth=1, label=f"previous run {previous.name}"
            )
            ax_loss.legend(fontsize=8, loc="best")
    _panel(
        ax_grad,
        report,
        "log_steps",
        [("grad_norm", "grad norm")],
        "grad norm",
        "no gradient norm logged yet",
        xlabel=STEP_AXIS,
    )
    return fig


def _speed_figure(report: RunReport):
    fig, (ax,) = _figure("training speed: non-pad tokens per second")
    _panel(
        ax,
        report,
        "steps",
        [("tokens_per_s", "measured")],
        "tokens/s",
        "no optimizer step recorded yet",
        [
            (a.predicted["tokens_per_s"], f"predicted, attempt {a.n} ({a.plan})", None)
            for a in report.attempts
            if a.predicted.get("tokens_per_s")
        ],
        xlabel=STEP_AXIS,
    )
    return fig


def _memory_figure(report: RunReport, predicted: dict):
    fig, (ax_gpu, ax_host) = _figure("memory per step", rows=2)
    gpu_refs = (
        [(predicted["reserved_gib"], f"predicted peak {predicted['reserved_gib']:.1f} GiB", "tab:purple")]
        if predicted.get("reserved_gib")
        else []
    )
    gpu_refs += (
        [(predicted["budget_gib"], f"card {predicted['budget_gib']:.1f} GiB", "tab:red")]
        if predicted.get("budget_gib")
        else []
    )
    _panel(
        ax_gpu,
        report,
        "steps",
        [("gpu_reserved_gib", "reserved (peak so far)"), ("gpu_allocated_gib", "allocated (peak so far)")],
        "GPU GiB",
        "no GPU memory recorded: this run trained on the CPU",
        gpu_refs,
    )
    _panel(
        ax_host,
        report,
        "steps",
        [("host_rss_gib", "trainer RSS (rank 0)")],
        "host GiB",
        "no host memory recorded",
        [(predicted["host_gib"], f"predicted per node {predicted['host_gib']:.1f} GiB", "tab:purple")]
        if predicted.get("host_gib")
        else [],
        xlabel=STEP_AXIS,
    )
    return fig


def _gpu_figure(report: RunReport):
    fig, (ax_util, ax_clock, ax_power) = _figure(
        "GPU per optimizer step (NVML, rank 0): utilization mean and min-max of the step's samples, SM clock, power",
        rows=3,
    )
    no_nvml = "no NVML samples: this run trained on the CPU (or nvidia-ml-py is missing)"
    _panel(ax_util, report, "steps", [("gpu_util_pct", "utilization %")], "utilization %", no_nvml)
    _panel(ax_clock, report, "steps", [("gpu_sm_clock_mhz", "SM clock MHz")], "SM clock MHz", no_nvml)
    _panel(ax_power, report, "steps", [("gpu_power_w", "power W")], "power W", no_nvml, xlabel=STEP_AXIS)
    for s in report.series.values():  # the spread of the samples inside each step
        band = [
            (x, lo, hi)
            for x, lo, hi in zip(s.steps, s.gpu_util_min, s.gpu_util_max)
            if lo is not None and hi is not None
        ]
        if band:
            ax_util.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band], alpha=0.2)
    return fig


def _lr_figure(report: RunReport):
    fig, (ax,) = _figure("learning rate")
    _panel(ax, report, "log_steps", [("lr", "learning rate")], "lr", "no learning rate logged yet", xlabel=STEP_AXIS)
    return fig


def _save_figures(figures: dict, out_dir: Path) -> dict[str, Path]:
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, fig in figures.items():
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        staging = out_dir / f".{name}.png.lfa-tmp"
        fig.savefig(staging, dpi=100, format="png")
        os.replace(staging, path)  # replaces a link named like the figure, never writes through it
        plt.close(fig)
        written[name] = path
    return written
