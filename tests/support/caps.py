"""Capabilities of a made-up machine, for admission tests: `num_gpus` test GPUs (compute capability
12.0, 188 SMs, peer facts left to the group), no links, and the given optional packages."""

from __future__ import annotations

from tpfuse.probe.capabilities import Capabilities, CpuInfo, GpuInfo, Versions


def fake_caps(num_gpus=0, packages=()):
    gpus = tuple(
        GpuInfo(i, "Test GPU", f"GPU-{i}", (12, 0), 188, 101376, 128 << 20, 96 << 30, 600.0, 5, 16, None)
        for i in range(num_gpus)
    )
    return Capabilities(gpus, (), Versions("3.11", "0.1.0"), tuple(packages), CpuInfo("cpu", 2, None), nvml="test")
