"""Trainer callbacks lfa adds inside the training process: structured events, and test/bench fault injection.

Environment (set by `lfa train`, or by tests and benchmarks; the names live in contract.py):
  LFA_EVENTS_FILE           append one JSON object per event (rank 0 only)
  LFA_EMULATE_VRAM_GIB      cap the CUDA caching allocator to emulate a smaller card (real CUDA OOMs)
  LFA_INJECT_OOM_ABOVE_MBS  raise torch's real OutOfMemoryError when the micro-batch is larger (CPU tests)
  LFA_INJECT_OOM_MESSAGE    the text of that error (default: an OOM of a 31.73 GiB card)
  LFA_INJECT_NAN_AT_STEP    poison the weights with NaN at this optimizer step (real NaN loss follows), once per
                            output_dir
  LFA_STEP_DELAY_S          sleep this long after each step (gives kill/resume tests a window)
  LFA_SORTED_STEPS          length-sorted micro-batches inside each optimizer step (hooks.py, sampler.py)
  LFA_DROP_PADDING_MASK     no padding mask for right-padded text batches (hooks.drop_right_padding_mask)
  LFA_GC_FREEZE             freeze the objects alive when training starts out of garbage collections (gc_pauses.py)
  LFA_BENCH_SKIP_FINAL_SAVE skip the final save_model after training (benchmarks on a small disk only)
"""

from __future__ import annotations

import atexit
import json
import os
import time
from collections.abc import Mapping

from transformers import TrainerCallback

from . import contract
from .gc_pauses import CollectionClock, freeze_if_asked
from .jit_compiles import CompileCounter
from .token_budget import MICRO_BATCHES

GC_FROZEN = {"objects": None}  # objects frozen out of garbage collections at train begin (None: not asked)
SAMPLER = {"name": None}  # which train sampler the patched trainer built (reported in train_begin)
FIXED_MICRO_BATCH = {"rows": None}  # the recipe's micro-batch when token budgets hand the trainer whole steps
_STEP_TOKENS = {"value": None}  # non-pad tokens of the current optimizer step, a device tensor until read


def record_step_batches(batch_samples, collect_s: float | None = None) -> None:
    """Count the step's non-pad tokens where the trainer collects its micro-batches: the sum stays on the device
    (no sync per micro-batch); the events callback reads it once per optimizer step. Pops the count that the
    collator left where it dropped the padding mask, before the model sees the batch. collect_s: the host's seconds
    to fetch and cut the step's batches (the GPU has nothing queued while the first one is cut)."""
    counts, flat, micro_batches, largest = [], 0, 0, 0
    for batch in batch_samples:
        if not isinstance(batch, Mapping):
            continue
        inner = batch.get(MICRO_BATCHES) or [batch]  # a token-budget step holds its micro-batches
        micro_batches += len(inner)
        # padded tokens of the largest micro-batch: the activations' size the memory model prices (shape, no sync)
        largest = max([largest, *(b["input_ids"].numel() for b in inner if hasattr(b.get("input_ids"), "numel"))])
        flat += sum("cu_seq_lens_q" in b for b in inner)  # flattened (padding-free)
        if "lfa_nonpad_tokens" in batch:
            counts.append(batch.pop("lfa_nonpad_tokens"))
        elif batch.get("attention_mask") is not None and batch["attention_mask"].dim() == 2:
            counts.append((batch["attention_mask"] > 0).sum())
    _STEP_TOKENS["value"] = sum(counts) if counts else None
    _STEP_TOKENS["flat_micro_batches"] = flat
    _STEP_TOKENS["micro_batches"] = micro_batches
    _STEP_TOKENS["largest_micro_batch_tokens"] = largest
    _STEP_TOKENS["batch_collect_s"] = None if collect_s is None else round(collect_s, 4)


def _cuda():
    import torch

    return torch.cuda if torch.cuda.is_available() else None


def apply_memory_emulation() -> None:
    cap = os.environ.get(contract.EMULATE_VRAM_GIB)
    cuda = _cuda()
    if cap and cuda is not None:
        device = int(os.environ.get("LOCAL_RANK", "0"))
        total = cuda.get_device_properties(device).total_memory
        cuda.set_per_process_memory_fraction(float(cap) * 2**30 / total, device)
    atexit.register(_report_peak)


def host_rss_gib() -> tuple[float, float]:
    """(current, peak) resident host memory of this process in GiB; pinned buffers count (they are resident)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    try:
        with open("/proc/self/statm") as fh:
            current = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        current = peak
    return current, peak


def _report_peak() -> None:
    cuda = _cuda()
    line = "LFA_PEAK"
    if cuda is not None and cuda.is_initialized():
        line += (
            f" allocated_gib={cuda.max_memory_allocated() / 2**30:.2f}"
            f" reserved_gib={cuda.max_memory_reserved() / 2**30:.2f}"
        )
    print(f"{line} host_rss_gib={host_rss_gib()[1]:.2f} rank={os.environ.get('RANK', '0')}", flush=True)


def _gpu_step_stats() -> dict:
    """Utilization, SM clock and power of this rank's GPU over the step that just ended (gpu_stats.py)."""
    from .gpu_stats import step_sampler

    sampler = step_sampler(int(os.environ.get("LOCAL_RANK", "0")))
    return sampler.take() if sampler is not None else {}


class EventsCallback(TrainerCallback):
    """Progress as small JSON objects instead of parsed prints."""

    def __init__(self, path: str):
        self.path, self.start, self.last = path, None, None
        self.write_failed = False
        self.collections = CollectionClock()
        self.compiles: CompileCounter | None = None

    def emit(self, state, **event) -> None:
        if not state.is_world_process_zero:
            return
        cuda = _cuda()
        if cuda is not None:
            event["gpu_reserved_gib"] = round(cuda.max_memory_reserved() / 2**30, 3)
            event["gpu_allocated_gib"] = round(cuda.max_memory_allocated() / 2**30, 3)
            # cudaFree + cudaMalloc retries: the allocator ran out of cached blocks (each one synchronizes)
            stats = cuda.memory_stats()
            event["alloc_retries"] = stats.get("num_alloc_retries", 0)
            # cached blocks split off in-use segments at their peak: the allocator's fragmentation
            event["gpu_inactive_split_gib"] = round(stats.get("inactive_split_bytes.all.peak", 0) / 2**30, 3)
            if event.get("event") in ("train_begin", "step"):  # train_begin opens the window of the first step
                event.update(_gpu_step_stats())
        elif os.environ.get(contract.INJECT_PEAK_GIB):  # tests: a GPU peak on a machine without one
            event["gpu_reserved_gib"] = event["gpu_allocated_gib"] = float(os.environ[contract.INJECT_PEAK_GIB])
        event["host_rss_gib"] = round(host_rss_gib()[0], 3)
        event["time"] = time.time()
        if os.environ.get(contract.ATTEMPT, "").isdigit():
            event["attempt"] = int(os.environ[contract.ATTEMPT])
        try:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(event) + "\n")
        except OSError as exc:  # a full disk under the run folder: lose an event, never the training
            if not self.write_failed:
                print(
                    f"lfa: cannot write {self.path} ({exc.strerror or exc}); progress events are lost until it "
                    "can, training goes on",
                    flush=True,
                )
            self.write_failed = True
        else:
            self.write_failed = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.last = time.time()
        self.collections.install()
        self.compiles = CompileCounter()
        self.emit(
            state,
            event="train_begin",
            global_step=state.global_step,
            max_steps=state.max_steps,
            micro_batch_size=args.per_device_train_batch_size,
            grad_accum=args.gradient_accumulation_steps,
            world_size=args.world_size,
            sampler=SAMPLER["name"],
            token_budget=contract.env_count(contract.TOKEN_BUDGET),
            gc_frozen_objects=GC_FROZEN["objects"],
        )

    def on_step_end(self, args, state, control, **kwargs):
        tokens = _STEP_TOKENS["value"]
        # local count x world size: every rank's micro-batches come from the same sorted step (an estimate for N>1)
        tokens = None if tokens is None else int(tokens) * max(1, args.world_size)
        now = time.time()
        self.emit(
            state,
            event="step",
            global_step=state.global_step,
            max_steps=state.max_steps,
            step_time_s=round(now - self.last, 4),
            step_tokens=tokens,
            flat_micro_batches=_STEP_TOKENS.get("flat_micro_batches", 0),
            micro_batches=_STEP_TOKENS.get("micro_batches", 0),
            largest_micro_batch_tokens=_STEP_TOKENS.get("largest_micro_batch_tokens", 0),
            batch_collect_s=_STEP_TOKENS.get("batch_collect_s"),
            **self.collections.take(),
            **(self.compiles.take() if self.compiles is not None else {}),
        )
        self.last = now

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.emit(
            state,
            event="log",
            global_step=state.global_step,
            **{k: v for k, v in (logs or {}).items() if isinstance(v, (int, float, str))},
        )

    def on_save(self, args, state, control, **kwargs):
        self.emit(
            state,
            event="save",
            global_step=state.global_step,
            checkpoint=os.path.join(args.output_dir, f"checkpoint-{state.global_step}"),
        )

    def on_train_end(self, args, state, control, **kwargs):
        self.emit(state, event="train_end", global_step=state.global_step, elapsed_s=round(time.time() - self.start, 3))


class FaultInjectionCallback(TrainerCallback):
    """Faults that cannot happen on a CPU, raised for real inside the trainer so they flow through real logs."""

    def on_step_begin(self, args, state, control, **kwargs):
        limit = os.environ.get(contract.INJECT_OOM_ABOVE_MBS)
        rows = FIXED_MICRO_BATCH["rows"] or args.per_device_train_batch_size
        if limit and rows > int(limit):
            import torch

            need = rows * 0.2467
            raise torch.OutOfMemoryError(
                os.environ.get(contract.INJECT_OOM_MESSAGE)
                or f"CUDA out of memory. Tried to allocate {need:.2f} GiB. GPU 0 has a total capacity of 31.73 GiB "
                f"of which 1.02 GiB is free. Including non-PyTorch memory, this process has 30.71 GiB memory in "
                f"use. Of the allocated memory 29.00 GiB is allocated by PyTorch, and 1.62 GiB is reserved by "
                f"PyTorch but unallocated. If reserved but unallocated memory is large try setting "
                f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
                f"Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
            )

    def on_step_end(self, args, state, control, model=None, **kwargs):
        nan_step = os.environ.get(contract.INJECT_NAN_AT_STEP)
        marker = os.path.join(args.output_dir, "lfa-nan-injected")
        if nan_step and state.global_step == int(nan_step) and model is not None and not os.path.exists(marker):
            import torch

            with open(marker, "w") as fh:  # once per output_dir: a divergence that a resumed retry can get past
                fh.write(str(state.global_step))
            with torch.no_grad():
                for param in model.parameters():
                    param.fill_(float("nan"))
        delay = os.environ.get(contract.STEP_DELAY_S)
        if delay:
            time.sleep(float(delay))


class GracefulStopCallback(TrainerCallback):
    """`lfa stop`, Ctrl-C and a vanished supervisor end training at the next optimizer step with a checkpoint, so
    the work since the last save is kept and the next `lfa train` resumes from it. A second signal stops at once."""

    requested: str | None = None

    def __init__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, self._on_signal)
        supervisor = os.environ.get(contract.SUPERVISOR_PID)
        if supervisor:
            threading.Thread(target=self._watch_supervisor, args=(int(supervisor),), daemon=True).start()

    @classmethod
    def _on_signal(cls, signum, frame):
        import signal

        if cls.requested:  # the second time: stop now, without a checkpoint
            signal.signal(signum, signal.SIG_DFL)
            raise KeyboardInterrupt
        cls.requested = f"signal {signum}"
        print(
            f"lfa: {signal.Signals(signum).name} received: saving a checkpoint at the end of this step, then "
            "stopping (send it again to stop at once)",
            flush=True,
        )

    @classmethod
    def _watch_supervisor(cls, pid: int) -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                print(
                    f"lfa: the supervisor (pid {pid}) is gone: saving a checkpoint and stopping, so that no trainer "
                    "runs on without one (`lfa train` again resumes)",
                    flush=True,
                )
                cls.requested = "supervisor gone"
                return
            except PermissionError:
                pass

    def on_step_end(self, args, state, control, **kwargs):
        requested = GracefulStopCallback.requested is not None
        if args.world_size > 1:  # every rank must stop (and save, a collective) at the same step
            import torch
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
                flag = torch.tensor([1.0 if requested else 0.0], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                requested = flag.item() > 0
        if requested:
            control.should_save = True
            control.should_training_stop = True


class GcFreezeCallback(TrainerCallback):
    """LFA_GC_FREEZE=1: once the model and data are loaded, their objects leave the garbage collector's walks."""

    def on_train_begin(self, args, state, control, **kwargs):
        GC_FROZEN["objects"] = freeze_if_asked()


def build() -> list:
    callbacks = [GcFreezeCallback(), FaultInjectionCallback(), GracefulStopCallback()]
    if os.environ.get(contract.EVENTS_FILE):
        from .comm_profile import CommProfileCallback

        events = EventsCallback(os.environ[contract.EVENTS_FILE])
        callbacks += [events, CommProfileCallback(events.emit)]
    return callbacks
