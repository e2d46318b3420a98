"""Two-shot allreduce fused with residual-add + RMSNorm, over peer buffers (Lamport protocol).

The call's items (row, chunk; `tpfuse.kernels.protocol.make_plan`) are dealt to owners in
contiguous runs: owner o reduces items [o*K, (o+1)*K), K = ceil(items / W), so even one token is
spread over W ranks and many programs. Program p handles items p, p + G, ... in every phase:
  1. scatter: push each chunk into region `rank` of its owner's scatter area (own chunks stay in
     the input): each byte crosses the fabric once;
  2. reduce: for owned items, issue the loads of all W - 1 sources at once, poll, re-arm what was
     read, sum in fp32 in rank order with this rank's own chunk from its input, round to the
     dtype, canonicalise -0.0 (a rounded sum can be -0.0, which is the sentinel) and push the sum
     into every rank's gather area (this rank's own included);
  3. gather + epilogue: for every item, poll its owner's sum (one source), re-arm it, add the
     residual, store new_residual, then normed directly or through the norm partials (as in
     one-shot); 4. arrive; the last program advances the epoch.
Own sums are produced by the same program that later reads them (item i goes to program i % G
in both phases), so a wait never names this rank itself. A rank that failed, or whose abort word
is set, pushes nothing (no sums, no NaN) and writes NaN. What is gathered is the reduced sum,
not the normed rows: every rank needs new_residual anyway, so gathering finished rows would move
twice the bytes. Slot layout: W scatter regions, then one gather region (`num_regions = W + 1`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse.kernels.epilogue import round_like
from tpfuse.kernels.peer_launch import launch_peer_kernel
from tpfuse.kernels.peer_stages import (
    KIND_FP8_TOKEN_C,
    norm_partials_pass,
    residual_step,
    start_quantized,
    sum_in_rank_order,
    token_quant_pass,
)
from tpfuse.kernels.protocol import NUM_SLOTS, STATE_ARRIVE, STATE_CALLS
from tpfuse.kernels.sync import (
    and_scalar,
    canonicalize,
    entry_state,
    fail,
    int32_ptr,
    pending_ranks,
    poll_block,
    sentinel_like,
    start_deadline,
)

_CALLS, _ARRIVE, _SLOTS = tl.constexpr(STATE_CALLS), tl.constexpr(STATE_ARRIVE), tl.constexpr(NUM_SLOTS)


@triton.jit
def first_of(start, pid, nprog):
    """The first index >= start that is congruent to pid modulo nprog (the items of program pid)."""
    return start + ((pid - start) % nprog + nprog) % nprog


@triton.jit(do_not_specialize=["rank", "M", "timeout_ns", "max_spins"])
def twoshot_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, newres_ptr, bufs, local_ptr, part_ptr, state_ptr, err_ptr, qargs,
    rank, M, H, region, header, eps, timeout_ns, max_spins,
    W: tl.constexpr, WP: tl.constexpr, CHUNK: tl.constexpr, NCHUNK: tl.constexpr, NCP: tl.constexpr,
    SENT: tl.constexpr, ELEM_BITS: tl.constexpr, HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr,
    SPLIT: tl.constexpr, USE_ASM: tl.constexpr, SOFT_BF16: tl.constexpr, QKIND: tl.constexpr, QGROUP: tl.constexpr,
    QSWIZZLED: tl.constexpr, QHAS_UB: tl.constexpr, QHW: tl.constexpr, WITH_NORMED: tl.constexpr, QNG: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    calls = tl.load(state_ptr + _CALLS)
    qargs = start_quantized(qargs, pid, nprog, M, H, QKIND, QSWIZZLED, QNG)
    abort_ptr = int32_ptr(local_ptr)
    dead = entry_state(err_ptr, abort_ptr, rank, calls)
    deadline = start_deadline(timeout_ns, USE_ASM)
    cols = tl.arange(0, CHUNK)[None, :]  # [1, CHUNK]: the layout of the [sources, CHUNK] blocks
    srcs = tl.arange(0, WP)
    items = M * NCHUNK
    per_owner = tl.cdiv(items, W)
    slot_base = header + (calls % _SLOTS).to(tl.int64) * (W + 1) * region
    gather_base = slot_base + W * region

    # 1. scatter this rank's chunks to their owners
    if dead == 0:
        i = pid
        while i < items:
            owner = i // per_owner
            col = (i % NCHUNK) * CHUNK + cols
            cmask = col < H
            x = canonicalize(tl.load(x_ptr + (i // NCHUNK).to(tl.int64) * H + col, mask=cmask, other=0.0), SENT, ELEM_BITS)
            dst = slot_base + rank * region + (i - owner * per_owner).to(tl.int64) * CHUNK + cols
            for o in tl.static_range(W):
                tl.store(bufs[o] + dst, x, mask=and_scalar(cmask, (o == owner) & (o != rank)))
            i += nprog

    # 2. reduce the owned chunks in rank order and publish the sums to every rank
    fill = sentinel_like(tl.zeros([WP, CHUNK], dtype=local_ptr.dtype.element_ty), SENT, ELEM_BITS)
    own_end = tl.minimum((rank + 1) * per_owner, items)
    i = first_of(rank * per_owner, pid, nprog)
    while i < own_end:
        row = i // NCHUNK
        col = (i % NCHUNK) * CHUNK + cols
        cmask = col < H
        x = canonicalize(tl.load(x_ptr + row.to(tl.int64) * H + col, mask=cmask, other=0.0), SENT, ELEM_BITS)
        ptrs = local_ptr + slot_base + srcs[:, None] * region + ((i - rank * per_owner).to(tl.int64) * CHUNK + cols)
        m2 = (srcs[:, None] != rank) & (srcs[:, None] < W) & cmask
        v, pending, arrived = poll_block(ptrs, m2, deadline, max_spins, dead, abort_ptr, SENT, ELEM_BITS, USE_ASM)
        if (arrived == 0) & (dead == 0):
            fail(err_ptr, abort_ptr, bufs, rank, pending_ranks(pending, srcs), row, calls, W)
        dead = dead | (arrived == 0)
        tl.store(ptrs, fill, mask=m2)  # re-arm exactly what was read (a failed workspace is never read again)
        acc = sum_in_rank_order(v, x, srcs, rank, W)
        s = canonicalize(round_like(acc, x, SOFT_BF16), SENT, ELEM_BITS)
        dst = gather_base + row.to(tl.int64) * H + col
        for o in tl.static_range(W):
            tl.store(bufs[o] + dst, s, mask=and_scalar(cmask, dead == 0))
        i += nprog

    # 3. wait for each item's sum from its owner, then residual + norm (or its partial)
    fill1 = sentinel_like(tl.zeros([1, CHUNK], dtype=local_ptr.dtype.element_ty), SENT, ELEM_BITS)
    i = pid
    while i < items:
        row = i // NCHUNK
        owner = i // per_owner
        col = (i % NCHUNK) * CHUNK + cols
        cmask = col < H
        offs = row.to(tl.int64) * H + col
        r = tl.load(res_ptr + offs, mask=cmask & HAS_RES, other=0.0)
        w = tl.load(w_ptr + col, mask=cmask & HAS_NORM & (NCHUNK == 1), other=0.0).to(tl.float32)
        ptrs = local_ptr + gather_base + offs  # a [1, CHUNK] block: one source
        m1 = cmask
        v, pending, arrived = poll_block(ptrs, m1, deadline, max_spins, dead, abort_ptr, SENT, ELEM_BITS, USE_ASM)
        if (arrived == 0) & (dead == 0):
            fail(err_ptr, abort_ptr, bufs, rank, 1 << owner, row, calls, W)
        dead = dead | (arrived == 0)
        tl.store(ptrs, fill1, mask=m1)  # re-arm what was read
        s = tl.where(dead, float("nan"), v.to(tl.float32)).to(local_ptr.dtype.element_ty)
        residual_step(s, row, col, cmask, offs, r, w, newres_ptr, out_ptr, part_ptr, i, M, H, eps, calls, qargs,
                      CHUNK, HAS_RES, HAS_NORM, SPLIT, SOFT_BF16, QKIND, QGROUP, QSWIZZLED, QHAS_UB, QHW, WITH_NORMED)
        i += nprog

    if SPLIT:
        dead = norm_partials_pass(newres_ptr, w_ptr, out_ptr, part_ptr, pid, nprog, items, M, H, eps, calls, deadline,
                                  max_spins, dead, err_ptr, qargs, CHUNK, NCHUNK, NCP, USE_ASM, SOFT_BF16, QKIND,
                                  QGROUP, QSWIZZLED, QHAS_UB, QHW, WITH_NORMED)
        if QKIND == KIND_FP8_TOKEN_C:
            token_quant_pass(newres_ptr, w_ptr, part_ptr, pid, nprog, items, M, H, eps, calls, deadline, max_spins,
                             dead, err_ptr, qargs, CHUNK, NCHUNK, NCP, USE_ASM, QHAS_UB, QHW)

    # 4. the last program to arrive advances the epoch
    old = tl.atomic_add(state_ptr + _ARRIVE, 1)
    if old == nprog - 1:
        tl.store(state_ptr + _ARRIVE, 0)
        tl.store(state_ptr + _CALLS, (calls + 1) & 0x7FFFFFFF)


def twoshot_launch(x, residual, weight, eps, ws, *, timeout_s: float, max_programs: int, plan_programs: int,
                   has_norm: bool = True, warmup: bool = False, out: tuple | None = None, plan=None, quant=None):
    """Run one call on the current stream; returns what `oneshot_launch` returns (same arguments)."""
    return launch_peer_kernel(twoshot_kernel, "twoshot", x, residual, weight, eps, ws, timeout_s=timeout_s,
                              max_programs=max_programs, plan_programs=plan_programs, has_norm=has_norm,
                              warmup=warmup, out=out, plan=plan, quant=quant, twoshot=True)
