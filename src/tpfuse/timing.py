"""How tpfuse times things: one protocol for collectives, one loop for single calls, one copy kernel.

`time_interleaved` (tune, verify, selftest, the allreduce sweep) is collective: every rank of
`group` calls it with the same names in the same order. Protocol (one *round* times every
variant once):
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

Primitives of one process: `sample_rounds` (the rotated rounds on their own, for the one-GPU
benchmarks); `time_calls` (MoE runner choice, the fabric probe, the decode benchmark), one
callable after an untimed warm-up, CUDA events on a CUDA device (that device's current stream),
`perf_counter` otherwise; `capture`, a CUDA graph of calls after warm-up on a side stream (the
protocol, the sweep); `graph_timer`, a sampler of the device time per call over `reps` replays of
such a graph (the one-GPU benchmarks); `copy`, the one copy kernel (int32 words between raw
addresses, so one kernel serves local, peer-read and peer-write copies), and `copy_bandwidth`,
which times it against torch's copy_.

Times are in microseconds. `summary` gives the statistics every report uses: median, p20, p80.
Importing this module imports no Triton; CUDA is touched only when a CUDA device is given.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

GRAPH_CALLS = 16  # calls per captured graph: enough that one replay's launch cost is amortised
# int32 words per program of the copy kernel: 16 KiB per program, enough to keep loads in flight
# over a high-latency peer link without needing a persistent grid.
COPY_BLOCK = 4096


def summary(samples: list[float]) -> dict[str, float]:
    """{"median", "p20", "p80", "n"} of one variant's samples (us)."""
    if len(samples) == 1:
        return {"median": samples[0], "p20": samples[0], "p80": samples[0], "n": 1}
    q = statistics.quantiles(samples, n=10, method="inclusive")
    return {"median": statistics.median(samples), "p20": q[1], "p80": q[7], "n": len(samples)}


def sample_rounds(samplers: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """`rounds` rounds of one sample from every sampler, the order rotated by one per round (so
    slow drift of the machine lands on every variant alike): {name: samples}."""
    names = list(samplers)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        k = i % len(names) if names else 0
        for name in names[k:] + names[:k]:
            samples[name].append(samplers[name]())
    return samples


# ---- one callable in this process -------------------------------------------------------------

def time_calls(fn: Callable[[], object], *, reps: int, warmup: int = 1, device: torch.device | None = None,
               min_seconds: float = 0.0) -> list[float]:
    """Microseconds of each of at least `reps` calls of `fn` (and at least `min_seconds` of them),
    after `warmup` untimed calls. CUDA events when `device` is a CUDA device, else perf_counter."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if not on_cuda:
        for _ in range(warmup):
            fn()
        return _loop(lambda: _host_us(fn), reps, min_seconds)
    with torch.cuda.device(device):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        return _loop(lambda: _event_us(fn), reps, min_seconds)


def _loop(sample: Callable[[], float], reps: int, min_seconds: float) -> list[float]:
    samples, t_start = [], time.perf_counter()
    while len(samples) < reps or time.perf_counter() - t_start < min_seconds:
        samples.append(sample())
    return samples


def _host_us(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def _event_us(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3  # ms -> us


def capture(calls: list[Callable[[], object]], *, device: torch.device | None = None, repeat: int = 1,
            warmup: int = 0):
    """A CUDA graph of `repeat` passes over `calls`, captured on a side stream after `warmup` eager
    passes there (JIT, workspaces, lazy inits: capture needs them done). Raises where capture fails."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmup):
            for call in calls:
                call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for _ in range(repeat):
            for call in calls:
                call()
    current.wait_stream(side)
    torch.cuda.synchronize(device)
    return graph


def graph_timer(calls: list[Callable[[], object]], *, reps: int) -> Callable[[], float]:
    """A sampler: replays one CUDA graph of `calls` `reps` times between events, returns us per call.

    The calls run once before capture, and the graph is replayed once untimed."""
    graph = capture(calls, warmup=1)
    graph.replay()
    torch.cuda.synchronize()

    def replays() -> None:
        for _ in range(reps):
            graph.replay()

    return lambda: _event_us(replays) / (reps * len(calls))


# ---- the collective protocol (module doc) -----------------------------------------------------

def _collective_device(group, device: torch.device) -> torch.device:
    """NCCL reduces CUDA tensors only; gloo takes CPU tensors (also for ranks holding CUDA data)."""
    return device if "nccl" in str(dist.get_backend(group)).lower() else torch.device("cpu")


def _time_one(fn: Callable[[], object], group, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        return _event_us(fn)
    dist.barrier(group=group)
    return _host_us(fn)


def max_over_ranks(values: list[list[float]], group, device: torch.device) -> list[list[float]]:
    """Elementwise maximum over ranks of a rectangular list of lists (one collective)."""
    if not values or not values[0]:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device(group, device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def _capture(fn: Callable[[], object], device: torch.device):
    """A CUDA graph of GRAPH_CALLS calls of `fn`, or None when `fn` cannot be captured."""
    try:
        return capture([fn], device=device, repeat=GRAPH_CALLS)
    except Exception:  # any capture failure means: not capturable here, time it eagerly
        torch.cuda.synchronize(device)
        return None


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
    """Collective: per-call times (us, max over ranks) of every variant in `calls`, `rounds`
    samples each (protocol in the module doc).

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
    samples = sample_rounds(timers, rounds)
    reduced = max_over_ranks([samples[name] for name in names], group, device)
    return dict(zip(names, reduced))


# ---- the copy kernel --------------------------------------------------------------------------

_COPY_KERNEL = None


def copy_kernel():
    """The Triton copy kernel, compiled once (for the interpreter when TRITON_INTERPRET=1 at first use).

    copy_kernel()[grid](src_addr, dst_addr, n, BLOCK=...) copies `n` int32 words."""
    global _COPY_KERNEL
    if _COPY_KERNEL is not None:
        return _COPY_KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(src_addr, dst_addr, n, BLOCK: tl.constexpr):
        # Addresses arrive as integers, so one kernel serves local, peer-read and peer-write copies.
        # Widened to int64 first: Triton types an integer argument below 2^31 as int32.
        src = src_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
        dst = dst_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    _COPY_KERNEL = _copy
    return _COPY_KERNEL


def reset_copy_kernel() -> None:
    """Forget the compiled kernel (tests switch between the interpreter and the compiler)."""
    global _COPY_KERNEL
    _COPY_KERNEL = None


def copy(src: torch.Tensor, dst: torch.Tensor, *, num_warps: int = 4) -> None:
    """Copy `src` into `dst` (same number of bytes, a multiple of 4; either may live on a peer GPU
    mapped into this one) with the copy kernel, on the current device."""
    nbytes = src.numel() * src.element_size()
    if nbytes != dst.numel() * dst.element_size() or nbytes % 4:
        raise ValueError(f"copy: src has {nbytes} bytes, dst {dst.numel() * dst.element_size()}; "
                         "pass tensors of equal size in bytes, a multiple of 4")
    n = nbytes // 4
    copy_kernel()[(-(-n // COPY_BLOCK),)](src.data_ptr(), dst.data_ptr(), n, BLOCK=COPY_BLOCK, num_warps=num_warps)


def copy_bandwidth(reps: int, trials: int, *, nbytes: int = 1 << 30) -> dict[str, list[float]]:
    """us per copy of `nbytes` (bf16 data) on the current GPU by method, `trials` interleaved
    `graph_timer` samples each: torch's copy_ (a memcpy node inside a graph) and the copy kernel
    (8 warps: a full-device copy wants more loads in flight per program than a peer link does);
    the faster one is the device copy bandwidth."""
    src = torch.randn(nbytes // 2, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    methods = {
        "torch_copy": lambda: dst.copy_(src),
        "triton_copy": lambda: copy(src, dst, num_warps=8),
    }
    return sample_rounds({name: graph_timer([call], reps=reps) for name, call in methods.items()}, trials)
