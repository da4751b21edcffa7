"""Dataset checks and length profile for alpaca-style jsonl (read once, before a GPU is ever touched)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import UserError

CHARS_PER_TOKEN = 3.0  # code through a BPE tokenizer; only used to guess padding when no tokenizer is loaded
ASSUMED_MEAN_SEQ_FRACTION = 0.75  # mean row / cutoff_len where the data was not read (said so where it is used)
QUANTILE_STEPS = 32  # the row-length profile: min(length, cutoff) / cutoff at every 1/32 of the rows, shortest first


@dataclass(frozen=True)
class DatasetProfile:
    path: str
    rows: int
    mean_chars: float
    truncated_fraction: float  # rows longer than cutoff_len
    mean_seq_fraction: float  # mean(min(len, cutoff)) / cutoff
    counted_with: str = f"characters / {CHARS_PER_TOKEN:.0f} (estimate: no local tokenizer)"
    p50_tokens: int = 0
    p90_tokens: int = 0
    max_tokens: int = 0
    truncated_rows: int = 0
    total_tokens: int = 0  # after truncation to cutoff_len: what training sees
    length_quantiles: tuple[float, ...] = ()  # QUANTILE_STEPS + 1 points of min(length, cutoff) / cutoff

    def steps(self, effective_batch: int, epochs: float) -> int:
        """Optimizer steps the trainer takes: each epoch ends with a last, partial batch."""
        import math

        return math.ceil(math.ceil(self.rows / effective_batch) * epochs)

    def report(self, cutoff_len: int, effective_batch: int | None = None, epochs: float | None = None) -> str:
        lines = [
            f"dataset {self.path}: {self.rows:,} rows, tokens counted with {self.counted_with}",
            f"  tokens per row: p50 {self.p50_tokens:,}, p90 {self.p90_tokens:,}, max {self.max_tokens:,}; "
            f"{self.truncated_rows:,} rows ({self.truncated_fraction:.1%}) longer than cutoff_len {cutoff_len} "
            "are truncated",
            f"  {self.total_tokens:,} tokens per epoch after truncation; mean row {self.mean_seq_fraction:.0%} "
            "of cutoff_len",
        ]
        if effective_batch and epochs:
            lines.append(
                f"  {self.steps(effective_batch, epochs):,} optimizer steps for {epochs:g} epoch(s) at "
                f"effective batch {effective_batch}"
            )
        return "\n".join(lines)


def _read_rows(file: Path) -> list[dict]:
    """The rows of a file dataset_problems found nothing wrong with."""
    rows = []
    try:
        with file.open(encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(
                        f"{file}:{number}: not a JSON object ({exc.msg}); expected one alpaca row per line"
                    ) from None
                if not isinstance(row, dict):
                    raise UserError(f"{file}:{number}: a JSON {type(row).__name__}, not an object")
                rows.append(row)
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read dataset {file}: {exc}") from None
    if not rows:
        raise UserError(f"dataset {file} has no rows")
    return rows


def dataset_problems(file: Path, columns: dict, limit: int = 10) -> list[str]:
    """Every problem LLaMA-Factory would trip over (or silently drop a row for) in an alpaca jsonl, as file:line
    messages, at most `limit`: bytes that are not UTF-8, a line that is not a JSON object, a row without the prompt
    or response column, an empty file."""
    response = columns.get("response", "output")
    prompt_parts = [columns.get("prompt", "instruction"), columns.get("query", "input")]
    problems, rows, columns_seen = [], 0, set()
    try:
        with file.open("rb") as fh:
            for number, raw in enumerate(fh, 1):
                if len(problems) >= limit:
                    problems.append(f"{file}: (stopped after {limit} problems)")
                    break
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    problems.append(f"{file}:{number}: bytes that are not UTF-8 at column {exc.start + 1}")
                    continue
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    problems.append(f"{file}:{number}: not a JSON object ({exc.msg} at column {exc.colno})")
                    continue
                if not isinstance(row, dict):
                    problems.append(f"{file}:{number}: a JSON {type(row).__name__}, not an object")
                    continue
                columns_seen.update(row)
                if not isinstance(row.get(response), str) or not row[response]:
                    problems.append(f"{file}:{number}: no '{response}' (LLaMA-Factory would drop the row)")
                    continue
                if not any(isinstance(row.get(c), str) and row[c] for c in prompt_parts):
                    problems.append(
                        f"{file}:{number}: neither '{prompt_parts[0]}' nor '{prompt_parts[1]}' has text "
                        "(LLaMA-Factory would drop the row)"
                    )
                    continue
                rows += 1
    except OSError as exc:
        return [f"cannot read dataset {file}: {exc.strerror or exc}"]
    if rows == 0 and not problems:
        problems.append(f"{file}: no rows")
    if rows and len(problems) < limit:  # a column in no row is missing from the whole table LLaMA-Factory loads
        problems += [
            f"{file}: no row has the column '{name}' that the dataset's columns name (LLaMA-Factory stops with a "
            "KeyError)"
            for name in (*prompt_parts, response)
            if name not in columns_seen
        ]
    return problems


def local_tokenizer(model: str | None):
    """The model's tokenizer when its files are local (never downloads), else None."""
    if not model or not Path(model).is_dir():
        return None
    if not any(
        (Path(model) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)
    except Exception:  # noqa: BLE001 - a tokenizer that will not load means the estimate, labelled as such
        return None


def profile_dataset(path: str, columns: dict, cutoff_len: int, model: str | None = None) -> DatasetProfile:
    """Row lengths in tokens: with the model's own tokenizer when it is local (prompt + query, then response and
    EOS, as the sk2decompile template lays a row out; other templates add a few tokens of their own), else
    characters / 3, labelled as an estimate."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"dataset {path} does not exist or is not a file")
    problems = dataset_problems(file, columns)
    if problems:
        raise UserError(f"dataset {path} would fail or lose rows in LLaMA-Factory:\n  " + "\n  ".join(problems))
    rows = _read_rows(file)
    text = lambda row, keys: "".join(str(row.get(columns[k], "")) for k in keys if k in columns)  # noqa: E731
    chars = [len(text(row, ("prompt", "query", "response"))) for row in rows]
    tokenizer = local_tokenizer(model)
    if tokenizer is not None:
        prompts = tokenizer([text(row, ("prompt", "query")) for row in rows], add_special_tokens=False)["input_ids"]
        answers = tokenizer([text(row, ("response",)) for row in rows], add_special_tokens=False)["input_ids"]
        tokens = [len(p) + len(a) + 1 for p, a in zip(prompts, answers)]
        counted = f"the model's tokenizer ({model})"
    else:
        tokens = [round(n / CHARS_PER_TOKEN) for n in chars]
        counted = f"characters / {CHARS_PER_TOKEN:.0f} (estimate: no local tokenizer)"
    ordered = sorted(tokens)
    clipped = [min(t, cutoff_len) for t in tokens]
    truncated = sum(t > cutoff_len for t in tokens)
    return DatasetProfile(
        path=str(file),
        rows=len(rows),
        mean_chars=sum(chars) / len(chars),
        truncated_fraction=truncated / len(tokens),
        mean_seq_fraction=sum(clipped) / len(clipped) / cutoff_len,
        counted_with=counted,
        p50_tokens=ordered[len(ordered) // 2],
        p90_tokens=ordered[int(len(ordered) * 0.9)],
        max_tokens=ordered[-1],
        truncated_rows=truncated,
        total_tokens=sum(clipped),
        length_quantiles=length_quantiles(clipped, cutoff_len),
    )


def length_quantiles(clipped: list[int], cutoff_len: int) -> tuple[float, ...]:
    """Pure: the clipped row lengths over cutoff_len at every 1/QUANTILE_STEPS of the rows (nearest rank)."""
    ordered = sorted(clipped)
    last = len(ordered) - 1
    return tuple(round(ordered[round(last * k / QUANTILE_STEPS)] / cutoff_len, 4) for k in range(QUANTILE_STEPS + 1))


def row_lengths_from_meta(meta: dict) -> tuple[float, tuple[float, ...]]:
    """The mean row over cutoff_len and the row-length quantiles an lfa-meta header records (lfa generate measured
    them), else the planner's assumption and no profile."""
    return float(meta.get("mean_seq_fraction", ASSUMED_MEAN_SEQ_FRACTION)), quantiles_from_meta(meta)


def quantiles_from_meta(meta: dict) -> tuple[float, ...]:
    """The row-length quantiles an lfa-meta header records; empty where it records none or not a profile (the
    throughput model then prices padding from the mean row alone)."""
    value = meta.get("length_quantiles")
    if not isinstance(value, list) or len(value) != QUANTILE_STEPS + 1:
        return ()
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 < x <= 1.0 for x in value):
        return ()
    return tuple(float(x) for x in value) if all(a <= b for a, b in zip(value, value[1:])) else ()
