"""Python's garbage collector as the GPU sees it. A full collection walks every object the process holds (about
600k once LLaMA-Factory, transformers and the data are loaded: 0.3 s on this repo's CI machine), and while it runs
the CPU launches nothing: after the step's sync the GPU waits. lfa's runs (LFA_GC_FREEZE=1, set by launch_env)
move the objects alive when training starts out of the collector's reach (gc.freeze), so collections walk only what
the steps create; the collector still runs. Every run's step events carry the time its collections took."""

from __future__ import annotations

import gc
import os
import time

from . import contract


def freeze_if_asked() -> int | None:
    """Collect once, then freeze what survives: the number of objects frozen, None where the run did not ask."""
    if os.environ.get(contract.GC_FREEZE) != "1":
        return None
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class CollectionClock:
    """Sums the seconds spent in garbage collections (gc.callbacks) until taken."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.seconds, self.full = 0.0, 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        elif self.started is not None:
            self.seconds += time.perf_counter() - self.started
            self.full += info.get("generation") == 2
            self.started = None

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def take(self) -> dict:
        """This step's collections: seconds, and how many walked the oldest generation."""
        taken = {"gc_pause_s": round(self.seconds, 4), "gc_full_collections": self.full}
        self.seconds, self.full = 0.0, 0
        return taken
