"""Synthetic recordings for the analysis tests: each GPU follows a list of phases, each phase a
number of samples drawn uniformly from a (util, power) box with a seeded generator, so values are
random but reproducible, and the expected statistics are computed independently with numpy."""

from __future__ import annotations

import random

from tpfuse.diagnose.samples import GpuMeta, Recording, Sample

LIMIT_W = 700.0
INTERVAL_S = 0.1
GIB = 1024**3

# (util range %, power range W) boxes
WAITING = ((92.0, 100.0), (180.0, 300.0))  # resident kernels, about 0.26-0.43 of the limit
BUSY = ((92.0, 100.0), (520.0, 690.0))  # dense math, 0.74-0.99 of the limit
IDLE = ((0.0, 2.0), (70.0, 90.0))
GAPS = ((30.0, 50.0), (250.0, 350.0))


def make_recording(phases_by_gpu: dict[int, list[tuple[tuple, int]]], *, seed: int = 0, limit_w: float = LIMIT_W,
                   power_none: bool = False) -> Recording:
    rng = random.Random(seed)
    samples = []
    for gpu, phases in phases_by_gpu.items():
        k = 0
        for ((u_lo, u_hi), (p_lo, p_hi)), n in phases:
            for _ in range(n):
                samples.append(Sample(
                    t_s=k * INTERVAL_S + rng.uniform(0, 0.002), gpu=gpu,
                    power_w=None if power_none else rng.uniform(p_lo, p_hi), power_limit_w=limit_w,
                    util_pct=float(round(rng.uniform(u_lo, u_hi))), mem_util_pct=rng.uniform(1, 60),
                    sm_clock_mhz=rng.uniform(1200, 1980), mem_clock_mhz=3201.0,
                    mem_used_bytes=int(rng.uniform(1, 100) * GIB), target_mem_bytes=None))
                k += 1
    gpus = tuple(GpuMeta(index=g, name="NVIDIA H200", uuid=f"GPU-{g}", mem_total_bytes=141 * GIB,
                         sm_clock_max_mhz=1980, mem_clock_max_mhz=3201) for g in phases_by_gpu)
    duration = max(s.t_s for s in samples) if samples else 0.0
    return Recording(gpus=gpus, samples=tuple(samples), interval_s=INTERVAL_S, mode="duration",
                     started_unix=1_790_000_000.0, duration_s=duration, driver="580.159.04")
