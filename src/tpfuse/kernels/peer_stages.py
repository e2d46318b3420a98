"""Device stages the peer kernels share (`tpfuse.kernels.oneshot`, `tpfuse.kernels.twoshot`).

After a chunk of a row has been reduced (sum of all ranks, rounded to the data dtype), both
kernels finish it the same way: new_residual, then the norm (a row of one chunk at once; a split
row through epoch-tagged sum-of-squares partials in `norm_partials_pass`), then the normed values
stored in the data dtype or quantized (`tpfuse.kernels.quant.quantize_chunk`; per-token FP8 of a
split row exchanges its absmax as a second partial and quantizes in `token_quant_pass`).

Deadlock freedom of the partials: every program publishes all of its partials of a kind before it
waits for any of that kind, and all programs of a launch are resident together (the grid never
exceeds the SMs given to this rank), so no program waits on a program that waits on it. A wait is
bounded; a stall records ERR_STALL and poisons the rows with NaN.

`qargs` (the quantized output): (codes, codes' row stride, scales, scale row stride, scale column
stride, static or global scale (a pointer until `start_quantized` loads it), scale bound).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse.kernels.epilogue import round_like
from tpfuse.kernels.quant import KIND_FP8_TOKEN, PAD_CHUNK, abs_bits, load_param, quantize_chunk, zero_scale_padding
from tpfuse.kernels.sync import and_scalar, publish_partial, stall, wait_partials

KIND_FP8_TOKEN_C = tl.constexpr(KIND_FP8_TOKEN)


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
    or with WITH_NORMED), and quantized (QKIND > 0, `tpfuse.kernels.quant.quantize_chunk`; qargs
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
