"""The timing protocol that `tune` and `verify` share: interleaved rounds, medians, max over ranks.

Collective: every rank of `group` calls `time_interleaved` with the same names in the same order.

Protocol (one *round* times every variant once):
- warm-up calls of every variant first (JIT, workspace allocation, caches), untimed;
- each round visits the variants in an order rotated by one per round, so slow drift of the
  machine (another process, frequency changes) lands on every variant alike;
- before each timed call the ranks meet at a barrier, so a rank's time is not the time it waited
  for a late peer; the device is synchronized before the barrier;
- CPU: `time.perf_counter` around the call. CUDA: what a serving engine runs, CUDA-graph
  replays: every variant's call is captured GRAPH_CALLS times into one graph, and a sample is the
  device time of one replay between CUDA events over GRAPH_CALLS, taken right after an untimed
  replay (which absorbs the ranks' start skew, as the first call of a step does in an engine).
  Host launch cost (Python, Triton's launcher) stays out of the comparison, so the do-no-harm
  guard compares kernels. If any variant cannot be captured on any rank (e.g. gloo collectives),
  every variant is timed eagerly with events around one call instead, and `info["method"]` says
  which method ran;
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


GRAPH_CALLS = 16  # calls per captured graph: enough that one replay's launch cost is amortised


def _capture(fn: Callable[[], object], device: torch.device):
    """A CUDA graph of GRAPH_CALLS calls of `fn`, or None when `fn` cannot be captured."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=side):
            for _ in range(GRAPH_CALLS):
                fn()
    except Exception:  # any capture failure means: not capturable here, time it eagerly
        torch.cuda.synchronize(device)
        return None
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    return graph


def _time_replay(graph, group, device: torch.device) -> float:
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()  # untimed: the ranks leave it together, so the timed replay starts aligned
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / GRAPH_CALLS


def _graphs_everywhere(calls: dict, group, device: torch.device) -> dict | None:
    """One graph per variant if every variant captures on every rank (agreed), else None."""
    graphs = {name: _capture(fn, device) for name, fn in calls.items()}
    ok = torch.tensor([int(all(g is not None for g in graphs.values()))], device=_collective_device(group, device))
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return graphs if int(ok.item()) == 1 else None


def time_interleaved(
    calls: dict[str, Callable[[], object]],
    *,
    group,
    device: torch.device,
    rounds: int,
    warmup: int = 2,
    info: dict | None = None,
) -> dict[str, list[float]]:
    """Per-call times (us, max over ranks) of every variant in `calls`, `rounds` samples each.

    `info`, when given, receives {"method": "cuda_graph" | "cuda_events" | "perf_counter"}.
    """
    if rounds < 1:
        raise ValueError(f"time_interleaved: rounds must be >= 1, got {rounds}")
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    timers = {name: (lambda fn=fn: _time_one(fn, group, device)) for name, fn in calls.items()}
    method = "perf_counter"
    if device.type == "cuda":
        graphs = _graphs_everywhere(calls, group, device)
        method = "cuda_events"
        if graphs is not None:
            method = "cuda_graph"
            timers = {name: (lambda g=g: _time_replay(g, group, device)) for name, g in graphs.items()}
    if info is not None:
        info["method"] = method
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(timers[name]())
    reduced = max_over_ranks([samples[name] for name in names], group, device)
    return dict(zip(names, reduced))


def summary(samples: list[float]) -> dict[str, float]:
    """{"median", "p20", "p80", "n"} of one variant's samples (us)."""
    if len(samples) == 1:
        return {"median": samples[0], "p20": samples[0], "p80": samples[0], "n": 1}
    q = statistics.quantiles(samples, n=10, method="inclusive")
    return {"median": statistics.median(samples), "p20": q[1], "p80": q[7], "n": len(samples)}
