"""The timing protocol that `tune` and `verify` share: interleaved rounds, medians, max over ranks.

Collective: every rank of `group` calls `time_interleaved` with the same names in the same order.

Protocol (one *round* times every variant once):
- warm-up calls of every variant first (JIT, workspace allocation, caches), untimed;
- each round visits the variants in an order rotated by one per round, so slow drift of the
  machine (another process, frequency changes) lands on every variant alike;
- before each timed call the ranks meet at a barrier, so a rank's time is not the time it waited
  for a late peer; the device is synchronized before the barrier;
- CPU: `time.perf_counter` around the call; CUDA: CUDA events around the call on the current
  stream (the call's device time, without host launch overhead hidden by queueing);
- the time of a call is the maximum over ranks (one all_reduce MAX over all samples at the end),
  because a collective is as slow as its slowest rank.

Times are in microseconds. Medians (and p20/p80) are taken by the caller.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist


def _collective_device(group, device: torch.device) -> torch.device:
    """NCCL reduces CUDA tensors only; gloo takes CPU tensors (also for ranks holding CUDA data)."""
    return device if "nccl" in str(dist.get_backend(group)).lower() else torch.device("cpu")


def _time_one(fn: Callable[[], object], group, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3  # ms -> us
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def max_over_ranks(values: list[list[float]], group, device: torch.device) -> list[list[float]]:
    """Elementwise maximum over ranks of a rectangular list of lists (one collective)."""
    if not values or not values[0]:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device(group, device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def time_interleaved(
    calls: dict[str, Callable[[], object]],
    *,
    group,
    device: torch.device,
    rounds: int,
    warmup: int = 2,
) -> dict[str, list[float]]:
    """Per-call times (us, max over ranks) of every variant in `calls`, `rounds` samples each."""
    if rounds < 1:
        raise ValueError(f"time_interleaved: rounds must be >= 1, got {rounds}")
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(_time_one(calls[name], group, device))
    reduced = max_over_ranks([samples[name] for name in names], group, device)
    return dict(zip(names, reduced))


def summary(samples: list[float]) -> dict[str, float]:
    """{"median", "p20", "p80", "n"} of one variant's samples (us)."""
    if len(samples) == 1:
        return {"median": samples[0], "p20": samples[0], "p80": samples[0], "n": 1}
    q = statistics.quantiles(samples, n=10, method="inclusive")
    return {"median": statistics.median(samples), "p20": q[1], "p80": q[7], "n": len(samples)}
