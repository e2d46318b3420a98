"""Device stages the peer kernels share (`tpfuse.kernels.oneshot`, `tpfuse.kernels.twoshot`), and
the two compile-time bundles every stage takes.

- `PeerConfig` (C): the kernel's shape of work and build (world size, chunking, sentinel, which
  outputs, GPU or interpreter, programmatic dependent launch, spin kind, paths);
- `QuantOpts` (Q): the quantized output's format (`tpfuse.kernels.quant` constants), kind 0 = none.

Both are NamedTuples passed as `tl.constexpr`: one argument each, read by field (`C.chunk`,
`Q.kind`) wherever needed, and part of the compile key. Build them with `of(...)`, which holds every
field as a `tl.constexpr` (so a field serves as a shape, a `static_range` bound or a constexpr
argument in compiled code as well as in the interpreter; host code reads it with bool() / int()).

Both reduce an item of every other source the same way: polled all at once per thread
(`reduce_sources`: one-shot's decode, two-shot's chunk owners, at spin 4) or as a [sources, chunk]
block (`reduce_block`: the interpreter and lower spin levels). After a chunk of a row has been
reduced (sum of all ranks, rounded to the data dtype), both kernels finish it the same way:
new_residual, then the norm (a row of one chunk at once; a split row through epoch-tagged
sum-of-squares partials, `finish_split_chunk`), then the normed values stored in the data dtype
or quantized (`tpfuse.kernels.quant.quantize_chunk`; per-token FP8 of a split row publishes each
chunk's max |h * w| beside its sum of squares, so the row's absmax, `token_amax`, arrives in the
same exchange). Both end in `kernel_tail`: the split-row pass, the epoch words, the end-of-kernel
launch trigger.

Deadlock freedom of the partials: every program publishes all of its partials of a kind before it
waits for any of that kind, and all programs of a launch are resident together (the launcher
checks that the grid fits the GPU), so no program waits on a program that waits on it. A wait is
bounded; a stall records ERR_STALL, tells every rank and poisons the rows with NaN.

Runtime bundles (tuples): `qargs` (codes, codes' row stride, scales, scale row stride, scale
column stride, static or global scale (a pointer until `start_quantized` loads it), scale bound);
`fx` (err, errmap, abort word, rank, peer buffers): where failures go; `tm` (deadline, spin bound,
partials' deadline, partials' spin bound).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from tpfuse.kernels.epilogue import inverse_rms_of, round_like
from tpfuse.kernels.protocol import MAX_GRID
from tpfuse.kernels.quant import (
    KIND_FP8_TOKEN,
    PAD_WORDS,
    abs_bits,
    load_param,
    quantize_chunk,
    token_amax,
    zero_scale_padding,
)
from tpfuse.kernels.sync import (
    and_scalar,
    fail,
    pdl_trigger_at_end,
    poll_block,
    poll_sources,
    publish_partial,
    row_partials,
    row_sum_and_max,
    sentinel_like,
    source_status,
    sources_failed,
    stall,
)

KIND_FP8_TOKEN_C = tl.constexpr(KIND_FP8_TOKEN)
MAX_GRID_C = tl.constexpr(MAX_GRID)


class PeerConfig(NamedTuple):
    """Compile-time facts of one peer-kernel variant (see the module docstring)."""

    world: int  # W ranks
    world_p2: int  # next power of two >= W (the sources' block)
    chunk: int  # elements per item
    num_chunks: int  # items per row
    num_chunks_p2: int  # next power of two >= num_chunks (a row's partials)
    sentinel: int  # -0.0's bits in the data dtype, as a signed integer
    elem_bits: int  # 16 or 32
    has_res: bool
    has_norm: bool
    split: bool  # rows of several chunks exchange norm partials
    use_asm: bool  # GPU build: %globaltimer deadlines, strong stores, PDL, the asm spin
    soft_bf16: bool  # round to bf16 in software (the interpreter)
    pdl: int  # programmatic dependent launch: 0 off, 1 on with the trigger at the end, 2 trigger at entry
    spin: int  # per-thread spins in inline assembly (GPU builds): 1 data polls, 2 also partials and row words,
    # 3 also one wait on every tag before a one-shot decode poll, 4 instead a poll of every source at once
    single: bool  # one-shot: every program holds at most one item (one pass)
    rows_owned: bool  # two-shot: owners hold whole rows and push each row's sum of squares
    per_poll: int  # two-shot whole rows: items a program receives per poll (a power of two)
    per_push: int  # two-shot whole rows: items a program scatters per step (a power of two)

    @classmethod
    def of(cls, **fields) -> PeerConfig:
        return cls(*(tl.constexpr(v) for v in cls(**fields)))


class QuantOpts(NamedTuple):
    """The quantized output's compile-time format (`tpfuse.kernels.quant`); kind 0: none."""

    kind: int = 0
    group: int = 16
    swizzled: bool = False
    has_ub: bool = False
    hw: int = 0  # HW_CVT bits
    with_normed: bool = False

    @classmethod
    def of(cls, **fields) -> QuantOpts:
        return cls(*(tl.constexpr(v) for v in cls(**fields)))


@triton.jit
def normed_fp32(h, w, ss, H, eps):
    """(h * w) * (1 / sqrt(ss / H + eps)) in fp32, correctly rounded steps (as the epilogue's)."""
    return (h * w) * inverse_rms_of(ss, H, eps)


@triton.jit
def store_normed(y, row, start, M, H, out_ptr, offs, cmask, like, qargs, row_amax, C: tl.constexpr,
                 Q: tl.constexpr, ROW_AMAX: tl.constexpr):
    """Store the chunk's normed values `y` (fp32, [1, chunk]): rounded to the data dtype (without
    quantization, or with Q.with_normed), and quantized (Q.kind > 0, `quantize_chunk`, with
    `row_amax` the row's absmax bits when ROW_AMAX)."""
    if (Q.kind == 0) | Q.with_normed:
        tl.store(out_ptr + offs, round_like(y, like, C.soft_bf16), mask=cmask)
    if Q.kind != 0:
        CHUNK: tl.constexpr = C.chunk  # shapes take constexprs, not a bundle's plain fields
        quantize_chunk(tl.reshape(y, [CHUNK]), row, start, M, H, qargs[0], qargs[1], qargs[2], qargs[3], qargs[4],
                       qargs[5], qargs[6], row_amax, Q.kind, Q.group, C.chunk, Q.swizzled, Q.has_ub, Q.hw, ROW_AMAX)


@triton.jit
def _sum_and_max(a_sum, a_max, b_sum, b_max):
    return a_sum + b_sum, tl.maximum(a_max, b_max)


@triton.jit
def publish_row_partials(part_ptr, items, i, h, w, cmask, calls, C: tl.constexpr, Q: tl.constexpr):
    """Publish item i's partials of its split row: the sum of squares of `h` (fp32 new residual),
    and for per-token FP8 the max |h * w| (as `abs_bits`) after all `items` sums, in the same
    exchange: the row's absmax is then known with its norm (`token_amax`). GPU builds reduce the
    two in one block reduction (tl.sum is itself a tl.reduce with an add, so the sum keeps its
    tree); the interpreter, whose reductions of tuples run element by element, takes two."""
    sq = tl.where(cmask, h * h, 0.0)
    if Q.kind == KIND_FP8_TOKEN_C:
        if C.use_asm:
            ss, hw_max = tl.reduce((sq, abs_bits(h * w, cmask)), None, _sum_and_max)
        else:
            ss, hw_max = tl.sum(sq), tl.max(abs_bits(h * w, cmask))
        publish_partial(part_ptr, i, ss, calls)
        publish_partial(part_ptr + items, i, hw_max.to(tl.float32, bitcast=True), calls)
    else:
        publish_partial(part_ptr, i, tl.sum(sq), calls)


@triton.jit
def finish_split_chunk(h, w, row, start, M, H, eps, out_ptr, offs, cmask, like, part_ptr, items, calls, tm, dead, fx,
                       qargs, C: tl.constexpr, Q: tl.constexpr):
    """A chunk of a split row, once this program has published all its partials: wait for the
    row's partials (`publish_row_partials`; a stall is recorded and poisons the row with NaN),
    then store the chunk's normed values or quantize them (`store_normed`). Returns `dead`."""
    hw_amax = 0
    if Q.kind == KIND_FP8_TOKEN_C:  # published with the sums: one wait takes both
        ss, hw_amax, ok = row_sum_and_max(part_ptr + row * C.num_chunks, part_ptr + items + row * C.num_chunks,
                                          calls, tm[2], tm[3], dead, C)
    else:
        ss, ok = row_partials(part_ptr + row * C.num_chunks, calls, tm[2], tm[3], dead, C, 0)
    if (ok == 0) & (dead == 0):
        stall(fx[0], fx[1], fx[2], fx[4], fx[3], row, calls, C)
    dead = dead | (ok == 0)
    inv = tl.where(dead, float("nan"), inverse_rms_of(ss, H, eps))
    amax = 0
    if Q.kind == KIND_FP8_TOKEN_C:
        amax = token_amax(hw_amax, inv)  # NaN where the row failed: its scale is NaN
    store_normed((h * w) * inv, row, start, M, H, out_ptr, offs, cmask, like, qargs, amax, C, Q,
                 Q.kind == KIND_FP8_TOKEN_C)
    return dead


@triton.jit
def start_quantized(qargs, Q: tl.constexpr):
    """At a peer kernel's start: load the static / global scale. Returns qargs with that scale in
    place of its pointer, so no load of it sits at the end of a row's dependency chain."""
    return qargs[0], qargs[1], qargs[2], qargs[3], qargs[4], load_param(qargs[5], Q.kind), qargs[6]


@triton.jit
def zero_padding_scales(qargs, pid, nprog, M, H, Q: tl.constexpr):
    """Zero the 128x4-swizzled NVFP4 scales of the padding rows (M .. align128(M); they depend on
    no data), spread over the programs. A kernel calls it once its pushes are out, before it waits
    for any peer: the stores then take none of the time its peers wait for its data."""
    if Q.swizzled:
        num_pad = tl.where(M % 128 == 0, 0, ((H // 16 + 3) // 4 * 128 + PAD_WORDS - 1) // PAD_WORDS)
        c = pid
        while c < num_pad:
            zero_scale_padding(qargs[2], M, H, c, PAD_WORDS)
            c += nprog


@triton.jit
def norm_partials_pass(newres_ptr, w_ptr, out_ptr, part_ptr, pid, nprog, items, M, H, eps, calls, tm, dead, fx,
                       qargs, C: tl.constexpr, Q: tl.constexpr):
    """Phase 3 of split rows: for each of this program's items, `finish_split_chunk` (wait for its
    row's partials, then normed or quantized). The next item's loads are issued before this item
    is finished, so their latency overlaps. Returns `dead`."""
    cols = tl.arange(0, C.chunk)
    i = pid
    row = i // C.num_chunks
    col = (i % C.num_chunks) * C.chunk + cols
    cmask = and_scalar(col < H, i < items)
    w_next = tl.load(w_ptr + col, mask=cmask, other=0.0)
    nr_next = tl.load(newres_ptr + row.to(tl.int64) * H + col, mask=cmask, other=0.0)
    while i < items:
        row = i // C.num_chunks
        start = (i % C.num_chunks) * C.chunk
        col = start + cols
        cmask = col < H
        offs = row.to(tl.int64) * H + col
        w, nr = w_next.to(tl.float32), nr_next
        j = i + nprog
        col_j = (j % C.num_chunks) * C.chunk + cols
        cmask_j = and_scalar(col_j < H, j < items)
        w_next = tl.load(w_ptr + col_j, mask=cmask_j, other=0.0)
        nr_next = tl.load(newres_ptr + (j // C.num_chunks).to(tl.int64) * H + col_j, mask=cmask_j, other=0.0)
        dead = finish_split_chunk(nr.to(tl.float32), w, row, start, M, H, eps, out_ptr, offs, cmask, nr, part_ptr,
                                  items, calls, tm, dead, fx, qargs, C, Q)
        i = j
    return dead


@triton.jit
def residual_step(s, row, col, cmask, offs, r, w, newres_ptr, out_ptr, part_ptr, i, M, H, eps, calls, qargs,
                  C: tl.constexpr, Q: tl.constexpr):
    """After the reduced chunk `s` (data dtype, [1, chunk]): new_residual, and normed (quantized)
    or its partial."""
    if C.has_norm:
        if C.has_res:
            nr = round_like(s.to(tl.float32) + r.to(tl.float32), s, C.soft_bf16)
        else:
            nr = s
        tl.store(newres_ptr + offs, nr, mask=cmask)
        h = nr.to(tl.float32)
        if C.split:
            publish_row_partials(part_ptr, M * C.num_chunks, i, h, w, cmask, calls, C, Q)
        else:  # the chunk is the whole row
            ss = tl.sum(tl.where(cmask, h * h, 0.0))
            store_normed(normed_fp32(h, w, ss, H, eps), row, 0, M, H, out_ptr, offs, cmask, s, qargs, 0, C, Q, False)
    else:
        tl.store(out_ptr + offs, s, mask=cmask)


@triton.jit
def advance_epoch(state_ptr, pid, nprog, calls):
    """Write calls + 1 into this program's epoch words (p, p + G, ...; `tpfuse.kernels.protocol`)."""
    k = tl.arange(0, MAX_GRID_C)
    words = pid + k * nprog
    tl.store(state_ptr + words, tl.zeros_like(k) + ((calls + 1) & 0x7FFFFFFF), mask=words < MAX_GRID_C)


@triton.jit
def kernel_tail(newres_ptr, w_ptr, out_ptr, part_ptr, state_ptr, pid, nprog, items, M, H, eps, calls, tm, dead, fx,
                qargs, C: tl.constexpr, Q: tl.constexpr, SPLIT_PASS: tl.constexpr):
    """The end both peer kernels share: with SPLIT_PASS, the split-row norm pass once every
    partial of this program is published; then this program's epoch words, then the
    end-of-kernel launch trigger (C.pdl == 1)."""
    if SPLIT_PASS:
        norm_partials_pass(newres_ptr, w_ptr, out_ptr, part_ptr, pid, nprog, items, M, H, eps, calls, tm, dead, fx,
                           qargs, C, Q)
    advance_epoch(state_ptr, pid, nprog, calls)
    pdl_trigger_at_end(C)


@triton.jit
def item_at(i, H, cols, C: tl.constexpr):
    """(row, columns, column mask, element offsets) of item i."""
    row = i // C.num_chunks
    col = (i % C.num_chunks) * C.chunk + cols
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


@triton.jit
def sum_sources(got, x, rank, W: tl.constexpr):
    """`sum_in_rank_order` over a tuple of per-source tensors (`sync.poll_sources`): the same adds in
    the same order (there each peer's row is first summed with zeros, which changes no bits)."""
    acc = tl.zeros(x.shape, dtype=tl.float32)
    for src in tl.static_range(W):
        acc += tl.where(rank == src, x.to(tl.float32), got[src].to(tl.float32))
    return acc


@triton.jit
def reduce_sources(x, slot_ptr, offs, region, tags, tag_words, calls, cmask, row, deadline, dead, fx,
                   C: tl.constexpr):
    """One item from every other source at once (GPU builds, C.spin >= 4): `sync.poll_sources`
    until all arrived (or the abort word, the deadline, or `dead`), the failure recorded (`fx`),
    exactly what was read re-armed, and the fp32 sum in rank order with this rank's own chunk `x`
    ([1, chunk], as loaded). Source s's copy of the item lies at `slot_ptr` + s * `region` +
    `offs`, its tag at `tags` + s * `tag_words`. Returns (sum, dead); where the wait failed the
    sum holds whatever was read and `dead` is set."""
    err_ptr, errmap_ptr, abort_ptr, rank, bufs = fx
    got = poll_sources(x, slot_ptr + offs, region, tags, tag_words, rank, calls, and_scalar(cmask, dead == 0),
                       deadline, abort_ptr, C)
    arrived = tl.max(got[C.world]) == 0
    if (arrived == 0) & (dead == 0):
        pend, foreign = sources_failed(got[C.world])
        fail(err_ptr, errmap_ptr, abort_ptr, bufs, rank, pend, foreign, row, calls, C)
    dead = dead | (arrived == 0)
    fill = sentinel_like(x, C.sentinel, C.elem_bits)
    for p in tl.static_range(C.world):
        tl.store(slot_ptr + p * region + offs, fill, mask=and_scalar(cmask, p != rank))
    return sum_sources(got, x, rank, C.world), dead


@triton.jit
def reduce_block(x, ptrs, tag_ptrs, mask, peer_rows, srcs, calls, row, deadline, max_spins, dead, fx,
                 C: tl.constexpr):
    """One item from every other source as a [sources, chunk] block (`sync.poll_block`: the
    interpreter and spin levels below 4): the block at `ptrs` (under `mask`; `peer_rows` the
    sources polled) and its tags at `tag_ptrs` loaded, polled until all arrived (or the abort
    word, the deadline, or `dead`), the failure recorded (`fx`), exactly what was read re-armed,
    and the fp32 sum in rank order with this rank's own chunk `x`. Returns (sum, dead), as
    `reduce_sources` does."""
    err_ptr, errmap_ptr, abort_ptr, rank, bufs = fx
    v = tl.load(ptrs, mask=and_scalar(mask, dead == 0), other=0.0, volatile=True)
    t = tl.load(tag_ptrs, mask=and_scalar(peer_rows, dead == 0), other=0, volatile=True)
    v, status = poll_block(v, t, ptrs, mask, tag_ptrs, calls, deadline, max_spins, dead, abort_ptr, C)
    arrived = tl.max(tl.max(status, axis=0), axis=0) == 0
    if (arrived == 0) & (dead == 0):
        pend, foreign = source_status(status, srcs)
        fail(err_ptr, errmap_ptr, abort_ptr, bufs, rank, pend, foreign, row, calls, C)
    dead = dead | (arrived == 0)
    tl.store(ptrs, sentinel_like(v, C.sentinel, C.elem_bits), mask=mask)  # (a failed workspace is never read again)
    return sum_in_rank_order(v, x, srcs, rank, C.world), dead
