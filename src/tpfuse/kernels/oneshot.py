"""One-shot allreduce fused with residual-add + RMSNorm, over peer buffers (Lamport protocol).

Rows are cut into items (row, chunk) by `tpfuse.kernels.protocol.make_plan`; program p handles
items p, p + G, ... in every phase:
  1. push: load the chunk, canonicalise -0.0, store it into region `rank` of the current slot of
     every *other* rank's buffer (plain stores, 16 bytes per thread);
  2. reduce: issue the loads of all W - 1 sources at once, poll until none holds the sentinel
     (`sync.poll_block`), re-arm exactly what was read, sum in fp32 in rank order 0..W-1 with this
     rank's own chunk taken from its input (so every rank adds the same values in the same order:
     identical bits), round to the dtype, add the residual, store new_residual;
  3. norm: a row of one chunk is finished at once; a row of several chunks publishes its sum of
     squares as an epoch-tagged partial, and (after all of this program's items are published, so
     no program waits on one that waits on it) every program reads its rows' partials in chunk
     order and writes normed;
  4. arrive: the last program advances the epoch.
A rank that failed earlier, or whose abort word is set, pushes nothing and writes NaN. Layout,
slots, epochs and error words: `tpfuse.kernels.protocol`.

The finishing stages (norm, quantized stores, split-row partials) are shared with two-shot
(`tpfuse.kernels.peer_stages`), and so is the host side (`tpfuse.kernels.peer_launch`).
CUDA-graph capturable: the state lives in device memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse.kernels.epilogue import round_like
from tpfuse.kernels.peer_launch import launch_peer_kernel
from tpfuse.kernels.peer_stages import (
    KIND_FP8_TOKEN_C,
    item_at,
    norm_partials_pass,
    normed_fp32,
    publish_amax,
    residual_step,
    row_amax_of,
    start_quantized,
    store_normed,
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
    poll_from,
    publish_partial,
    sentinel_like,
    stall,
    start_deadline,
    wait_partials,
)

_CALLS, _ARRIVE, _SLOTS = tl.constexpr(STATE_CALLS), tl.constexpr(STATE_ARRIVE), tl.constexpr(NUM_SLOTS)


@triton.jit(do_not_specialize=["rank", "M", "timeout_ns", "max_spins"])
def oneshot_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, newres_ptr, bufs, local_ptr, part_ptr, state_ptr, err_ptr, qargs,
    rank, M, H, region, header, eps, timeout_ns, max_spins,
    W: tl.constexpr, WP: tl.constexpr, CHUNK: tl.constexpr, NCHUNK: tl.constexpr, NCP: tl.constexpr,
    SENT: tl.constexpr, ELEM_BITS: tl.constexpr, HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr,
    SPLIT: tl.constexpr, USE_ASM: tl.constexpr, SOFT_BF16: tl.constexpr, QKIND: tl.constexpr, QGROUP: tl.constexpr,
    QSWIZZLED: tl.constexpr, QHAS_UB: tl.constexpr, QHW: tl.constexpr, WITH_NORMED: tl.constexpr, QNG: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # [1, CHUNK] tensors share the [sources, CHUNK] block's layout: no layout conversions
    cols = tl.arange(0, CHUNK)[None, :]
    srcs = tl.arange(0, WP)
    items = M * NCHUNK
    # One item per program (decode sizes): its inputs are loaded first, so their latency overlaps
    # the reads of the state and error words that the push has to wait for.
    single = items <= nprog
    row, col, cmask, offs = item_at(pid, H, cols, CHUNK, NCHUNK)
    first = and_scalar(cmask, single & (pid < items))
    x = canonicalize(tl.load(x_ptr + offs, mask=first, other=0.0), SENT, ELEM_BITS)
    r = tl.load(res_ptr + offs, mask=first & HAS_RES, other=0.0)
    w = tl.load(w_ptr + col, mask=first & HAS_NORM, other=0.0).to(tl.float32)
    calls = tl.load(state_ptr + _CALLS)
    qargs = start_quantized(qargs, pid, nprog, M, H, QKIND, QSWIZZLED, QNG)
    abort_ptr = int32_ptr(local_ptr)
    dead = entry_state(err_ptr, abort_ptr, rank, calls)
    deadline = start_deadline(timeout_ns, USE_ASM)
    slot_base = header + (calls % _SLOTS).to(tl.int64) * W * region
    fill = sentinel_like(tl.zeros([WP, CHUNK], dtype=local_ptr.dtype.element_ty), SENT, ELEM_BITS)
    peer_rows = (srcs[:, None] != rank) & (srcs[:, None] < W)

    if single:
        # every phase in one pass, nothing loaded twice
        if pid < items:
            dst = slot_base + rank * region + offs
            for p in tl.static_range(W):
                tl.store(bufs[p] + dst, x, mask=and_scalar(cmask, (p != rank) & (dead == 0)))
            ptrs = local_ptr + slot_base + srcs[:, None] * region + offs
            m2 = peer_rows & cmask
            v, pending, arrived = poll_block(ptrs, m2, deadline, max_spins, dead, abort_ptr, SENT, ELEM_BITS, USE_ASM)
            if (arrived == 0) & (dead == 0):
                fail(err_ptr, abort_ptr, bufs, rank, pending_ranks(pending, srcs), row, calls, W)
            dead = dead | (arrived == 0)
            tl.store(ptrs, fill, mask=m2)  # re-arm exactly what was read (a failed workspace is never read again)
            acc = tl.where(dead, float("nan"), sum_in_rank_order(v, x, srcs, rank, W))
            s = round_like(acc, x, SOFT_BF16)
            if SPLIT:  # every program has published before any waits: no program waits on a waiter
                nr = s
                if HAS_RES:
                    nr = round_like(s.to(tl.float32) + r.to(tl.float32), s, SOFT_BF16)
                tl.store(newres_ptr + offs, nr, mask=cmask)
                h = nr.to(tl.float32)
                publish_partial(part_ptr, pid, tl.sum(tl.where(cmask, h * h, 0.0)), calls)
                parts = tl.arange(0, NCP)
                p, ok = wait_partials(part_ptr + row * NCHUNK + parts, parts < NCHUNK, calls, deadline, max_spins,
                                      dead, USE_ASM)
                if (ok == 0) & (dead == 0):
                    stall(err_ptr, row, calls)
                dead = dead | (ok == 0)
                ss = tl.where(dead, float("nan"), tl.sum(p, axis=0))
                y = normed_fp32(h, w, ss, H, eps)
                start = (pid % NCHUNK) * CHUNK
                if QKIND == KIND_FP8_TOKEN_C:  # the row's absmax, from its chunks' programs
                    publish_amax(part_ptr, items, pid, y, cmask, calls)
                    amax, dead = row_amax_of(part_ptr, items, row, calls, deadline, max_spins, dead, err_ptr, NCHUNK,
                                             NCP, USE_ASM)
                    store_normed(y, row, start, M, H, out_ptr, offs, cmask, s, qargs, amax, CHUNK, SOFT_BF16, QKIND,
                                 QGROUP, QSWIZZLED, QHAS_UB, QHW, WITH_NORMED, True)
                else:
                    store_normed(y, row, start, M, H, out_ptr, offs, cmask, s, qargs, 0, CHUNK, SOFT_BF16, QKIND,
                                 QGROUP, QSWIZZLED, QHAS_UB, QHW, WITH_NORMED, False)
            else:
                residual_step(s, row, col, cmask, offs, r, w, newres_ptr, out_ptr, part_ptr, pid, M, H, eps, calls,
                              qargs, CHUNK, HAS_RES, HAS_NORM, SPLIT, SOFT_BF16, QKIND, QGROUP, QSWIZZLED, QHAS_UB,
                              QHW, WITH_NORMED)
    else:
        # 1. push this rank's chunks into every other rank's current slot, region `rank`
        # (the next item's input is loaded before this one is stored: the loads overlap the stores)
        if dead == 0:
            i = pid
            _, _, cmask, offs = item_at(i, H, cols, CHUNK, NCHUNK)
            x_next = tl.load(x_ptr + offs, mask=cmask, other=0.0)
            while i < items:
                _, _, cmask, offs = item_at(i, H, cols, CHUNK, NCHUNK)
                x = canonicalize(x_next, SENT, ELEM_BITS)
                j = i + nprog
                _, _, cmask_j, offs_j = item_at(j, H, cols, CHUNK, NCHUNK)
                x_next = tl.load(x_ptr + offs_j, mask=and_scalar(cmask_j, j < items), other=0.0)
                dst = slot_base + rank * region + offs
                for p in tl.static_range(W):
                    tl.store(bufs[p] + dst, x, mask=and_scalar(cmask, p != rank))
                i = j

        # 2. reduce in rank order; new_residual; normed or its partial. The next item's sources
        # are loaded before this item is finished, so their latency overlaps this item's work.
        i = pid
        row, col, cmask, offs = item_at(i, H, cols, CHUNK, NCHUNK)
        ptrs = local_ptr + slot_base + srcs[:, None] * region + offs
        m2 = peer_rows & cmask
        v_next = tl.load(ptrs, mask=and_scalar(m2, dead == 0), other=0.0, volatile=True)
        while i < items:
            row, col, cmask, offs = item_at(i, H, cols, CHUNK, NCHUNK)
            x = canonicalize(tl.load(x_ptr + offs, mask=cmask, other=0.0), SENT, ELEM_BITS)
            r = tl.load(res_ptr + offs, mask=cmask & HAS_RES, other=0.0)
            w = tl.load(w_ptr + col, mask=cmask & HAS_NORM & (NCHUNK == 1), other=0.0).to(tl.float32)
            ptrs = local_ptr + slot_base + srcs[:, None] * region + offs
            m2 = peer_rows & cmask
            v, pending, arrived = poll_from(v_next, ptrs, m2, deadline, max_spins, dead, abort_ptr, SENT, ELEM_BITS, USE_ASM)
            if (arrived == 0) & (dead == 0):
                fail(err_ptr, abort_ptr, bufs, rank, pending_ranks(pending, srcs), row, calls, W)
            dead = dead | (arrived == 0)
            j = i + nprog
            _, _, cmask_j, offs_j = item_at(j, H, cols, CHUNK, NCHUNK)
            v_next = tl.load(local_ptr + slot_base + srcs[:, None] * region + offs_j,
                             mask=and_scalar(peer_rows & cmask_j, (dead == 0) & (j < items)),
                             other=0.0, volatile=True)
            tl.store(ptrs, fill, mask=m2)  # re-arm exactly what was read (a failed workspace is never read again)
            acc = tl.where(dead, float("nan"), sum_in_rank_order(v, x, srcs, rank, W))
            s = round_like(acc, x, SOFT_BF16)
            residual_step(s, row, col, cmask, offs, r, w, newres_ptr, out_ptr, part_ptr, i, M, H, eps, calls, qargs,
                          CHUNK, HAS_RES, HAS_NORM, SPLIT, SOFT_BF16, QKIND, QGROUP, QSWIZZLED, QHAS_UB, QHW,
                          WITH_NORMED)
            i = j

        # 3. split rows: every partial of this program is published; now finish the norm
        if SPLIT:
            dead = norm_partials_pass(newres_ptr, w_ptr, out_ptr, part_ptr, pid, nprog, items, M, H, eps, calls,
                                      deadline, max_spins, dead, err_ptr, qargs, CHUNK, NCHUNK, NCP, USE_ASM,
                                      SOFT_BF16, QKIND, QGROUP, QSWIZZLED, QHAS_UB, QHW, WITH_NORMED)
            if QKIND == KIND_FP8_TOKEN_C:
                token_quant_pass(newres_ptr, w_ptr, part_ptr, pid, nprog, items, M, H, eps, calls, deadline,
                                 max_spins, dead, err_ptr, qargs, CHUNK, NCHUNK, NCP, USE_ASM, QHAS_UB, QHW)

    # 4. the last program to arrive advances the epoch
    old = tl.atomic_add(state_ptr + _ARRIVE, 1)
    if old == nprog - 1:
        tl.store(state_ptr + _ARRIVE, 0)
        tl.store(state_ptr + _CALLS, (calls + 1) & 0x7FFFFFFF)


def oneshot_launch(x, residual, weight, eps, ws, *, timeout_s: float, max_programs: int, plan_programs: int,
                   has_norm: bool = True, warmup: bool = False, out: tuple | None = None, plan=None, quant=None):
    """Run one call on the current stream; returns (out, new_residual) (new_residual is None without norm),
    or with `quant` (a `tpfuse.quant.QuantSpec`, checked by the caller) a QuantOutput quantized in
    this kernel (`quantizes_in_kernel(plan, quant)` must hold).

    x (M, H) contiguous and fitting the workspace; weight (H,) (ignored without norm).
    `plan_programs` sizes the work plan (identical on every rank); `max_programs` caps the grid.
    `warmup=True` compiles the kernel without launching it (call before any collective use).
    `out=(out, new_residual)` writes into given buffers (new_residual ignored without norm; with
    `quant`, out is the unquantized normed output the spec asks for).
    """
    return launch_peer_kernel(oneshot_kernel, "oneshot", x, residual, weight, eps, ws, timeout_s=timeout_s,
                              max_programs=max_programs, plan_programs=plan_programs, has_norm=has_norm,
                              warmup=warmup, out=out, plan=plan, quant=quant, twoshot=False)
