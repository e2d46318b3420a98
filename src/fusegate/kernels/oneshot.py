"""One-shot allreduce fused with residual-add + RMSNorm, over peer buffers (Lamport protocol).

Per call, program p of G handles rows p, p+G, ... of the (M, H) input:
  1. push: load the row, canonicalise -0.0, store it into region `rank` of the current slot of
     every rank's buffer (plain stores; 128-bit when H x itemsize is a multiple of 16);
  2. re-arm: refill this rank's previous slot with the sentinel (exactly last call's extent);
  3. poll this rank's own slot for every source rank 0..W-1, sum in fp32 in that fixed order
     (so every rank produces identical bits), round to the dtype and run the epilogue;
  4. arrive on a local counter; the last program advances the device state.
Program p depends only on program p of the peers (same row set on every rank), never on another
program of its own launch. Workspace layout and protocol: `fusegate.backends.workspace`.

`ws` (the workspace) provides peers.views (W 1-D tensors), peers.local, state, err,
region_elems, sentinel and rank. CUDA-graph capturable: the state lives in device memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusegate.kernels.epilogue import MAX_HIDDEN, epilogue_row, interpreting, load_weight, round_like
from fusegate.kernels.sync import canonicalize, poll_ready, record_timeout, sentinel_like, start_deadline

# State word indices (fusegate.backends.workspace: STATE_*).
_SLOT, _EXTENT_A, _ARRIVE, _CALLS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(3), tl.constexpr(4)
# Interpreter spin bound per second of timeout: one interpreted poll of a 32-element row took
# about 1 ms on the 2-core CI-class machine (tests/kernels/test_interpreter.py timeout test).
INTERPRETER_SPINS_PER_S = 1_000


@triton.jit(do_not_specialize=["rank", "M", "timeout_ns", "max_spins"])
def oneshot_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, newres_ptr, bufs, local_ptr, state_ptr, err_ptr,
    rank, M, H, region, eps, timeout_ns, max_spins,
    W: tl.constexpr, BLOCK_H: tl.constexpr, SENT: tl.constexpr, ELEM_BITS: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, USE_ASM: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    slot = tl.load(state_ptr + _SLOT)
    prev_extent = tl.multiple_of(tl.load(state_ptr + _EXTENT_A), 64)  # stored rounded up: 128-bit re-arm stores
    calls = tl.load(state_ptr + _CALLS)
    dead = tl.load(err_ptr) != 0
    deadline = start_deadline(timeout_ns, USE_ASM)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = load_weight(w_ptr, cols, cmask, HAS_NORM)
    slot_base = slot.to(tl.int64) * W * region

    # 1. push this rank's rows into every rank's current slot, region `rank`
    row = pid
    while row < M:
        x = tl.load(x_ptr + row.to(tl.int64) * H + cols, mask=cmask, other=0.0)
        x = canonicalize(x, SENT, ELEM_BITS)
        dst = slot_base + rank * region + row.to(tl.int64) * H + cols
        for r in tl.static_range(W):
            tl.store(bufs[r] + dst, x, mask=cmask)
        row += nprog

    # 2. re-arm the previous slot of this rank's buffer (what the last call wrote)
    prev_base = ((slot + 2) % 3).to(tl.int64) * W * region
    fill = sentinel_like(tl.zeros([BLOCK_H], dtype=local_ptr.dtype.element_ty), SENT, ELEM_BITS)
    for r in tl.static_range(W):
        c = pid * BLOCK_H
        while c < prev_extent:
            offs = c + cols
            tl.store(local_ptr + prev_base + r * region + offs, fill, mask=offs < prev_extent)
            c += nprog * BLOCK_H

    # 3. wait for every source's row, sum in rank order, epilogue
    row = pid
    while row < M:
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        src = local_ptr + slot_base + row.to(tl.int64) * H + cols
        for r in tl.static_range(W):
            v, ok = poll_ready(src + r * region, cmask, deadline, max_spins, dead, SENT, ELEM_BITS, USE_ASM)
            if ok == 0:
                record_timeout(err_ptr, r, row, calls)
            dead = dead | (ok == 0)
            acc += v.to(tl.float32)
        acc = tl.where(dead, float("nan"), acc)  # a failed call never returns plausible data
        s = round_like(acc, v, SOFT_BF16)
        epilogue_row(s, row, cols, cmask, res_ptr, w, out_ptr, newres_ptr, H, eps, HAS_RES, HAS_NORM, SOFT_BF16)
        row += nprog

    # 4. the last program to arrive advances the state for the next call
    old = tl.atomic_add(state_ptr + _ARRIVE, 1)
    if old == nprog - 1:
        tl.store(state_ptr + _SLOT, (slot + 1) % 3)
        tl.store(state_ptr + _EXTENT_A, (M * H + 63) // 64 * 64)
        tl.store(state_ptr + _ARRIVE, 0)
        tl.store(state_ptr + _CALLS, (calls + 1) & 0x7FFFFFFF)


def spin_bounds(timeout_s: float) -> tuple[int, int]:
    """(timeout in ns for GPUs, spin count for the interpreter) of one wait."""
    return int(timeout_s * 1e9), max(1, int(timeout_s * INTERPRETER_SPINS_PER_S))


def oneshot_launch(x, residual, weight, eps, ws, *, timeout_s: float, max_programs: int, has_norm: bool = True,
                 warmup: bool = False, out: tuple | None = None):
    """Run one call on the current stream; returns (out, new_residual) (new_residual is None without norm).

    x (M, H) contiguous with M x H <= ws.region_elems; weight (H,) (ignored without norm).
    `warmup=True` compiles the kernel without launching it (call before any collective use).
    `out=(out, new_residual)` writes into given buffers (new_residual ignored without norm).
    """
    m, h = x.shape
    if h > MAX_HIDDEN:
        raise ValueError(f"oneshot: hidden size {h} exceeds {MAX_HIDDEN}; use strategy='nccl_fused'")
    if m * h > ws.region_elems:
        raise ValueError(f"oneshot: {m}x{h} elements exceed the workspace region of {ws.region_elems}; call prepare() with a larger max_tokens")
    if out is not None:  # caller's buffers (tests poison them with NaN)
        out, new_res = out[0], (out[1] if has_norm else out[0])
    else:
        out = torch.empty_like(x)
        new_res = torch.empty_like(x) if has_norm else out
    timeout_ns, max_spins = spin_bounds(timeout_s)
    grid = (max(1, min(m, max_programs)),)
    block = triton.next_power_of_2(h)
    args = (x, residual if residual is not None else x, weight if weight is not None else x, out, new_res,
            tuple(ws.peers.views), ws.peers.local, ws.state, ws.err,
            ws.rank, m, h, ws.region_elems, float(eps), timeout_ns, max_spins)
    meta = dict(W=len(ws.peers.views), BLOCK_H=block, SENT=ws.sentinel, ELEM_BITS=8 * x.element_size(),
                HAS_RES=residual is not None, HAS_NORM=has_norm, USE_ASM=not interpreting(),
                SOFT_BF16=interpreting(), num_warps=num_warps_for(block, x.element_size()))
    if warmup:
        if not interpreting():
            oneshot_kernel.warmup(*args, grid=grid, **meta)
        return None
    oneshot_kernel[grid](*args, **meta)
    return out, (new_res if has_norm else None)


def num_warps_for(block: int, itemsize: int) -> int:
    """About 16 bytes per thread per row access (one 128-bit vector), between 1 and 16 warps."""
    return max(1, min(16, block * itemsize // (16 * 32)))
