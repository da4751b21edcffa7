"""What `lfa train` tells people while it runs: a live progress line on a terminal, plain lines otherwise, JSON
events for machines (--json)."""

from __future__ import annotations

import json
import sys

import click


class Reporter:
    """Events for people (a live progress line on a terminal, plain lines otherwise) or machines (--json)."""

    def __init__(self, json_events: bool, live: bool | None = None):
        self.json_events = json_events
        self.live = (not json_events and sys.stdout.isatty()) if live is None else live
        self._live = None

    def event(self, event_name: str, text: str, **data) -> None:
        if self.json_events:
            click.echo(json.dumps({"event": event_name, **data}, default=str))
        elif self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        else:
            click.echo(text, err=event_name in ("failure", "remedy", "error"))

    def progress(self, n: int, state: dict, record: dict | None) -> None:
        """record: a new trainer_log.jsonl line (plain and JSON output report those only); the live line
        also moves with every optimizer step and GPU memory reading."""
        if self.json_events or not self.live:
            if record is not None:
                self.event(
                    "progress",
                    _progress_text(n, state),
                    attempt=n,
                    **record,
                    **{k: v for k, v in state.items() if k not in record},
                )
            return
        from rich.live import Live
        from rich.text import Text

        if self._live is None:
            self._live = Live(Text(""), refresh_per_second=4, transient=False)
            self._live.start()
        self._live.update(Text(_progress_text(n, state)))

    def end_progress(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def _progress_text(n: int, state: dict) -> str:
    step, total = state.get("step"), state.get("total")
    parts = [f"[attempt {n}] step {step if step is not None else '-'}/{total or '-'}"]
    if total and step is not None:
        filled = int(20 * min(step, total) / total)
        parts[0] += " [" + "#" * filled + "." * (20 - filled) + "]"
    if state.get("loss") is not None:
        parts.append(f"loss {state['loss']:.4f}")
    if state.get("lr") is not None:
        parts.append(f"lr {state['lr']:.2e}")
    if state.get("tokens_per_s"):
        parts.append(f"{state['tokens_per_s']:,.0f} tok/s")
    if state.get("eta"):
        parts.append(f"ETA {state['eta']}")
    if state.get("gpu_used_gib") is not None:
        parts.append(f"GPU {state['gpu_used_gib']:.1f} GiB (NVML)")
    elif state.get("gpu_reserved_gib"):
        parts.append(f"GPU {state['gpu_reserved_gib']:.1f} GiB reserved")
    if state.get("memory_warning"):
        parts.append("WARNING: GPU memory above the plan")
    return "  ".join(parts)
