"""Communication time of multi-process runs: a torch profiler window over a few optimizer steps on rank 0, the
collectives in it (NCCL kernels on GPUs, gloo's work on CPUs) against the window's wall time; with
LFA_KERNEL_PROFILE=1 (benchmarks) the same window on one process too, GPU kernel time by kind. Collectives overlap
the backward (DDP buckets, ZeRO reduce-scatter), so the share is time spent in communication, not time the step
waited for it."""

from __future__ import annotations

import os
import re
import time

from transformers import TrainerCallback

from . import contract

# the work itself, not the calls that enqueue it (c10d::allreduce_ on the main thread would count it twice)
COLLECTIVE = re.compile(r"^(nccl|gloo:)", re.IGNORECASE)
DEFAULT_WINDOW = (3, 4)  # optimizer steps, after the warm-up steps that allocate and compile
# GPU kernels by what they do (first match wins), for the kernel profile (LFA_KERNEL_PROFILE=1, benchmarks)
KERNEL_KINDS = (
    ("communication", re.compile(r"nccl", re.IGNORECASE)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.IGNORECASE)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.IGNORECASE)),
    ("loss (cross-entropy)", re.compile(r"cross_entropy|log_softmax|nll_loss", re.IGNORECASE)),
    (
        "GEMMs",
        re.compile(r"gemm|cutlass|nvjet|xmma|cublas|matmul|sm\d\d_|^aten::(mm|addmm|bmm|baddbmm)$", re.IGNORECASE),
    ),
    ("norms, activations, RoPE (liger/Triton)", re.compile(r"rms_norm|swiglu|rope|silu|layer_norm", re.IGNORECASE)),
    ("copies, casts, other elementwise", re.compile(r".")),
)


TOP_KERNELS = 12  # the kernels that took longest, by name, beside the kinds
TOP_GAPS = 8  # the longest waits between kernels, with the kernels on either side


def kernel_breakdown(
    events, device: str = "CUDA"
) -> tuple[dict[str, float], list[tuple[float, float, str]], list[list]]:
    """Seconds of the profiler's CUDA kernels (device "CUDA") or of the CPU's operators, each counted without the
    operators it calls (device "CPU"), by KERNEL_KINDS; every kernel's (start, end, name), times in µs (CUDA only:
    operators nest), and the TOP_KERNELS names with the most time as [name, seconds, launches]."""
    seconds: dict[str, float] = {}
    by_name: dict[str, list] = {}
    spans = []
    for event in events:
        if str(getattr(event, "device_type", "")).split(".")[-1] != device:
            continue
        if device == "CUDA":
            start, end = event.time_range.start, event.time_range.end
            spans.append((start, end, event.name))
            took = (end - start) / 1e6
        else:
            took = event.self_cpu_time_total / 1e6
        kind = next(name for name, pattern in KERNEL_KINDS if pattern.search(event.name))
        seconds[kind] = seconds.get(kind, 0.0) + took
        totals = by_name.setdefault(event.name[:120], [0.0, 0])
        totals[0] += took
        totals[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return seconds, spans, [[name, round(s, 4), n] for name, (s, n) in top]


def window_steps(value: str | None) -> tuple[int, int] | None:
    """LFA_COMM_PROFILE_STEPS: "first-last", "off", or unset (the default window)."""
    if value is None or not value.strip():
        return DEFAULT_WINDOW
    if value.strip().lower() == "off":
        return None
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", value)
    if not match or int(match[1]) < 1 or int(match[2]) < int(match[1]):
        return DEFAULT_WINDOW
    return int(match[1]), int(match[2])


def idle_gaps(kernels: list[tuple[float, float, str]], top: int = TOP_GAPS) -> dict:
    """Where the GPU waited between its first and last kernel (µs in): the `top` longest gaps as [ms, ms since the
    first kernel, the kernel before, the kernel after] and the gaps of 1 ms or more (count, seconds): a few long
    ones point at host work or a sync, many short ones at launches the CPU could not keep ahead of."""
    gaps, first, reach, before = [], None, None, ""
    for start, end, name in sorted(kernels):
        if reach is not None and start > reach:
            gaps.append((start - reach, reach - first, before, name))
        if first is None:
            first = start
        if reach is None or end >= reach:
            reach, before = end, name
    long = [gap for gap in gaps if gap[0] >= 1000]
    longest = sorted(gaps, key=lambda gap: -gap[0])[:top]
    return {
        "kernels_span_s": round((reach - first) / 1e6, 4) if kernels else 0.0,
        "gaps_of_1ms": len(long),
        "gaps_of_1ms_s": round(sum(gap[0] for gap in long) / 1e6, 4),
        "longest_gaps": [[round(g / 1e3, 3), round(at / 1e3, 1), a[:80], b[:80]] for g, at, a, b in longest],
    }


def union_seconds(intervals: list[tuple]) -> float:
    """Length of the union of [start, end] intervals (µs in, s out; anything after the end is ignored): concurrent
    buckets count once."""
    total, current_start, current_end = 0.0, None, None
    for start, end, *_ in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total / 1e6


def collective_intervals(events) -> tuple[list[tuple[float, float]], list[str]]:
    """The (start, end) µs of every collective among the profiler's events, and their distinct names."""
    spans, names = [], set()
    for event in events:
        if COLLECTIVE.match(event.name):
            spans.append((event.time_range.start, event.time_range.end))
            names.add(event.name)
    return spans, sorted(names)


class CommProfileCallback(TrainerCallback):
    """Profiles steps first..last on rank 0 of a multi-process run and emits one `comm` event; an attempt that
    resumes past `first` profiles as many steps from where it starts."""

    def __init__(self, emit):
        self.emit, self.window = emit, window_steps(os.environ.get(contract.COMM_PROFILE_STEPS))
        self.kernels = os.environ.get(contract.KERNEL_PROFILE) == "1"
        self.profiler, self.started, self.first, self.last = None, None, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if (
            self.window is None
            or (args.world_size <= 1 and not self.kernels)
            or not state.is_world_process_zero
            or self.profiler is not None
            or state.global_step + 1 < self.window[0]
        ):
            return
        self.first = state.global_step + 1
        self.last = self.first + self.window[1] - self.window[0]
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        if args.world_size <= 1 and torch.cuda.is_available():  # kernels only: less recording on the host
            activities = [ProfilerActivity.CUDA]
        self.profiler = profile(activities=activities)
        self.profiler.__enter__()
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is not None and self.started is not None and state.global_step >= self.last:
            self._finish(args, state)

    def on_train_end(self, args, state, control, **kwargs):
        # training ended inside the window (fewer steps, or a stop): close the profiler, a live one crashes the exit
        if self.profiler is not None and self.started is not None:
            self._finish(args, state)

    def _finish(self, args, state) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started
        self.profiler.__exit__(None, None, None)
        self.started = None  # one window per attempt
        events = self.profiler.events()
        window = {"first_step": self.first, "last_step": state.global_step, "window_s": round(wall, 4)}
        if self.kernels:
            device = "CUDA" if torch.cuda.is_available() else "CPU"
            kinds, kernel_spans, top = kernel_breakdown(events, device)
            # a GPU's busy time is the union of its kernels; a CPU's the sum of its operators' own time
            busy = union_seconds(kernel_spans) if device == "CUDA" else sum(kinds.values())
            self.emit(
                state,
                event="kernels",
                **window,
                device=device.lower(),
                gpu_busy_s=round(busy, 4),
                gpu_idle_s=round(max(0.0, wall - busy), 4),  # launch gaps, host work, syncs
                kinds_s={k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
                top_kernels=top,
                **(idle_gaps(kernel_spans) if device == "CUDA" else {}),
            )
        if args.world_size <= 1:
            return
        spans, names = collective_intervals(events)
        comm = union_seconds(spans)
        self.emit(
            state,
            event="comm",
            **window,
            comm_s=round(comm, 4),
            share=round(comm / wall, 4) if wall else None,
            collectives=len(spans),
            kinds=names[:8],
            world_size=args.world_size,
        )
