"""Benchmarks only (put this folder first on PYTHONPATH): every Python process of a run whose environment has
LFA_BENCH_MEMORY_SNAPSHOT=DIR records the CUDA caching allocator's history and writes it to DIR/snapshot_PID.pickle
at exit (torch.cuda.memory._record_memory_history; read by bench/memory_snapshot/peak_blocks.py)."""

import os

_out = os.environ.get("LFA_BENCH_MEMORY_SNAPSHOT")
if _out:
    import atexit

    import torch

    torch.cuda.memory._record_memory_history(max_entries=int(os.environ.get("LFA_BENCH_SNAPSHOT_ENTRIES", "3000000")))

    def _dump() -> None:
        if torch.cuda.is_initialized() and torch.cuda.memory_allocated() + torch.cuda.max_memory_allocated() > 0:
            torch.cuda.memory._dump_snapshot(os.path.join(_out, f"snapshot_{os.getpid()}.pickle"))

    atexit.register(_dump)
