"""Two-shot allreduce fused with residual-add + RMSNorm, over peer buffers (Lamport protocol).

Rank o owns the contiguous token rows [o*R, (o+1)*R), R = ceil(M / W). Per call, program p of G:
  1. scatter: for each owner o, push this rank's rows o*R + j (j = p, p+G, ...) into region `rank`
     of the owner's scatter slot (each byte crosses the fabric once, not W-1 times);
  2. re-arm this rank's previous slot (scatter regions and gather region, last call's extents);
  3. reduce: for the owned rows j = p, p+G, ..., poll the W scatter regions, sum in fp32 in rank
     order 0..W-1, round to the dtype, canonicalise -0.0 (a rounded sum can be -0.0, which is
     the sentinel) and push the sum into every rank's gather region;
  4. gather + epilogue: poll the gather region for every row o*R + j (j = p, p+G, ...) and apply
     residual-add + RMSNorm locally; 5. arrive; the last program advances the device state.
What is gathered is the reduced sum, not the normed rows: every rank needs new_residual anyway,
so gathering the finished rows would move twice the bytes (kernel-design note, section 4.3).
Program p depends only on program p of the peers. Layout of a slot: W scatter regions, then one
gather region (`num_regions = W + 1`); protocol in `fusegate.backends.workspace`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusegate.kernels.epilogue import MAX_HIDDEN, epilogue_row, interpreting, load_weight, round_like
from fusegate.kernels.oneshot import num_warps_for, spin_bounds
from fusegate.kernels.sync import canonicalize, poll_ready, record_timeout, sentinel_like, start_deadline

_SLOT, _EXTENT_A, _EXTENT_B, _ARRIVE, _CALLS = (tl.constexpr(i) for i in range(5))


@triton.jit
def _rearm(local_ptr, base, extent, cols, pid, nprog, fill, BLOCK_H: tl.constexpr):
    c = pid * BLOCK_H
    while c < extent:
        offs = c + cols
        tl.store(local_ptr + base + offs, fill, mask=offs < extent)
        c += nprog * BLOCK_H


@triton.jit(do_not_specialize=["rank", "M", "timeout_ns", "max_spins"])
def twoshot_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, newres_ptr, bufs, local_ptr, state_ptr, err_ptr,
    rank, M, H, region, eps, timeout_ns, max_spins,
    W: tl.constexpr, BLOCK_H: tl.constexpr, SENT: tl.constexpr, ELEM_BITS: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, USE_ASM: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    slot = tl.load(state_ptr + _SLOT)
    prev_a = tl.multiple_of(tl.load(state_ptr + _EXTENT_A), 64)
    prev_b = tl.multiple_of(tl.load(state_ptr + _EXTENT_B), 64)
    calls = tl.load(state_ptr + _CALLS)
    dead = tl.load(err_ptr) != 0
    deadline = start_deadline(timeout_ns, USE_ASM)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = load_weight(w_ptr, cols, cmask, HAS_NORM)
    rows_per = tl.cdiv(M, W)
    slot_base = slot.to(tl.int64) * (W + 1) * region
    gather_base = slot_base + W * region

    # 1. scatter this rank's rows to their owners
    for o in tl.static_range(W):
        j = pid
        while (j < rows_per) & (o * rows_per + j < M):
            row = o * rows_per + j
            x = tl.load(x_ptr + row.to(tl.int64) * H + cols, mask=cmask, other=0.0)
            x = canonicalize(x, SENT, ELEM_BITS)
            tl.store(bufs[o] + slot_base + rank * region + j.to(tl.int64) * H + cols, x, mask=cmask)
            j += nprog

    # 2. re-arm the previous slot of this rank's buffer
    prev_base = ((slot + 2) % 3).to(tl.int64) * (W + 1) * region
    fill = sentinel_like(tl.zeros([BLOCK_H], dtype=local_ptr.dtype.element_ty), SENT, ELEM_BITS)
    for r in tl.static_range(W):
        _rearm(local_ptr, prev_base + r * region, prev_a, cols, pid, nprog, fill, BLOCK_H)
    _rearm(local_ptr, prev_base + W * region, prev_b, cols, pid, nprog, fill, BLOCK_H)

    # 3. reduce the owned rows in rank order and publish the sums to every rank
    j = pid
    while (j < rows_per) & (rank * rows_per + j < M):
        row = rank * rows_per + j
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        src = local_ptr + slot_base + j.to(tl.int64) * H + cols
        for r in tl.static_range(W):
            v, ok = poll_ready(src + r * region, cmask, deadline, max_spins, dead, SENT, ELEM_BITS, USE_ASM)
            if ok == 0:
                record_timeout(err_ptr, r, row, calls)
            dead = dead | (ok == 0)
            acc += v.to(tl.float32)
        acc = tl.where(dead, float("nan"), acc)
        s = canonicalize(round_like(acc, v, SOFT_BF16), SENT, ELEM_BITS)
        for o in tl.static_range(W):
            tl.store(bufs[o] + gather_base + row.to(tl.int64) * H + cols, s, mask=cmask)
        j += nprog

    # 4. wait for every owner's sums and run the epilogue on all rows
    for o in tl.static_range(W):
        j = pid
        while (j < rows_per) & (o * rows_per + j < M):
            row = o * rows_per + j
            s, ok = poll_ready(local_ptr + gather_base + row.to(tl.int64) * H + cols, cmask, deadline, max_spins,
                               dead, SENT, ELEM_BITS, USE_ASM)
            if ok == 0:
                record_timeout(err_ptr, o, row, calls)
            dead = dead | (ok == 0)
            s = tl.where(dead, float("nan"), s.to(tl.float32)).to(s.dtype)
            epilogue_row(s, row, cols, cmask, res_ptr, w, out_ptr, newres_ptr, H, eps, HAS_RES, HAS_NORM, SOFT_BF16)
            j += nprog

    # 5. the last program to arrive advances the state for the next call
    old = tl.atomic_add(state_ptr + _ARRIVE, 1)
    if old == nprog - 1:
        tl.store(state_ptr + _SLOT, (slot + 1) % 3)
        tl.store(state_ptr + _EXTENT_A, (rows_per * H + 63) // 64 * 64)
        tl.store(state_ptr + _EXTENT_B, (M * H + 63) // 64 * 64)
        tl.store(state_ptr + _ARRIVE, 0)
        tl.store(state_ptr + _CALLS, (calls + 1) & 0x7FFFFFFF)


def twoshot_launch(x, residual, weight, eps, ws, *, timeout_s: float, max_programs: int, has_norm: bool = True,
                 warmup: bool = False, out: tuple | None = None):
    """Run one call on the current stream; returns (out, new_residual); see oneshot_launch."""
    m, h = x.shape
    if h > MAX_HIDDEN:
        raise ValueError(f"twoshot: hidden size {h} exceeds {MAX_HIDDEN}; use strategy='nccl_fused'")
    if m * h > ws.region_elems:
        raise ValueError(f"twoshot: {m}x{h} elements exceed the workspace region of {ws.region_elems}; call prepare() with a larger max_tokens")
    world = len(ws.peers.views)
    if out is not None:  # caller's buffers (tests poison them with NaN)
        out, new_res = out[0], (out[1] if has_norm else out[0])
    else:
        out = torch.empty_like(x)
        new_res = torch.empty_like(x) if has_norm else out
    timeout_ns, max_spins = spin_bounds(timeout_s)
    grid = (max(1, min(triton.cdiv(m, world), max_programs)),)
    block = triton.next_power_of_2(h)
    args = (x, residual if residual is not None else x, weight if weight is not None else x, out, new_res,
            tuple(ws.peers.views), ws.peers.local, ws.state, ws.err,
            ws.rank, m, h, ws.region_elems, float(eps), timeout_ns, max_spins)
    meta = dict(W=world, BLOCK_H=block, SENT=ws.sentinel, ELEM_BITS=8 * x.element_size(),
                HAS_RES=residual is not None, HAS_NORM=has_norm, USE_ASM=not interpreting(),
                SOFT_BF16=interpreting(), num_warps=num_warps_for(block, x.element_size()))
    if warmup:
        if not interpreting():
            twoshot_kernel.warmup(*args, grid=grid, **meta)
        return None
    twoshot_kernel[grid](*args, **meta)
    return out, (new_res if has_norm else None)
