"""The process's one NVML session (pynvml, initialised once): the supervisor's progress line and the trainer's
per-step samples (the plugin) read GPU memory and clocks through it. Imports nothing of lfa's, so the plugin can."""

from __future__ import annotations

import os

_NVML: dict = {}  # the pynvml module once nvmlInit succeeded in this process (or None), and handles by index


def nvml():
    """pynvml, initialised once per process (the supervisor's progress line, the trainer's per-step samples); None
    without a driver or without nvidia-ml-py. Never shut down: NVML ends with the process."""
    if "module" not in _NVML:
        try:
            import pynvml

            pynvml.nvmlInit()
            _NVML["module"] = pynvml
        except Exception:  # no driver (a CPU machine) or no nvidia-ml-py
            _NVML["module"] = None
    return _NVML["module"]


def nvml_handle(index: int):
    """The NVML handle of GPU `index` (opened once), or None."""
    lib = nvml()
    if lib is None:
        return None
    handles = _NVML.setdefault("handles", {})
    if index not in handles:
        try:
            handles[index] = lib.nvmlDeviceGetHandleByIndex(index)
        except Exception:
            handles[index] = None
    return handles[index]


def visible_gpu_indices() -> list[int]:
    """NVML indices of the GPUs this process may use (CUDA_VISIBLE_DEVICES when it lists indices)."""
    lib = nvml()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [int(i) for i in visible.split(",") if i.strip().isdigit()]
    return list(range(lib.nvmlDeviceGetCount())) if lib is not None else []


def gpu_used_gib() -> float | None:
    """Used memory of the visible GPUs through NVML (the largest, GiB), for the live progress line; None without
    a driver. Uses the process's one NVML session (nvml())."""
    lib = nvml()
    handles = [h for h in (nvml_handle(i) for i in visible_gpu_indices()) if h is not None] if lib else []
    if not handles:
        return None
    try:
        return max(lib.nvmlDeviceGetMemoryInfo(h).used for h in handles) / 2**30
    except Exception:
        return None
