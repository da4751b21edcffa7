"""Review output: text, GitHub annotations, Markdown for a pull request, JSON."""

from __future__ import annotations

import json

from ..plan_reasons import duration_text
from ..recipe.diff import format_diff
from .findings import RecipeReview


def format_reviews(reviews: list[RecipeReview], fmt: str) -> str:
    if fmt == "json":
        return json.dumps([r.to_dict() for r in reviews], indent=2, default=str)
    if fmt == "github":
        out = []
        for r in reviews:
            for f in r.findings:
                kind = {"error": "error", "warning": "warning", "info": "notice"}[f.severity]
                out.append(f"::{kind} file={f.file},line={f.line},title=lfa {f.rule}::{f.message}")
        return "\n".join(out) + ("\n" if out else "")
    if fmt == "markdown":
        return _markdown(reviews)
    out = []
    for r in reviews:
        for f in r.findings:
            out.append(f"{f.file}:{f.line}: {f.severity}: [{f.rule}] {f.message}")
        s = r.summary
        if s is None:
            continue
        line = (
            f"{r.path}: {s.plan} on {s.hardware}, effective batch {s.effective_batch}, "
            f"~{s.tokens_per_step:,} tokens/step" + (f" ({s.tokens_basis})" if s.tokens_basis else "")
        )
        if s.reserved_gib is not None:
            line += f", {s.reserved_gib:.1f} of {s.budget_gib:.1f} GiB"
        if s.host_gib is not None:
            line += f", host {s.host_gib:.0f}" + (f" of {s.host_ram_gib:.0f} GiB RAM" if s.host_ram_gib else " GiB RAM")
        if s.predicted_tokens_per_s is not None:
            line += f", ~{s.predicted_tokens_per_s:,} tok/s"
        if s.predicted_wall_time_s is not None:
            line += f", ~{duration_text(s.predicted_wall_time_s)} for {s.dataset_rows:,} rows"
        out.append(line)
        if s.speed_basis is not None:
            out.append(f"  (speed: {s.speed_basis})")
        if r.diff is not None:
            out.append(format_diff(r.diff, f"{r.base}", "this change").rstrip())
        elif r.base:
            out.append(f"  ({r.base})")
    errors = sum(len(r.errors) for r in reviews)
    out.append(
        f"lfa review: {len(reviews)} recipe(s), {errors} error(s), "
        f"{sum(1 for r in reviews for f in r.findings if f.severity == 'warning')} warning(s)"
    )
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _markdown(reviews: list[RecipeReview]) -> str:
    errors = sum(len(r.errors) for r in reviews)
    out = [f"## lfa review: {len(reviews)} recipe(s), " + (f"**{errors} error(s)**" if errors else "no errors"), ""]
    for r in reviews:
        s = r.summary
        out += [f"### `{r.path}`", ""]
        if r.findings:
            out += ["| | line | rule | finding |", "|---|---|---|---|"]
            icon = {"error": "❌", "warning": "⚠️", "info": "ℹ️"}
            out += [
                f"| {icon[f.severity]} {f.severity} | {f.line} | `{f.rule}` | {_cell(f.message)} |" for f in r.findings
            ]
        else:
            out.append("No findings.")
        if s is None:
            continue
        out += [
            "",
            "| plan | effective batch | tokens/step | memory per GPU | host RAM per node | predicted speed "
            "| wall time |",
            "|---|---|---|---|---|---|---|",
            f"| `{s.plan}` on {s.hardware} | {s.effective_batch} = {s.micro_batch} x {s.grad_accum} x "
            f"{s.gpus} | ~{s.tokens_per_step:,} | "
            + (f"{s.reserved_gib:.1f} / {s.budget_gib:.1f} GiB" if s.reserved_gib is not None else "-")
            + " | "
            + (f"{s.host_gib:.0f} / {s.host_ram_gib or 0:.0f} GiB" if s.host_gib is not None else "-")
            + " | "
            + (f"~{s.predicted_tokens_per_s:,} tok/s" if s.predicted_tokens_per_s is not None else "-")
            + " | "
            + (
                f"~{duration_text(s.predicted_wall_time_s)} ({s.dataset_rows:,} rows)"
                if s.predicted_wall_time_s is not None
                else "-"
            )
            + " |",
        ]
        if s.speed_basis is not None:
            out += ["", f"Speed and wall time rest on: {s.speed_basis}."]
        if s.memory_gib is not None:
            out += ["", "<details><summary>memory breakdown (GiB per GPU)</summary>", ""]
            out += [f"- {v:.2f} {k}" for k, v in s.memory_gib.items()] + ["", "</details>"]
        if r.diff is not None:
            out += ["", f"**Changes against `{r.base}`**" + (" (none)" if not r.diff else ""), ""]
            if r.diff:
                out.append(format_diff(r.diff, r.base or "base", r.path, "markdown"))
        elif r.base:
            out += ["", f"_{r.base}_"]
        out.append("")
    return "\n".join(out)
