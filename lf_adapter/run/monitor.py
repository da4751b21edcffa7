"""Stage 8: read a running attempt (log bytes, trainer_log.jsonl, lfa events) and classify how it failed."""

from __future__ import annotations

import json
import math
import re
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from .. import catalog_dir
from ..schema import raise_problems, unknown_keys

MAX_LINE = 4000  # huge lines (a dumped tensor, a base64 blob) are cut, not buffered without bound
NONFINITE_LOGS_TO_STOP = 3
DIVERGENCE_LOGS = 10  # finite losses flat at ln(vocab), or rising, for this many logs: a divergence without NaN
_OOM_FIELDS = {
    "asked_gib": r"Tried to allocate ([\d.]+ [KMG]iB)",
    "capacity_gib": r"total capacity of ([\d.]+ [KMG]iB)",
    "free_gib": r"of which ([\d.]+ [KMG]iB) is free",
    "in_use_gib": r"this process has ([\d.]+ [KMG]iB) memory in use",
    "allowed_gib": r"([\d.]+ [KMG]iB) allowed",  # set_per_process_memory_fraction: the process's own cap
    "allocated_gib": r"([\d.]+ [KMG]iB) is allocated by PyTorch",
    "reserved_unallocated_gib": r"([\d.]+ [KMG]iB) is reserved by PyTorch but unallocated",
}


@dataclass(frozen=True)
class FailureClass:
    name: str
    retriable: bool
    patterns: tuple[re.Pattern, ...]
    ladder: tuple[str, ...]
    advice: str = ""  # what to do, for classes no retry can fix
    stop_at_first_line: bool = False  # the trainer cannot recover by itself: end the attempt as soon as it shows


@dataclass
class Failure:
    kind: str
    retriable: bool
    evidence: list[str]
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@lru_cache(maxsize=1)
def failure_classes() -> tuple[FailureClass, ...]:
    data = yaml.safe_load((catalog_dir() / "failures" / "classes.yaml").read_text())
    keys = ("name", "retriable", "patterns", "ladder", "advice", "stop_at_first_line")
    raise_problems([p for d in data for p in unknown_keys(d, keys, f"{d.get('name', '?')}.")], "failures/classes.yaml")
    return tuple(
        FailureClass(
            d["name"],
            bool(d["retriable"]),
            tuple(re.compile(p, re.M) for p in d["patterns"]),
            tuple(d["ladder"]),
            d.get("advice", ""),
            bool(d.get("stop_at_first_line", False)),
        )
        for d in data
    )


def failure_class(name: str) -> FailureClass:
    return next(c for c in failure_classes() if c.name == name)


def _gib(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"KiB": 2**-20, "MiB": 2**-10, "GiB": 1.0}[unit]


def parse_cuda_oom(text: str) -> dict:
    details = {}
    for key, pattern in _OOM_FIELDS.items():
        match = re.search(pattern, text)
        if match:
            details[key] = round(_gib(match.group(1)), 3)
    return details


def classify(lines: list[str], returncode: int | None) -> Failure | None:
    """The first class (in the table's order) whose pattern matches the log tail; SIGKILL without text is host OOM."""
    text = "\n".join(lines)
    for cls in failure_classes():
        for pattern in cls.patterns:
            match = pattern.search(text)
            if match:
                evidence = [line for line in lines if pattern.search(line)][-3:] or [match.group(0)]
                details = parse_cuda_oom(text) if cls.name == "cuda_oom" else {}
                return Failure(cls.name, cls.retriable, evidence, details)
    if returncode in (-9, 137):
        return Failure(
            "host_oom_kill",
            True,
            [f"trainer killed by SIGKILL (exit {returncode}), no error text: the kernel's OOM killer or a scheduler"],
            {},
        )
    if returncode not in (0, None):
        tail = [line for line in lines if line.strip()][-5:]
        return Failure("unknown", False, tail, {"returncode": returncode})
    return None


def cgroup_oom_kills() -> int | None:
    """The OOM killer's count for this process's cgroup (v2 memory.events oom_kill); None when not readable."""
    try:
        line = next(entry for entry in Path("/proc/self/cgroup").read_text().splitlines() if entry.startswith("0::"))
        events = Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "memory.events"
        for row in events.read_text().splitlines():
            if row.startswith("oom_kill "):
                return int(row.split()[1])
    except (OSError, StopIteration, ValueError):
        return None
    return None


HOST_OOM_RSS_SHARE = 0.85  # a trainer this close to the RAM it may use was plausibly killed for memory


def host_oom_evidence(
    oom_kills_before: int | None, oom_kills_after: int | None, peak_rss_gib: float | None, ram_gib: float | None
) -> str | None:
    """Why a SIGKILL was the host's OOM killer, or None when nothing says so."""
    if oom_kills_before is not None and oom_kills_after is not None and oom_kills_after > oom_kills_before:
        return f"the cgroup's oom_kill count rose from {oom_kills_before} to {oom_kills_after}"
    if peak_rss_gib and ram_gib and peak_rss_gib >= HOST_OOM_RSS_SHARE * ram_gib:
        return f"the trainer's RSS reached {peak_rss_gib:.1f} of {ram_gib:.1f} GiB"
    return None


def unexplained_kill(failure: Failure, why_not: str) -> Failure:
    """A SIGKILL classified host_oom_kill by its text, re-labelled when nothing shows a host OOM."""
    return Failure("killed", True, [*failure.evidence, why_not], failure.details)


class LineReader:
    """Turns appended bytes into lines: tqdm's carriage returns end a line, bad UTF-8 is replaced."""

    def __init__(self, tail: int = 600):
        self._partial = b""
        self.tail: deque[str] = deque(maxlen=tail)

    def feed(self, chunk: bytes) -> list[str]:
        data = (self._partial + chunk).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        parts = data.split(b"\n")
        self._partial = parts.pop()
        if len(self._partial) > MAX_LINE * 4:
            parts.append(self._partial)
            self._partial = b""
        lines = [p.decode("utf-8", errors="replace")[:MAX_LINE] for p in parts]
        self.tail.extend(lines)
        return lines

    def flush(self) -> list[str]:
        return self.feed(b"\n") if self._partial else []


class FileFollower:
    """Reads what was appended to a file since the last call (the file may not exist yet)."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def read_new(self) -> bytes:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return b""
        self.offset += len(data)
        return data


def json_record(line: str) -> dict | None:
    """One line of a JSON-lines file lfa reads (events.jsonl, LLaMA-Factory's trainer_log.jsonl) as an object; None
    for a line cut by a kill, damaged, or holding another JSON value."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _positive(value) -> float | None:
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return float(number) if number is not None and math.isfinite(number) and number > 0 else None


def fold_event(state: dict, event: dict) -> None:
    """Fold one lfa plugin event (events.jsonl) into a progress state: step and total, tokens/s (smoothed over
    steps), loss, torch's peak reserved memory. A field of the wrong type is left out, not trusted."""
    if event.get("event") == "step":
        step = _count(event.get("global_step"))
        state["step"], state["total"] = step, _count(event.get("max_steps"))
        if step is not None:  # several events can arrive in one read: keep the first
            state["first_step"] = min(state.get("first_step") or step, step)
        tokens, seconds = _positive(event.get("step_tokens")), _positive(event.get("step_time_s"))
        if tokens and seconds:
            rate = tokens / seconds
            previous = state.get("tokens_per_s")
            state["tokens_per_s"] = rate if previous is None else 0.7 * previous + 0.3 * rate
        if seconds:
            previous = state.get("step_time_s")
            state["step_time_s"] = seconds if previous is None else 0.7 * previous + 0.3 * seconds
    if event.get("event") == "log" and isinstance(event.get("loss"), (int, float)):
        state["loss"] = event["loss"]
    for key in ("gpu_reserved_gib", "gpu_allocated_gib"):
        if _positive(event.get(key)) is not None:
            state[key] = event[key]


def _finite(value) -> bool:
    return not isinstance(value, (int, float)) or math.isfinite(value)


class TrainerLogWatcher:
    """Follows LLaMA-Factory's trainer_log.jsonl: progress records, and non-finite loss/grad_norm streaks."""

    def __init__(self, path: Path):
        self.follower, self.reader = FileFollower(path), LineReader(tail=50)
        self.last: dict | None = None
        self.nonfinite_streak = 0
        self.last_finite_step: int | None = None  # newest step whose logged loss and grad norm were finite
        self.first_nonfinite_step: int | None = None
        self.losses: deque[float] = deque(maxlen=DIVERGENCE_LOGS)

    def poll(self) -> list[dict]:
        records = []
        for line in self.reader.feed(self.follower.read_new()):
            record = json_record(line)  # json accepts the NaN that LF writes
            if record is None:
                continue
            if "loss" in record or "grad_norm" in record:
                bad = not (_finite(record.get("loss")) and _finite(record.get("grad_norm")))
                self.nonfinite_streak = self.nonfinite_streak + 1 if bad else 0
                step = record.get("current_steps")
                if not bad and isinstance(record.get("loss"), (int, float)):
                    self.losses.append(float(record["loss"]))
                if bad and self.first_nonfinite_step is None:
                    self.first_nonfinite_step = step
                elif not bad and self.first_nonfinite_step is None:
                    self.last_finite_step = step
            self.last = record
            records.append(record)
        return records

    @property
    def diverged(self) -> bool:
        return self.nonfinite_streak >= NONFINITE_LOGS_TO_STOP

    def stalled(self, vocab_size: int | None) -> str | None:
        """Divergence without NaN: the last DIVERGENCE_LOGS finite losses sit at the uniform-distribution value
        ln(vocab) (the model predicts nothing), or rose at every log."""
        if len(self.losses) < DIVERGENCE_LOGS:
            return None
        losses = list(self.losses)
        if vocab_size and all(abs(x - math.log(vocab_size)) < 0.02 * math.log(vocab_size) for x in losses):
            return (
                f"the loss has sat at ln(vocab) = {math.log(vocab_size):.2f} (a uniform guess) for "
                f"{DIVERGENCE_LOGS} logs: the model is not learning (learning rate too high?)"
            )
        if all(b > a for a, b in zip(losses, losses[1:])):
            return f"the loss rose at each of the last {DIVERGENCE_LOGS} logs ({losses[0]:.3f} -> {losses[-1]:.3f})"
        return None
