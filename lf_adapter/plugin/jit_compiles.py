"""Triton compiles a kernel the first time it meets a new specialization (a new block size, an integer argument
that turns divisible by 16, which a micro-batch's token count does now and then), and while it compiles the CPU
launches nothing. Each compile leaves one folder in Triton's cache on this host; the step events count the new
ones, so a slow early step can be told from a slow plan (a warm cache does not compile again)."""

from __future__ import annotations

import os
from pathlib import Path


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels: TRITON_CACHE_DIR, else its default under the home folder."""
    configured = os.environ.get("TRITON_CACHE_DIR", "").strip()
    return Path(configured) if configured else Path.home() / ".triton" / "cache"


def cached_kernels(cache_dir: Path) -> int | None:
    """Compiled kernels in the cache (one folder each); None where there is no cache."""
    try:
        with os.scandir(cache_dir) as entries:
            return sum(1 for entry in entries if entry.is_dir(follow_symlinks=False))
    except OSError:
        return None


class CompileCounter:
    """Counts the kernels Triton compiled into its cache since the last take()."""

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_dir = cache_dir if cache_dir is not None else triton_cache_dir()
        self.seen = cached_kernels(self.cache_dir) or 0

    def take(self) -> dict:
        """This step's compiles ({} where Triton has no cache here: a CPU run never compiles)."""
        now = cached_kernels(self.cache_dir)
        if now is None:
            return {}
        new, self.seen = max(0, now - self.seen), now
        return {"jit_compiles": new}
