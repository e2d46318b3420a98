"""One-shot allreduce fused with residual-add + RMSNorm, over peer buffers (Lamport protocol).

Rows are cut into items (row, chunk) by `fusegate.kernels.protocol.make_plan`; program p handles
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
slots, epochs and error words: `fusegate.kernels.protocol`.

`ws` (the workspace) provides peers.views (W 1-D tensors), peers.local, state, err, partials,
region_elems, header_elems, sentinel and rank. CUDA-graph capturable: the state lives in device
memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusegate.kernels.epilogue import interpreting, round_like
from fusegate.kernels.protocol import MAX_HIDDEN, NUM_SLOTS, STATE_ARRIVE, STATE_CALLS, make_plan, region_elems_for
from fusegate.kernels.quant import (
    KIND_BY_NAME,
    KIND_FP8_TOKEN,
    PAD_CHUNK,
    QuantBuffers,
    abs_bits,
    load_param,
    quantize_chunk,
    zero_scale_padding,
)
from fusegate.kernels.sync import (
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
KIND_FP8_TOKEN_C = tl.constexpr(KIND_FP8_TOKEN)
# Interpreter spin bound per second of timeout: one interpreted poll of a 32-element row took
# about 1 ms on the 2-core CI-class machine (tests/kernels/test_interpreter.py timeout test).
INTERPRETER_SPINS_PER_S = 1_000


@triton.jit
def normed_fp32(h, w, ss, H, eps):
    """h * (1 / sqrt(ss / H + eps)) * w in fp32, correctly rounded steps (as the epilogue's)."""
    ms = tl.math.div_rn(ss, H.to(tl.float32))
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))
    return h * inv * w


@triton.jit
def store_normed(
    y, row, start, M, H, out_ptr, offs, cmask, like, qargs, row_amax,
    CHUNK: tl.constexpr, SOFT_BF16: tl.constexpr, QKIND: tl.constexpr, QGROUP: tl.constexpr,
    QSWIZZLED: tl.constexpr, QHAS_UB: tl.constexpr, QHW: tl.constexpr, WITH_NORMED: tl.constexpr,
    ROW_AMAX: tl.constexpr,
):
    """Store the chunk's normed values `y` (fp32): rounded to the data dtype (without quantization,
    or with WITH_NORMED), and quantized (QKIND > 0, `fusegate.kernels.quant.quantize_chunk`; qargs
    = (codes, codes' row stride, scales, scale row stride, scale column stride, static or global
    scale (loaded, `start_quantized`), scale bound), `row_amax` the row's absmax bits when ROW_AMAX)."""
    if (QKIND == 0) | WITH_NORMED:
        tl.store(out_ptr + offs, round_like(y, like, SOFT_BF16), mask=cmask)
    if QKIND != 0:
        quantize_chunk(tl.reshape(y, [CHUNK]), row, start, M, H, qargs[0], qargs[1], qargs[2], qargs[3], qargs[4],
                       qargs[5], qargs[6], row_amax, QKIND, QGROUP, CHUNK, QSWIZZLED, QHAS_UB, QHW, ROW_AMAX)


@triton.jit
def row_amax_of(part_ptr, items, row, calls, deadline, max_spins, dead, err_ptr,
                NCHUNK: tl.constexpr, NCP: tl.constexpr, USE_ASM: tl.constexpr):
    """(absmax bits of `row` from its chunks' published partials, dead): per-token FP8 of a split
    row. The absmax partials sit after the norm partials (`part_ptr + items + item`)."""
    parts = tl.arange(0, NCP)
    a, ok = wait_partials(part_ptr + items + row * NCHUNK + parts, parts < NCHUNK, calls, deadline, max_spins,
                          dead, USE_ASM)
    if (ok == 0) & (dead == 0):
        stall(err_ptr, row, calls)
    dead = dead | (ok == 0)
    amax = tl.max(a.to(tl.int32, bitcast=True), axis=0)
    return tl.where(dead, 0x7FC00000, amax), dead  # a failed row's scale is NaN


@triton.jit
def publish_amax(part_ptr, items, i, y, cmask, calls):
    """Publish the absmax (as |y| bits) of item i's chunk, for `row_amax_of`."""
    publish_partial(part_ptr + items, i, tl.max(abs_bits(y, cmask)).to(tl.float32, bitcast=True), calls)


@triton.jit
def start_quantized(qargs, pid, nprog, M, H, QKIND: tl.constexpr, QSWIZZLED: tl.constexpr, QNG: tl.constexpr):
    """At a peer kernel's start, before it waits for any peer: zero the 128x4-swizzled NVFP4
    scales of the padding rows (M .. align128(M); they depend on no data), spread over the
    programs, and load the static / global scale. Returns qargs with that scale in place of its
    pointer, so no load of it sits at the end of a row's dependency chain."""
    if QSWIZZLED:
        num_pad = ((M + 127) // 128 * 128 - M + PAD_CHUNK - 1) // PAD_CHUNK
        c = pid
        while c < num_pad:
            zero_scale_padding(qargs[2], M, H, c, QNG, PAD_CHUNK)
            c += nprog
    return qargs[0], qargs[1], qargs[2], qargs[3], qargs[4], load_param(qargs[5], QKIND), qargs[6]


@triton.jit
def norm_partials_pass(
    newres_ptr, w_ptr, out_ptr, part_ptr, pid, nprog, items, M, H, eps, calls, deadline, max_spins, dead, err_ptr,
    qargs, CHUNK: tl.constexpr, NCHUNK: tl.constexpr, NCP: tl.constexpr, USE_ASM: tl.constexpr,
    SOFT_BF16: tl.constexpr, QKIND: tl.constexpr, QGROUP: tl.constexpr, QSWIZZLED: tl.constexpr,
    QHAS_UB: tl.constexpr, QHW: tl.constexpr, WITH_NORMED: tl.constexpr,
):
    """Phase 3 of split rows: wait for each row's partials, sum them in chunk order, write normed
    (or quantize it). Per-token FP8 publishes each chunk's absmax here and quantizes in a second
    pass (`token_quant_pass`), once every program has published: the same no-waiter-waits order.

    The next item's loads are issued before this item is finished, so their latency overlaps.
    Returns `dead`.
    """
    cols = tl.arange(0, CHUNK)
    parts = tl.arange(0, NCP)
    pmask = parts < NCHUNK
    i = pid
    row = i // NCHUNK
    col = (i % NCHUNK) * CHUNK + cols
    cmask = and_scalar(col < H, i < items)
    w_next = tl.load(w_ptr + col, mask=cmask, other=0.0)
    nr_next = tl.load(newres_ptr + row.to(tl.int64) * H + col, mask=cmask, other=0.0)
    while i < items:
        row = i // NCHUNK
        start = (i % NCHUNK) * CHUNK
        col = start + cols
        cmask = col < H
        offs = row.to(tl.int64) * H + col
        w, nr = w_next.to(tl.float32), nr_next
        j = i + nprog
        col_j = (j % NCHUNK) * CHUNK + cols
        cmask_j = and_scalar(col_j < H, j < items)
        w_next = tl.load(w_ptr + col_j, mask=cmask_j, other=0.0)
        nr_next = tl.load(newres_ptr + (j // NCHUNK).to(tl.int64) * H + col_j, mask=cmask_j, other=0.0)
        p, ok = wait_partials(part_ptr + row * NCHUNK + parts, pmask, calls, deadline, max_spins, dead, USE_ASM)
        if (ok == 0) & (dead == 0):
            stall(err_ptr, row, calls)
        dead = dead | (ok == 0)
        ss = tl.sum(p, axis=0)
        ss = tl.where(dead, float("nan"), ss)
        y = normed_fp32(nr.to(tl.float32), w, ss, H, eps)
        if QKIND == KIND_FP8_TOKEN_C:
            publish_amax(part_ptr, items, i, y, cmask, calls)
            if WITH_NORMED:  # the codes come in token_quant_pass
                tl.store(out_ptr + offs, round_like(y, nr, SOFT_BF16), mask=cmask)
        else:
            store_normed(y, row, start, M, H, out_ptr, offs, cmask, nr, qargs, 0, CHUNK, SOFT_BF16, QKIND, QGROUP,
                         QSWIZZLED, QHAS_UB, QHW, WITH_NORMED, False)
        i = j
    return dead


@triton.jit
def token_quant_pass(
    newres_ptr, w_ptr, part_ptr, pid, nprog, items, M, H, eps, calls, deadline, max_spins, dead, err_ptr, qargs,
    CHUNK: tl.constexpr, NCHUNK: tl.constexpr, NCP: tl.constexpr, USE_ASM: tl.constexpr, QHAS_UB: tl.constexpr,
    QHW: tl.constexpr,
):
    """Per-token FP8 of split rows, after `norm_partials_pass`: recompute each chunk's normed values
    (the same loads and arithmetic, so the same bits), then quantize them with the row's absmax."""
    cols = tl.arange(0, CHUNK)
    parts = tl.arange(0, NCP)
    i = pid
    while i < items:
        row = i // NCHUNK
        start = (i % NCHUNK) * CHUNK
        col = start + cols
        cmask = col < H
        w = tl.load(w_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        nr = tl.load(newres_ptr + row.to(tl.int64) * H + col, mask=cmask, other=0.0)
        p, ok = wait_partials(part_ptr + row * NCHUNK + parts, parts < NCHUNK, calls, deadline, max_spins, dead,
                              USE_ASM)  # already published: this returns at once
        dead = dead | (ok == 0)
        amax, dead = row_amax_of(part_ptr, items, row, calls, deadline, max_spins, dead, err_ptr, NCHUNK, NCP, USE_ASM)
        ss = tl.where(dead, float("nan"), tl.sum(p, axis=0))
        y = normed_fp32(nr.to(tl.float32), w, ss, H, eps)
        quantize_chunk(y, row, start, M, H, qargs[0], qargs[1], qargs[2], qargs[3], qargs[4], qargs[5], qargs[6], amax,
                       KIND_FP8_TOKEN_C, 0, CHUNK, False, QHAS_UB, QHW, True)
        i += nprog


@triton.jit
def residual_step(
    s, row, col, cmask, offs, r, w, newres_ptr, out_ptr, part_ptr, i, M, H, eps, calls, qargs, CHUNK: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, SPLIT: tl.constexpr, SOFT_BF16: tl.constexpr,
    QKIND: tl.constexpr, QGROUP: tl.constexpr, QSWIZZLED: tl.constexpr, QHAS_UB: tl.constexpr, QHW: tl.constexpr,
    WITH_NORMED: tl.constexpr,
):
    """After the reduced chunk `s` (data dtype): new_residual, and normed (quantized) or its partial."""
    if HAS_NORM:
        if HAS_RES:
            nr = round_like(s.to(tl.float32) + r.to(tl.float32), s, SOFT_BF16)
        else:
            nr = s
        tl.store(newres_ptr + offs, nr, mask=cmask)
        h = nr.to(tl.float32)
        ss = tl.sum(tl.where(cmask, h * h, 0.0))
        if SPLIT:
            publish_partial(part_ptr, i, ss, calls)
        else:  # the chunk is the whole row
            store_normed(normed_fp32(h, w, ss, H, eps), row, 0, M, H, out_ptr, offs, cmask, s, qargs, 0, CHUNK,
                         SOFT_BF16, QKIND, QGROUP, QSWIZZLED, QHAS_UB, QHW, WITH_NORMED, False)
    else:
        tl.store(out_ptr + offs, s, mask=cmask)


@triton.jit
def item_at(i, H, cols, CHUNK: tl.constexpr, NCHUNK: tl.constexpr):
    """(row, columns, column mask, element offsets) of item i."""
    row = i // NCHUNK
    col = (i % NCHUNK) * CHUNK + cols
    return row, col, col < H, row.to(tl.int64) * H + col


@triton.jit
def sum_in_rank_order(v, x, srcs, rank, W: tl.constexpr):
    """fp32 sum over ranks 0..W-1 in that order: rows of `v` for peers, `x` for this rank itself."""
    acc = tl.zeros(x.shape, dtype=tl.float32)
    vf = v.to(tl.float32)
    for src in tl.static_range(W):
        mine = tl.sum(tl.where(srcs[:, None] == src, vf, 0.0), axis=0, keep_dims=True)  # one row: in-thread adds
        acc += tl.where(rank == src, x.to(tl.float32), mine)
    return acc


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


def spin_bounds(timeout_s: float) -> tuple[int, int]:
    """(timeout in ns for GPUs, spin count for the interpreter) of one wait."""
    return int(timeout_s * 1e9), max(1, int(timeout_s * INTERPRETER_SPINS_PER_S))


def check_fits(where: str, x, ws, plan, *, twoshot: bool, quant=None) -> None:
    m, h = x.shape
    if h > MAX_HIDDEN:
        raise ValueError(f"{where}: hidden size {h} exceeds {MAX_HIDDEN}; use strategy='nccl_epilogue'")
    need = region_elems_for(m, h, len(ws.peers.views), plan, twoshot=twoshot)
    if need > ws.region_elems or (plan.split and partials_needed(plan, quant) > ws.partials.numel()):
        raise ValueError(f"{where}: {m}x{h} elements exceed the workspace region of {ws.region_elems}; "
                         "call prepare() with a larger max_tokens")
    if quant is not None and not quantizes_in_kernel(plan, quant):
        raise ValueError(f"{where}: chunks of {plan.chunk} elements do not hold whole {quant.kind} scale blocks; "
                         "quantize after the allreduce (fusegate.kernels.epilogue.residual_rmsnorm)")


def partials_needed(plan, quant) -> int:
    """Partials of a split row's call: norm partials, and absmax partials for per-token FP8."""
    return plan.items * (2 if quant is not None and quant.kind == "fp8_per_token" else 1)


def quantizes_in_kernel(plan, quant) -> bool:
    """Whether the peer kernels can quantize this plan's chunks themselves (`quantize_chunk`): a
    chunk must hold whole scale blocks (per-group FP8: GROUP columns; NVFP4: 64, so that the
    row's last chunk also covers the padded scale columns). Plans' chunks are powers of two of at
    least 128 elements, so every format of `fusegate.quant` at group <= 128 qualifies."""
    if quant.kind == "fp8_per_group":
        return plan.chunk % quant.group == 0
    if quant.kind == "nvfp4":
        return plan.chunk % 64 == 0
    return True


def quant_buffers(x, quant, with_normed_out):
    """(QuantBuffers or None, the kernels' qargs tuple, normed output or None) of one call."""
    if quant is None:
        return None, (x, 0, x, 0, 0, x, 0.0), None
    from fusegate.kernels.epilogue import hardware_fp4, hardware_fp8

    m, h = x.shape
    buf = QuantBuffers(quant, m, h, x.device, hardware_fp8(x.device), hardware_fp4(x.device))
    qargs = (buf.codes, buf.codes.stride(0), buf.scales, *buf.s_strides, buf.param, buf.scale_ub)
    normed = (with_normed_out if with_normed_out is not None else torch.empty_like(x)) if quant.with_normed else None
    return buf, qargs, normed


def launch_args(x, residual, weight, ws, out, has_norm, quant=None):
    """(out, new_residual, QuantBuffers or None, the pointer arguments both peer kernels share)."""
    given, given_res = out if out is not None else (None, None)  # caller's buffers (tests poison them with NaN)
    out = given if given is not None else torch.empty_like(x)
    new_res = (given_res if given_res is not None else torch.empty_like(x)) if has_norm else out
    buf, qargs, normed = quant_buffers(x, quant, given)
    if quant is not None:
        out = normed
    ptrs = (x, residual if residual is not None else x, weight if weight is not None else x,
            out if out is not None else x, new_res, tuple(ws.peers.views), ws.peers.local, ws.partials, ws.state,
            ws.err, qargs)
    return out, new_res, buf, ptrs


def kernel_meta(x, residual, ws, plan, has_norm, quant=None) -> dict:
    world = len(ws.peers.views)
    h = x.shape[1]
    return dict(W=world, WP=triton.next_power_of_2(world), CHUNK=plan.chunk, NCHUNK=plan.num_chunks,
                NCP=triton.next_power_of_2(plan.num_chunks), SENT=ws.sentinel, ELEM_BITS=8 * x.element_size(),
                HAS_RES=residual is not None, HAS_NORM=has_norm, SPLIT=has_norm and plan.split, USE_ASM=not interpreting(),
                SOFT_BF16=interpreting(), num_warps=plan.num_warps,
                QKIND=KIND_BY_NAME[quant.kind] if quant is not None else 0, QGROUP=(quant.group or 16) if quant else 16,
                QSWIZZLED=quant is not None and quant.layout == "swizzled",
                QHAS_UB=quant is not None and quant.scale_ub is not None,
                QHW=quant_hw_bits(x.device, quant), WITH_NORMED=quant is not None and quant.with_normed,
                QNG=triton.next_power_of_2(max(4, -(-(h // 16) // 4) * 4)))


def quant_hw_bits(device, quant) -> int:
    """HW_CVT bits of `fusegate.kernels.quant` for `device` (0 without quantization)."""
    if quant is None:
        return 0
    from fusegate.kernels.epilogue import hardware_fp4, hardware_fp8

    return int(hardware_fp8(device)) | (2 if hardware_fp4(device) else 0)


def finish_outputs(out, new_res, buf, has_norm):
    """What a launcher returns: (out, new_residual), or a QuantOutput with quantization."""
    if buf is None:
        return out, (new_res if has_norm else None)
    from fusegate.quant import QuantOutput

    return QuantOutput(buf.out, buf.scale, new_res, out)


def grid_for(plan, max_programs: int) -> tuple[int]:
    programs = max(1, min(plan.items, max_programs))
    if interpreting() and plan.split:
        programs = 1  # the interpreter runs programs one after another: one program owns every row
    return (programs,)


def oneshot_launch(x, residual, weight, eps, ws, *, timeout_s: float, max_programs: int, plan_programs: int,
                   has_norm: bool = True, warmup: bool = False, out: tuple | None = None, plan=None, quant=None):
    """Run one call on the current stream; returns (out, new_residual) (new_residual is None without norm),
    or with `quant` (a `fusegate.quant.QuantSpec`, checked by the caller) a QuantOutput quantized in
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


def launch_peer_kernel(kernel, where, x, residual, weight, eps, ws, *, timeout_s, max_programs, plan_programs,
                       has_norm, warmup, out, plan, quant, twoshot):
    """The launcher both peer kernels share (their arguments are the same)."""
    m, h = x.shape
    plan = plan or make_plan(m, h, x.element_size(), plan_programs)
    check_fits(where, x, ws, plan, twoshot=twoshot, quant=quant)
    out, new_res, buf, ptrs = launch_args(x, residual, weight, ws, out, has_norm, quant)
    timeout_ns, max_spins = spin_bounds(timeout_s)
    args = ptrs + (ws.rank, m, h, ws.region_elems, ws.header_elems, float(eps), timeout_ns, max_spins)
    meta = kernel_meta(x, residual, ws, plan, has_norm, quant)
    grid = grid_for(plan, max_programs)
    if warmup:
        if not interpreting():
            kernel.warmup(*args, grid=grid, **meta)
        return None
    kernel[grid](*args, **meta)
    return finish_outputs(out, new_res, buf, has_norm)
