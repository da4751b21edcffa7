"""GPU utilization, SM clock and power over each optimizer step, for the run report.

NVML's utilization is the share of time in its last sample period (1/6 s to 1 s) during which a kernel ran; one
reading at the end of a step says little about the step (the H200 1.3B run read 17-80% while it held 41.7% MFU).
The driver keeps a buffer of its own samples: nvmlDeviceGetSamples returns those taken since a timestamp, so each
step gets the mean, min and max of every sample inside it. Where the buffer is not supported, a thread polls every
POLL_S instead. The NVML session and handle are the process's one (nvml_session.nvml).
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Iterable

POLL_S = 0.1
# nvmlValueType_t -> the c_nvmlValue_t field that holds it
VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def step_summary(util: Iterable[float], clock_mhz: Iterable[float], power_w: Iterable[float], source: str) -> dict:
    """One step's event fields from the samples taken during it; empty when there are none."""
    util, clock_mhz, power_w = list(util), list(clock_mhz), list(power_w)
    if not util:
        return {}
    out = {
        "gpu_util_pct": round(statistics.fmean(util), 1),
        "gpu_util_min": min(util),
        "gpu_util_max": max(util),
        "gpu_util_samples": len(util),
        "gpu_sampling": source,
    }
    if clock_mhz:
        out["gpu_sm_clock_mhz"] = round(statistics.fmean(clock_mhz))
    if power_w:
        out["gpu_power_w"] = round(statistics.fmean(power_w), 1)
    return out


class StepGpuSampler:
    """take() returns the summary of the samples since the previous take() (one optimizer step)."""

    def __init__(self, lib, handle):
        self.lib, self.handle = lib, handle
        self.last_us = {}  # sample kind -> newest timestamp seen (µs, the driver's clock)
        self.kinds = {
            "util": lib.NVML_GPU_UTILIZATION_SAMPLES,
            "clock": lib.NVML_PROCESSOR_CLK_SAMPLES,
            "power": lib.NVML_TOTAL_POWER_SAMPLES,
        }
        self.buffered = self._buffer_supported()
        self._polled: list[tuple[float, float, float]] = []
        self._lock, self._stop = threading.Lock(), threading.Event()
        if not self.buffered:
            threading.Thread(target=self._poll, daemon=True, name="lfa-gpu-sampler").start()
        else:
            for kind in self.kinds:  # start every buffer at now: samples from before training are not a step's
                self._buffer(kind)

    def _buffer_supported(self) -> bool:
        try:
            self.lib.nvmlDeviceGetSamples(self.handle, self.kinds["util"], 0)
            return True
        except Exception:
            return False

    def _buffer(self, kind: str) -> list[float]:
        """The driver's samples of one kind newer than the last seen; [] when there are none or it fails."""
        try:
            value_type, samples = self.lib.nvmlDeviceGetSamples(
                self.handle, self.kinds[kind], self.last_us.get(kind, 0)
            )
        except Exception:  # NVML_ERROR_NOT_FOUND: no sample since the timestamp
            return []
        field = VALUE_FIELDS.get(int(value_type), "uiVal")
        fresh = [s for s in samples if s.timeStamp > self.last_us.get(kind, 0)]
        if fresh:
            self.last_us[kind] = max(s.timeStamp for s in fresh)
        return [float(getattr(s.sampleValue, field)) for s in fresh]

    @staticmethod
    def _read(reading) -> list[float]:
        try:
            return [float(reading())]
        except Exception:
            return []

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                row = (
                    float(self.lib.nvmlDeviceGetUtilizationRates(self.handle).gpu),
                    float(self.lib.nvmlDeviceGetClockInfo(self.handle, self.lib.NVML_CLOCK_SM)),
                    self.lib.nvmlDeviceGetPowerUsage(self.handle) / 1000.0,
                )
            except Exception:
                return
            with self._lock:
                self._polled.append(row)
            self._stop.wait(POLL_S)

    def take(self) -> dict:
        if self.buffered:
            # some drivers keep no clock samples (the H200's did not): one reading at the step's end then
            clock = self._buffer("clock") or self._read(
                lambda: self.lib.nvmlDeviceGetClockInfo(self.handle, self.lib.NVML_CLOCK_SM)
            )
            return step_summary(
                self._buffer("util"), clock, [mw / 1000.0 for mw in self._buffer("power")], "nvml sample buffer"
            )
        with self._lock:
            rows, self._polled = self._polled, []
        return step_summary(
            [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], f"polled every {POLL_S:g} s"
        )

    def stop(self) -> None:
        self._stop.set()


_SAMPLER: dict = {}


def step_sampler(local_rank: int) -> StepGpuSampler | None:
    """This process's sampler for its GPU (created at the first call), None without NVML."""
    if "sampler" not in _SAMPLER:
        from ..nvml_session import nvml, nvml_handle, visible_gpu_indices

        lib = nvml()
        indices = visible_gpu_indices() if lib is not None else []
        handle = nvml_handle(indices[local_rank]) if local_rank < len(indices) else None
        _SAMPLER["sampler"] = StepGpuSampler(lib, handle) if handle is not None else None
    return _SAMPLER["sampler"]
