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
# Interpreter spin bound per second of timeout: one interpreted poll of a 32-element row took
# about 1 ms on the 2-core CI-class machine (tests/kernels/test_interpreter.py timeout test).
INTERPRETER_SPINS_PER_S = 1_000


@triton.jit
def finish_norm(h, w, ss, H, eps, out_ptr, offs, cmask, like, SOFT_BF16: tl.constexpr):
    """normed = round(h * (1 / sqrt(ss / H + eps)) * w), correctly rounded steps (see epilogue)."""
    ms = tl.math.div_rn(ss, H.to(tl.float32))
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))
    tl.store(out_ptr + offs, round_like(h * inv * w, like, SOFT_BF16), mask=cmask)


@triton.jit
def norm_partials_pass(
    newres_ptr, w_ptr, out_ptr, part_ptr, pid, nprog, items, H, eps, calls, deadline, max_spins, dead, err_ptr,
    CHUNK: tl.constexpr, NCHUNK: tl.constexpr, NCP: tl.constexpr, USE_ASM: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    """Phase 3 of split rows: wait for each row's partials, sum them in chunk order, write normed.

    The next item's loads are issued before this item is finished, so their latency overlaps.
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
        col = (i % NCHUNK) * CHUNK + cols
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
        finish_norm(nr.to(tl.float32), w, ss, H, eps, out_ptr, offs, cmask, nr, SOFT_BF16)
        i = j


@triton.jit
def residual_step(
    s, row, col, cmask, offs, r, w, newres_ptr, out_ptr, part_ptr, i, H, eps, calls,
    HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, SPLIT: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    """After the reduced chunk `s` (data dtype): new_residual, and normed or its partial."""
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
        else:
            finish_norm(h, w, ss, H, eps, out_ptr, offs, cmask, s, SOFT_BF16)
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
    x_ptr, res_ptr, w_ptr, out_ptr, newres_ptr, bufs, local_ptr, part_ptr, state_ptr, err_ptr,
    rank, M, H, region, header, eps, timeout_ns, max_spins,
    W: tl.constexpr, WP: tl.constexpr, CHUNK: tl.constexpr, NCHUNK: tl.constexpr, NCP: tl.constexpr,
    SENT: tl.constexpr, ELEM_BITS: tl.constexpr, HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr,
    SPLIT: tl.constexpr, USE_ASM: tl.constexpr, SOFT_BF16: tl.constexpr,
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
                ss = tl.where(dead | (ok == 0), float("nan"), tl.sum(p, axis=0))
                finish_norm(h, w, ss, H, eps, out_ptr, offs, cmask, s, SOFT_BF16)
            else:
                residual_step(s, row, col, cmask, offs, r, w, newres_ptr, out_ptr, part_ptr, pid, H, eps, calls,
                              HAS_RES, HAS_NORM, SPLIT, SOFT_BF16)
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
            residual_step(s, row, col, cmask, offs, r, w, newres_ptr, out_ptr, part_ptr, i, H, eps, calls,
                          HAS_RES, HAS_NORM, SPLIT, SOFT_BF16)
            i = j

        # 3. split rows: every partial of this program is published; now finish the norm
        if SPLIT:
            norm_partials_pass(newres_ptr, w_ptr, out_ptr, part_ptr, pid, nprog, items, H, eps, calls, deadline,
                               max_spins, dead, err_ptr, CHUNK, NCHUNK, NCP, USE_ASM, SOFT_BF16)

    # 4. the last program to arrive advances the epoch
    old = tl.atomic_add(state_ptr + _ARRIVE, 1)
    if old == nprog - 1:
        tl.store(state_ptr + _ARRIVE, 0)
        tl.store(state_ptr + _CALLS, (calls + 1) & 0x7FFFFFFF)


def spin_bounds(timeout_s: float) -> tuple[int, int]:
    """(timeout in ns for GPUs, spin count for the interpreter) of one wait."""
    return int(timeout_s * 1e9), max(1, int(timeout_s * INTERPRETER_SPINS_PER_S))


def check_fits(where: str, x, ws, plan, *, twoshot: bool) -> None:
    m, h = x.shape
    if h > MAX_HIDDEN:
        raise ValueError(f"{where}: hidden size {h} exceeds {MAX_HIDDEN}; use strategy='nccl_epilogue'")
    need = region_elems_for(m, h, len(ws.peers.views), plan, twoshot=twoshot)
    if need > ws.region_elems or (plan.split and plan.items > ws.partials.numel()):
        raise ValueError(f"{where}: {m}x{h} elements exceed the workspace region of {ws.region_elems}; "
                         "call prepare() with a larger max_tokens")


def launch_args(x, residual, weight, ws, out, has_norm):
    """Outputs and the pointer arguments both peer kernels share."""
    if out is not None:  # caller's buffers (tests poison them with NaN)
        out, new_res = out[0], (out[1] if has_norm else out[0])
    else:
        out = torch.empty_like(x)
        new_res = torch.empty_like(x) if has_norm else out
    ptrs = (x, residual if residual is not None else x, weight if weight is not None else x, out, new_res,
            tuple(ws.peers.views), ws.peers.local, ws.partials, ws.state, ws.err)
    return out, new_res, ptrs


def kernel_meta(x, residual, ws, plan, has_norm) -> dict:
    world = len(ws.peers.views)
    return dict(W=world, WP=triton.next_power_of_2(world), CHUNK=plan.chunk, NCHUNK=plan.num_chunks,
                NCP=triton.next_power_of_2(plan.num_chunks), SENT=ws.sentinel, ELEM_BITS=8 * x.element_size(),
                HAS_RES=residual is not None, HAS_NORM=has_norm, SPLIT=has_norm and plan.split, USE_ASM=not interpreting(),
                SOFT_BF16=interpreting(), num_warps=plan.num_warps)


def grid_for(plan, max_programs: int) -> tuple[int]:
    programs = max(1, min(plan.items, max_programs))
    if interpreting() and plan.split:
        programs = 1  # the interpreter runs programs one after another: one program owns every row
    return (programs,)


def oneshot_launch(x, residual, weight, eps, ws, *, timeout_s: float, max_programs: int, plan_programs: int,
                   has_norm: bool = True, warmup: bool = False, out: tuple | None = None, plan=None):
    """Run one call on the current stream; returns (out, new_residual) (new_residual is None without norm).

    x (M, H) contiguous and fitting the workspace; weight (H,) (ignored without norm).
    `plan_programs` sizes the work plan (identical on every rank); `max_programs` caps the grid.
    `warmup=True` compiles the kernel without launching it (call before any collective use).
    `out=(out, new_residual)` writes into given buffers (new_residual ignored without norm).
    """
    m, h = x.shape
    plan = plan or make_plan(m, h, x.element_size(), plan_programs)
    check_fits("oneshot", x, ws, plan, twoshot=False)
    out, new_res, ptrs = launch_args(x, residual, weight, ws, out, has_norm)
    timeout_ns, max_spins = spin_bounds(timeout_s)
    args = ptrs + (ws.rank, m, h, ws.region_elems, ws.header_elems, float(eps), timeout_ns, max_spins)
    meta = kernel_meta(x, residual, ws, plan, has_norm)
    grid = grid_for(plan, max_programs)
    if warmup:
        if not interpreting():
            oneshot_kernel.warmup(*args, grid=grid, **meta)
        return None
    oneshot_kernel[grid](*args, **meta)
    return out, (new_res if has_norm else None)
