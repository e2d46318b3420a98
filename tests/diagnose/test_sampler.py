"""The sampler against a real GPU and driver: readings of a busy GPU compared with what torch and
NVML report directly. Skipped without a CUDA GPU (tests/conftest.py)."""

from __future__ import annotations

import os
import time

import pytest

from tpfuse.diagnose.sampler import Sampler, open_nvml

torch = pytest.importorskip("torch")


def _nvml_index_of_cuda0(nvml) -> int:
    """NVML's index of torch's cuda:0 (CUDA_VISIBLE_DEVICES may reorder): matched by UUID."""
    uuid = str(torch.cuda.get_device_properties(0).uuid).lower().removeprefix("gpu-")
    for meta in nvml.gpus:
        if meta.uuid and meta.uuid.lower().removeprefix("gpu-") == uuid:
            return meta.index
    raise AssertionError(f"no NVML GPU has torch's cuda:0 UUID {uuid}: {[g.uuid for g in nvml.gpus]}")


@pytest.mark.gpu
def test_sampler_reads_a_busy_gpu_consistently_with_torch_and_nvml():
    import pynvml

    nvml = open_nvml()
    try:
        gpu = _nvml_index_of_cuda0(nvml)
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        sampler = Sampler(nvml, interval_s=0.05, target_root=os.getpid()).start()
        end = time.time() + 3.0
        while time.time() < end:  # GEMMs for 3 s: kernels resident, power well above idle
            for _ in range(16):
                torch.mm(a, b)
            torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        sampler.stop()
        rec = sampler.recording(mode="duration")
        limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(nvml.handles[gpu]) / 1000
    finally:
        nvml.close()
    mine = [s for s in rec.samples_of(gpu) if s.t_s >= 1.5]  # past NVML's 1 s averaging window
    assert len(mine) >= 15
    meta = next(g for g in rec.gpus if g.index == gpu)
    # NVML and CUDA may differ by the driver's reserved memory; both describe one board.
    assert abs(meta.mem_total_bytes - torch.cuda.get_device_properties(0).total_memory) <= 2**30
    for s in mine:
        assert s.power_limit_w == pytest.approx(limit_w)
        assert 0 < s.power_w <= 1.1 * limit_w
        assert 0 < s.sm_clock_mhz <= meta.sm_clock_max_mhz
        assert reserved <= s.mem_used_bytes <= meta.mem_total_bytes  # NVML counts every context's memory
    assert max(s.util_pct for s in mine) >= 90  # a GEMM is resident nearly all the time
    assert rec.tick_ms_median is not None and rec.tick_ms_median < 1000 * rec.interval_s
