"""Dataset checks and length profile for alpaca-style jsonl (read once, before a GPU is ever touched)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import UserError

CHARS_PER_TOKEN = 3.0  # code through a BPE tokenizer; only used to guess padding when no tokenizer is loaded


@dataclass(frozen=True)
class DatasetProfile:
    path: str
    rows: int
    mean_chars: float
    truncated_fraction: float  # rows estimated longer than cutoff_len
    mean_seq_fraction: float  # estimated mean(min(len, cutoff)) / cutoff


def profile_dataset(path: str, columns: dict, cutoff_len: int) -> DatasetProfile:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"dataset {path} does not exist or is not a file")
    needed = [columns[k] for k in ("query", "response") if k in columns]
    lengths = []
    try:
        with file.open(encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path}:{number}: not a JSON object ({exc.msg}); expected one alpaca row per line") from None
                if not isinstance(row, dict) or any(col not in row for col in needed):
                    raise UserError(f"{path}:{number}: row lacks the columns {needed} that dataset_info maps")
                lengths.append(sum(len(str(row.get(columns[k], ""))) for k in ("prompt", "query", "response") if k in columns))
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read dataset {path}: {exc}") from None
    if not lengths:
        raise UserError(f"dataset {path} has no rows")
    tokens = [n / CHARS_PER_TOKEN for n in lengths]
    clipped = [min(t, cutoff_len) for t in tokens]
    return DatasetProfile(path=str(file), rows=len(lengths), mean_chars=sum(lengths) / len(lengths),
                          truncated_fraction=sum(t > cutoff_len for t in tokens) / len(tokens),
                          mean_seq_fraction=sum(clipped) / len(clipped) / cutoff_len)
