"""Measured fabric probe: peer read/write bandwidth and latency per GPU pair, all-to-all, push vs pull.

`measure_fabric(caps)` runs in ONE process that sees every GPU (not per rank): it maps each
pair's memory through CUDA peer access and times small Triton kernels on the GPU that issues the
traffic. `tpfuse doctor --measure` calls it; strategies may read the result from
`Capabilities.fabric` (e.g. `prefers` for push vs pull). It needs two or more GPUs with peer
access between at least one pair; otherwise it raises RuntimeError saying why (doctor prints it).

What is measured, per ordered pair (a, b) with peer access, every timed call first checked for
the right answer (verify before time):
- read_gbps:  a kernel on GPU a copies a buffer that lives on GPU b into GPU a (pull);
- write_gbps: a kernel on GPU a copies a buffer on GPU a into GPU b (push);
- latency_us: a single-warp kernel on GPU a follows a chain of dependent 4-byte loads through a
  random cyclic permutation that lives on GPU b (each hop a different 256-byte line, volatile
  loads); time per hop = remote-read round trip.
Bandwidth and latency are medians of `reps` CUDA-event-timed calls after a warm-up
(`tpfuse.timing.time_calls`); the copies are `tpfuse.timing`'s copy kernel.

all_to_all_score: every GPU writes `block` bytes to every peer at once (one kernel per GPU whose
programs are split over the peers, all GPUs launched together, host-timed between device-wide
synchronizations), as bytes per GPU per second, divided by the median one-pair write bandwidth
measured alone. About 1: a GPU can feed all its peers at once as fast as one (switched fabric
with bandwidth to spare); well below 1: concurrent writes collapse (some PCIe root complexes
fall to a few GB/s under all-to-all posted writes).

prefers: "pull" when the median read bandwidth beats the median write bandwidth by more than
`PULL_MARGIN`, else "push" (posted writes are the safe default on PCIe: peer reads
are not supported by every PCIe topology, posted writes are).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

from tpfuse.probe.capabilities import Capabilities, FabricMeasurements, PeerMeasurement
from tpfuse.timing import COPY_BLOCK, copy, copy_kernel, time_calls

# Prefer pull only when reads beat writes by more than 5%: a preference must not flip on noise
# (run-to-run spread of these medians is a few percent), and push is the safer PCIe default.
PULL_MARGIN = 0.05
# Spacing of pointer-chase hops in int32 elements (256 B): one hop per cache line and sector group.
_HOP = 64

_KERNELS = None


def _kernels():
    """(copy, scatter, chase): compile-once Triton kernels (imported lazily: importing this module
    imports no Triton). The copy kernel is `tpfuse.timing.copy_kernel`."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def scatter_kernel(src_addr, dst_table, n, blocks_per_dst, BLOCK: tl.constexpr):
        # Programs are split over destinations: program p writes block p % blocks_per_dst of the
        # source into destination p // blocks_per_dst, so one launch writes to every peer at once.
        # Addresses arrive as integers, widened to int64 (as in the copy kernel).
        pid = tl.program_id(0)
        d = pid // blocks_per_dst
        src = src_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
        dst = tl.load(dst_table + d).to(tl.int64).to(tl.pointer_type(tl.int32))
        offs = (pid % blocks_per_dst).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    @triton.jit
    def chase_kernel(buf_addr, out_ptr, STEPS: tl.constexpr):
        # STEPS is a compile-time constant (two values are used): Triton 3.6's interpreter cannot
        # loop over a runtime scalar under numpy 2.5, and the compiled loop is the same.
        buf = buf_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
        idx = tl.load(buf, volatile=True)
        for _ in range(STEPS):
            idx = tl.load(buf + idx, volatile=True)
        tl.store(out_ptr, idx)

    _KERNELS = (copy_kernel(), scatter_kernel, chase_kernel)
    return _KERNELS


def _enable_peer_access(a: int, b: int) -> None:
    """Map each GPU's memory into the other's address space (torch enables peer access on the
    first peer copy, in the copying direction; copy both ways)."""
    import torch

    x_a = torch.zeros(1, device=f"cuda:{a}")
    x_b = torch.zeros(1, device=f"cuda:{b}")
    x_b.copy_(x_a)
    x_a.copy_(x_b)
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)


def _median_us(fn: Callable[[], None], device: int, reps: int) -> float:
    """Median of `reps` CUDA-event-timed calls on GPU `device`, after one warm-up (and JIT) call."""
    import torch

    return statistics.median(time_calls(fn, reps=reps, warmup=1, device=torch.device("cuda", device)))


def _copy(src, dst, device: int) -> None:
    import torch

    with torch.cuda.device(device):
        copy(src, dst)


def _checked_copy_gbps(src, dst, device: int, reps: int, what: str) -> float:
    """Verify one copy (dst poisoned first), then time it; GB/s = bytes / median time."""
    import torch

    dst.fill_(-1)
    _copy(src, dst, device)
    torch.cuda.synchronize(device)
    if not torch.equal(dst.cpu(), src.cpu()):
        raise RuntimeError(f"measure_fabric: {what} copied wrong data; peer mapping is broken on this pair")
    us = _median_us(lambda: _copy(src, dst, device), device, reps)
    return src.numel() * 4 / (us * 1e-6) / 1e9


def _chain(n_hops: int, seed: int):
    """A random cyclic permutation over `n_hops` slots `_HOP` int32 apart: buf[slot] = next slot."""
    import torch

    order = list(range(n_hops))
    random.Random(seed).shuffle(order)
    buf = torch.zeros(n_hops * _HOP, dtype=torch.int32)
    for i, slot in enumerate(order):
        buf[slot * _HOP] = order[(i + 1) % n_hops] * _HOP
    return buf, order  # the chase starts with buf[0], the successor of slot 0


def _latency_us(a: int, b: int, steps: int, reps: int) -> float:
    import torch

    _, _, chase_kernel = _kernels()
    n_hops = 4096  # 1 MiB spread of hops: larger than a few cache lines' worth of reuse
    host, order = _chain(n_hops, seed=a * 131 + b)
    buf = host.to(f"cuda:{b}")
    out = torch.full((1,), -1, dtype=torch.int32, device=f"cuda:{a}")
    # Where the chase ends: the kernel loads buf[0], then follows `steps` more hops.
    idx = int(host[0])
    for _ in range(steps):
        idx = int(host[idx])

    def run():
        with torch.cuda.device(a):
            chase_kernel[(1,)](buf.data_ptr(), out, STEPS=steps, num_warps=1)

    run()
    torch.cuda.synchronize(a)
    if int(out.item()) != idx:
        raise RuntimeError(f"measure_fabric: pointer chase GPU {a} -> {b} ended at {int(out.item())}, expected {idx}")
    # Subtract a zero-hop launch so the per-hop figure excludes launch overhead.
    full = _median_us(run, a, reps)

    def empty():
        with torch.cuda.device(a):
            chase_kernel[(1,)](buf.data_ptr(), out, STEPS=0, num_warps=1)

    base = _median_us(empty, a, reps)
    return max(full - base, 0.0) / steps


def measure_pair(a: int, b: int, *, nbytes: int = 64 << 20, reps: int = 10, steps: int = 2000) -> PeerMeasurement:
    """Read, write and latency for GPU a acting on GPU b's memory (a == b measures local memory,
    which the single-GPU tests use to check the kernels)."""
    import torch

    if a != b:
        _enable_peer_access(a, b)
    n = nbytes // 4
    src_b = torch.arange(n, dtype=torch.int32, device=f"cuda:{b}")
    dst_a = torch.empty(n, dtype=torch.int32, device=f"cuda:{a}")
    read = _checked_copy_gbps(src_b, dst_a, a, reps, f"read GPU {a} <- {b}")
    src_a = torch.arange(n, dtype=torch.int32, device=f"cuda:{a}") * 3
    dst_b = torch.empty(n, dtype=torch.int32, device=f"cuda:{b}")
    write = _checked_copy_gbps(src_a, dst_b, a, reps, f"write GPU {a} -> {b}")
    return PeerMeasurement(a, b, read, write, _latency_us(a, b, steps, reps))


def _all_to_all_gbps_per_gpu(devices: list[int], nbytes: int, reps: int) -> float:
    import torch
    import triton

    _, scatter_kernel, _ = _kernels()
    n = nbytes // 4
    blocks = triton.cdiv(n, COPY_BLOCK)
    src = {d: torch.arange(n, dtype=torch.int32, device=f"cuda:{d}") + d for d in devices}
    # recv[d][s]: the region on GPU d that GPU s writes into.
    recv = {d: {s: torch.full((n,), -1, dtype=torch.int32, device=f"cuda:{d}") for s in devices if s != d}
            for d in devices}
    tables = {s: torch.tensor([recv[d][s].data_ptr() for d in devices if d != s], dtype=torch.int64, device=f"cuda:{s}")
              for s in devices}

    def launch_all():
        for s in devices:
            with torch.cuda.device(s):
                scatter_kernel[(blocks * (len(devices) - 1),)](src[s].data_ptr(), tables[s], n, blocks,
                                                               BLOCK=COPY_BLOCK)

    def sync_all():
        for d in devices:
            torch.cuda.synchronize(d)

    launch_all()
    sync_all()
    for d in devices:
        for s, region in recv[d].items():
            if not torch.equal(region.cpu(), src[s].cpu()):
                raise RuntimeError(f"measure_fabric: all-to-all write GPU {s} -> {d} delivered wrong data")
    # Host-timed (no device given): one sample is every GPU's launch up to every GPU's completion.
    us = statistics.median(time_calls(lambda: (launch_all(), sync_all()), reps=reps, warmup=0))
    per_gpu_bytes = nbytes * (len(devices) - 1)
    return per_gpu_bytes / (us * 1e-6) / 1e9


def measure_fabric(caps: Capabilities, *, progress: Callable[..., None] | None = None, nbytes: int = 64 << 20,
                   reps: int = 10) -> FabricMeasurements:
    """Measure every ordered GPU pair with peer access (see module doc); RuntimeError when fewer
    than two GPUs are visible or no pair has peer access (the message says which)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise RuntimeError(f"measure_fabric: needs 2 or more GPUs in this process, torch sees {count}; "
                           "run on a multi-GPU machine (or widen CUDA_VISIBLE_DEVICES)")
    count = torch.cuda.device_count()
    pairs = [(a, b) for a in range(count) for b in range(count)
             if a != b and torch.cuda.can_device_access_peer(a, b)]
    if not pairs:
        raise RuntimeError(f"measure_fabric: none of the {count} GPUs can map another's memory (no CUDA peer "
                           "access); check ACS/IOMMU settings and `nvidia-smi topo -p2p r`")
    total = len(pairs) + 1
    measured = []
    for i, (a, b) in enumerate(pairs):
        if progress is not None:
            progress(f"GPU {a} <-> {b}", i, total)
        measured.append(measure_pair(a, b, nbytes=nbytes, reps=reps))
    devices = sorted({a for a, _ in pairs} & {b for _, b in pairs})
    if progress is not None:
        progress("all-to-all", len(pairs), total)
    full_mesh = all((a, b) in pairs for a in devices for b in devices if a != b)
    one_pair = statistics.median(m.write_gbps for m in measured)
    # Split the bytes over peers so the all-to-all moves about as much per GPU as one pair did.
    score = (_all_to_all_gbps_per_gpu(devices, max(nbytes // max(len(devices) - 1, 1), COPY_BLOCK * 4), reps) / one_pair
             if full_mesh and len(devices) >= 2 else float("nan"))
    if progress is not None:
        progress("done", total, total)
    read = statistics.median(m.read_gbps for m in measured)
    prefers = "pull" if read > one_pair * (1 + PULL_MARGIN) else "push"
    method = (f"Triton copy kernels, {nbytes >> 20} MiB per transfer, median of {reps} CUDA-event-timed calls; "
              f"latency from {2000} dependent remote 4-byte loads; all-to-all host-timed over GPUs {devices}"
              + ("" if full_mesh else " (not measured: peer access is not all-to-all)"))
    return FabricMeasurements(tuple(measured), score, prefers, method)
