"""The per-step GPU sampler (lf_adapter/plugin/gpu_stats.py). No GPU here: an object with pynvml's names stands in
for the driver, serving a sample buffer as NVML does (samples newer than the timestamp asked for)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from lf_adapter.plugin.gpu_stats import StepGpuSampler, step_summary


class FakeNvml:
    NVML_GPU_UTILIZATION_SAMPLES, NVML_PROCESSOR_CLK_SAMPLES, NVML_TOTAL_POWER_SAMPLES = 4, 6, 0
    NVML_CLOCK_SM = 1

    def __init__(self, buffered: bool):
        self.buffered, self.buffers, self.calls = buffered, {4: [], 6: [], 0: []}, 0
        self.now_us = 1_000

    def add(self, util: int, clock: int, power_mw: int) -> None:
        self.now_us += 100_000
        for kind, value in ((4, util), (6, clock), (0, power_mw)):
            self.buffers[kind].append(SimpleNamespace(timeStamp=self.now_us, sampleValue=SimpleNamespace(uiVal=value)))

    def nvmlDeviceGetSamples(self, handle, kind, last_seen):
        if not self.buffered:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        fresh = [s for s in self.buffers[kind] if s.timeStamp > last_seen]
        if not fresh:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return 1, fresh  # NVML_VALUE_TYPE_UNSIGNED_INT

    def nvmlDeviceGetUtilizationRates(self, handle):
        self.calls += 1
        return SimpleNamespace(gpu=50 + 10 * (self.calls % 2))

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return 1980

    def nvmlDeviceGetPowerUsage(self, handle):
        return 450_000


def test_each_step_gets_the_mean_and_spread_of_the_drivers_samples_inside_it():
    lib = FakeNvml(buffered=True)
    lib.add(90, 1900, 400_000)  # before training: not part of any step
    sampler = StepGpuSampler(lib, handle=object())
    assert sampler.buffered and sampler.take() == {}
    for util in (20, 80, 95, 100):
        lib.add(util, 1980, 600_000)
    step = sampler.take()
    assert step["gpu_util_pct"] == 73.8 and (step["gpu_util_min"], step["gpu_util_max"]) == (20, 100)
    assert step["gpu_util_samples"] == 4 and step["gpu_sm_clock_mhz"] == 1980 and step["gpu_power_w"] == 600.0
    lib.add(40, 1500, 300_000)
    assert sampler.take()["gpu_util_samples"] == 1  # the next step sees only its own samples
    # a driver without clock samples (the H200's): one reading of the SM clock at the step's end
    lib.add(70, 1500, 300_000)
    lib.buffers[lib.NVML_PROCESSOR_CLK_SAMPLES].clear()
    assert sampler.take()["gpu_sm_clock_mhz"] == 1980


def test_without_the_sample_buffer_a_thread_polls_and_each_take_drains_it():
    lib = FakeNvml(buffered=False)
    sampler = StepGpuSampler(lib, handle=object())
    assert not sampler.buffered
    time.sleep(0.45)
    step = sampler.take()
    sampler.stop()
    assert step["gpu_util_samples"] >= 2 and step["gpu_util_min"] == 50 and step["gpu_util_max"] == 60
    assert step["gpu_power_w"] == 450.0 and "polled" in step["gpu_sampling"]
    assert step_summary([], [], [], "x") == {}


def test_the_kernel_profile_sorts_gpu_time_by_what_the_kernels_do():
    from types import SimpleNamespace

    from lf_adapter.plugin.comm_profile import idle_gaps, kernel_breakdown, union_seconds

    def kernel(name, start, end, device="DeviceType.CUDA"):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 400),
        kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 400, 700),
        kernel("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", 700, 800),
        kernel("void at::native::(anonymous)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 900, 950),
        kernel("_rms_norm_forward_kernel", 950, 960),
        kernel("liger_cross_entropy_kernel", 960, 990),
        kernel("void at::native::vectorized_elementwise_kernel<4, CastOp>", 990, 1000),
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 1000, 1100),
        kernel("aten::mm", 0, 1000, device="DeviceType.CPU"),  # the CPU op that launched a GEMM: not GPU time
    ]
    kinds, spans, top = kernel_breakdown(events)
    assert kinds == {
        "GEMMs": 800e-6,
        "attention": 100e-6,
        "optimizer": 50e-6,
        "norms, activations, RoPE (liger/Triton)": 10e-6,
        "loss (cross-entropy)": 30e-6,
        "copies, casts, other elementwise": 10e-6,
    }
    assert abs(union_seconds(spans) - 1000e-6) < 1e-12  # 800-900 µs: the GPU idled
    gaps = idle_gaps(spans)  # the one wait, where it was and between which kernels
    assert gaps["longest_gaps"] == [
        [
            0.1,
            0.8,
            "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>",
            "void at::native::(anonymous)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
        ]
    ]
    assert gaps["gaps_of_1ms"] == 0 and gaps["kernels_span_s"] == 0.0011
    later = idle_gaps([*spans, (2_600, 2_700, "sync_after_host_work"), (2_650, 2_800, "overlapping")])
    assert later["gaps_of_1ms"] == 1 and later["gaps_of_1ms_s"] == 0.0015  # 1,100 -> 2,600 µs
    assert later["longest_gaps"][0][:3] == [1.5, 1.1, "sm90_xmma_gemm_bf16bf16_bf16f32"]
    assert top[0] == ["sm90_xmma_gemm_bf16bf16_bf16f32", 0.0005, 2]  # two launches of one kernel, by name
    assert [name for name, _, _ in top[1:3]] == [
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT",
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>",
    ]
