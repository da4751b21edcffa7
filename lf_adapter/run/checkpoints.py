"""Checkpoints in output_dir: which are complete, the newest to resume from, setting aside what must not be
resumed."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

from ..guard import foreign_entries


def is_complete_checkpoint(path: Path) -> bool:
    """Every file a resume reads is there, and what can be validated cheaply is whole: trainer_state.json and the
    safetensors index parse as JSON, the weight and optimizer files are not empty (a torn write leaves them short)."""
    weights = [
        path / name
        for name in (
            "model.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
            "pytorch_model.bin.index.json",
        )
        if (path / name).is_file()
    ]
    optimizer = [path / "optimizer.pt"] if (path / "optimizer.pt").is_file() else list(path.glob("global_step*"))
    if not (path / "trainer_state.json").is_file() or not weights or not optimizer:
        return False
    for name in ("trainer_state.json", "model.safetensors.index.json"):
        if (path / name).is_file():
            try:
                json.loads((path / name).read_text())
            except (OSError, ValueError, UnicodeDecodeError):
                return False
    return all(f.is_dir() or f.stat().st_size > 0 for f in [*weights, *optimizer])


def _checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    found = []
    for path in output_dir.glob("checkpoint-*"):
        match = re.fullmatch(r"checkpoint-(\d+)", path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return found


def set_aside_previous_output(output_dir: Path) -> Path | None:
    """--fresh: everything an earlier run left in output_dir (checkpoints, the final model, logs) moves into
    superseded-<time>/ there, so LLaMA-Factory sees an empty folder and nothing is deleted."""
    entries = [p for p in foreign_entries(output_dir) if not p.startswith("superseded-")]
    if not entries:
        return None
    target = output_dir / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
    target.mkdir(exist_ok=True)
    for name in entries:
        (output_dir / name).rename(target / name)
    return target


def set_aside_poisoned_checkpoints(output_dir: Path, last_finite_step: int | None) -> list[str]:
    """After a divergence: a checkpoint holds the weights after its step, which the next step's loss is the first
    to use; only checkpoints before the last step whose logged loss was finite are trusted. The others are renamed
    aside (never deleted), so neither lfa nor LLaMA-Factory's auto-resume picks them."""
    moved = []
    for step, path in _checkpoints(output_dir):
        if last_finite_step is None or step >= last_finite_step:
            aside = path.with_name(f"diverged-{path.name}-{int(time.time())}")
            path.rename(aside)
            moved.append(aside.name)
    return moved


def newest_complete_checkpoint(output_dir: Path, tidy: bool = True) -> Path | None:
    """The highest-step checkpoint that was fully written; incomplete ones are renamed aside, never deleted,
    so LLaMA-Factory's own auto-resume cannot pick them."""
    found = _checkpoints(output_dir)
    best = None
    for _step, path in sorted(found, reverse=True):
        if best is None and is_complete_checkpoint(path):
            best = path
        elif best is None and tidy:
            path.rename(path.with_name(f"incomplete-{path.name}-{int(time.time())}"))
    return best


def content_hash(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]
