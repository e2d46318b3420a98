"""Two-shot allreduce fused with residual-add + RMSNorm, over peer buffers (Lamport protocol).

Each input byte crosses the fabric about twice instead of W - 1 times: scatter to owners, owners
reduce and push the sums to every rank. Two ways of cutting the work (`C.rows_owned`, decided by
`tpfuse.kernels.protocol.twoshot_owns_rows`, identically on every rank):

Chunk owners (up to a few rows a rank): the call's items (row, chunk;
`tpfuse.kernels.protocol.twoshot_plan`) are dealt to owners in contiguous runs: owner o reduces
items [o*K, (o+1)*K), K = ceil(items / W), so even one token is spread over W ranks and many
programs. Program p handles items p, p + G, ... in every phase:
  1. scatter: push each chunk (and its tag) into region `rank` of its owner's scatter area (own
     chunks stay in the input): each byte crosses the fabric once;
  2. reduce: for owned items, issue the loads of all W - 1 sources at once, poll (with C.spin >= 4
     each thread reloads its vector of every source still missing, with the tags and the abort
     word, in one round trip: `sync.poll_sources`), re-arm what was read, sum in fp32 in rank
     order with this rank's own chunk from its input, round to the dtype, canonicalise -0.0 (a
     rounded sum can be -0.0, which is the sentinel) and push the sum and its tag into every
     rank's gather area (this rank's own included);
  3. gather + epilogue: for every item, poll its owner's sum (one source), re-arm it, add the
     residual, store new_residual, then normed directly or through the norm partials (as in
     one-shot); 4. `kernel_tail`.
Own sums are produced by the same program that later reads them (item i goes to program i % G
in both phases), so a wait never names this rank itself.

Row owners (from as many rows a rank as its plan has programs): owner o holds rows [o*R, (o+1)*R),
R = ceil(M / W), scattered as above but C.per_push items a step (items i, i + G, ...: their loads
issued together, then their pushes, each item's tag after its data). Each row is reduced by one
program chunk after chunk (the next chunk's sources loaded before the current one is finished),
so the owner knows the row's sum of squares itself. It pushes each chunk's sum as above, then the
row's sum of squares as one epoch-tagged 64-bit row word (the row's tag). Receivers poll
C.per_poll items at once (a [per_poll, chunk] block, so several items' loads are in flight)
together with their rows' words, and finish each item on the spot: new residual, normed from the
owner's sum of squares (the bits a local sum would give: the owner rounds the same new residual),
no partials.

A rank that failed, or whose abort word is set, pushes nothing (no sums, no NaN) and writes NaN.
What is gathered is the reduced sum, not the normed rows: every rank needs new_residual anyway,
so gathering finished rows would move twice the bytes. Slot layout: W scatter regions, then one
gather region (`num_regions = W + 1`); tags as in `tpfuse.kernels.protocol`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse.kernels.epilogue import round_like
from tpfuse.kernels.peer_stages import (
    KIND_FP8_TOKEN_C,
    kernel_tail,
    normed_fp32,
    reduce_block,
    reduce_sources,
    residual_step,
    start_quantized,
    sum_in_rank_order,
    zero_padding_scales,
)
from tpfuse.kernels.protocol import NUM_SLOTS
from tpfuse.kernels.sync import (
    and_scalar,
    as_bits,
    canonicalize,
    deadline_passed,
    entry_state,
    fail,
    int32_ptr,
    int64_ptr,
    partials_deadline,
    pdl_wait,
    poll_block,
    push,
    push_word,
    push_word64,
    sentinel_like,
    source_status,
    spin_vectors,
    start_deadline,
    tagged,
)

_SLOTS = tl.constexpr(NUM_SLOTS)


@triton.jit
def first_of(start, pid, nprog):
    """The first index >= start that is congruent to pid modulo nprog (the items of program pid)."""
    return start + ((pid - start) % nprog + nprog) % nprog


@triton.jit
def tag_words_of(buf_ptr, header, region, tag_words, slot, reg, C: tl.constexpr):
    """Pointer to the tag words of region `reg` of `slot` (W + 1 regions a slot)."""
    start = (header + _SLOTS * (C.world + 1) * region) * (C.elem_bits // 8) // 4
    return int32_ptr(buf_ptr) + start + (slot * (C.world + 1) + reg) * tag_words


@triton.jit
def row_words_of(buf_ptr, header, region, tag_words, slot, C: tl.constexpr):
    """Pointer to the row words of `slot` (after every slot's tags)."""
    tags = (header + _SLOTS * (C.world + 1) * region) * (C.elem_bits // 8) // 4
    start = (tags + _SLOTS * (C.world + 1) * tag_words) // 2
    return int64_ptr(buf_ptr) + start + slot * tag_words


@triton.jit(do_not_specialize=["rank", "M", "timeout_ns", "max_spins"])
def twoshot_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, newres_ptr, bufs, local_ptr, part_ptr, state_ptr, err_ptr, errmap_ptr, qargs,
    rank, M, H, region, header, tag_words, eps, timeout_ns, max_spins, C: tl.constexpr, Q: tl.constexpr,
):
    pdl_wait(C)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    calls = tl.load(state_ptr + pid)
    qargs = start_quantized(qargs, Q)
    abort_ptr = int32_ptr(local_ptr)
    fx = (err_ptr, errmap_ptr, abort_ptr, rank, bufs)
    dead = entry_state(err_ptr, errmap_ptr, abort_ptr, rank, calls, C)
    deadline = start_deadline(timeout_ns, C.use_asm)
    pdeadline, pspins = partials_deadline(deadline, timeout_ns, max_spins, C.use_asm)
    tm = (deadline, max_spins, pdeadline, pspins)
    cols = tl.arange(0, C.chunk)[None, :]  # [1, chunk]: the layout of the [sources, chunk] blocks
    srcs = tl.arange(0, C.world_p2)
    items = M * C.num_chunks
    slot = calls % _SLOTS
    slot_base = header + slot.to(tl.int64) * (C.world + 1) * region
    gather_base = slot_base + C.world * region
    my_tags = tag_words_of(local_ptr, header, region, tag_words, slot, 0, C)  # + region * tag_words + index
    peer_rows = (srcs[:, None] != rank) & (srcs[:, None] < C.world)
    WP: tl.constexpr = C.world_p2  # shapes take constexprs, not a bundle's plain fields
    CHUNK: tl.constexpr = C.chunk
    fill = sentinel_like(tl.zeros([WP, CHUNK], dtype=local_ptr.dtype.element_ty), C.sentinel, C.elem_bits)

    if C.rows_owned:
        per_owner = tl.cdiv(M, C.world)  # rows
        pushed = tl.arange(0, C.per_push)[:, None]  # the items of one scatter step, nprog apart
        # 1. scatter this rank's rows to their owners, C.per_push items at once
        if dead == 0:
            i = pid
            while i < items:
                ii = i + pushed * nprog  # [per_push, 1]
                row = ii // C.num_chunks
                owner = row // per_owner
                col = (ii % C.num_chunks) * C.chunk + cols
                cmask = (col < H) & (ii < items)
                x = canonicalize(tl.load(x_ptr + row.to(tl.int64) * H + col, mask=cmask, other=0.0), C.sentinel,
                                 C.elem_bits)
                dst = slot_base + rank * region + (row - owner * per_owner).to(tl.int64) * H + col
                for o in tl.static_range(C.world):
                    push(bufs[o] + dst, x, and_scalar(cmask & (owner == o), o != rank), C)
                for k in tl.static_range(C.per_push):  # each item's tag after its data, as with one item a step
                    ik = i + k * nprog
                    owner_k = (ik // C.num_chunks) // per_owner
                    for o in tl.static_range(C.world):
                        if (o == owner_k) & (o != rank) & (ik < items):
                            push_word(tag_words_of(bufs[o], header, region, tag_words, slot, rank, C) + ik
                                      - owner_k * per_owner * C.num_chunks, calls, C)
                i += nprog * C.per_push

        zero_padding_scales(qargs, pid, nprog, M, H, Q)  # pushes out, nothing waited for yet

        # 2. reduce each owned row in one program; push its chunks' sums, then its sum of squares
        own_end = tl.minimum((rank + 1) * per_owner, M)
        row = first_of(rank * per_owner, pid, nprog)
        m_row = and_scalar(peer_rows & (cols < H), row < own_end)
        local = (row - rank * per_owner).to(tl.int64) * H
        v_next = tl.load(local_ptr + slot_base + srcs[:, None] * region + local + cols,
                         mask=and_scalar(m_row, dead == 0), other=0.0, volatile=True)
        t_next = tl.load(my_tags + srcs[:, None] * tag_words + (row - rank * per_owner) * C.num_chunks,
                         mask=and_scalar(peer_rows, (dead == 0) & (row < own_end)), other=0, volatile=True)
        while row < own_end:
            local = (row - rank * per_owner).to(tl.int64) * H
            ss = 0.0
            for c in tl.static_range(C.num_chunks):
                col = c * C.chunk + cols
                cmask = col < H
                offs = row.to(tl.int64) * H + col
                index = (row - rank * per_owner) * C.num_chunks + c
                x = canonicalize(tl.load(x_ptr + offs, mask=cmask, other=0.0), C.sentinel, C.elem_bits)
                r = tl.load(res_ptr + offs, mask=cmask & C.has_res, other=0.0)
                ptrs = local_ptr + slot_base + srcs[:, None] * region + local + col
                tag_ptrs = my_tags + srcs[:, None] * tag_words + index
                m2 = peer_rows & cmask
                v, status = poll_block(v_next, t_next, ptrs, m2, tag_ptrs, calls, deadline, max_spins, dead,
                                       abort_ptr, C)
                arrived = tl.max(tl.max(status, axis=0), axis=0) == 0
                if (arrived == 0) & (dead == 0):
                    pend, foreign = source_status(status, srcs)
                    fail(err_ptr, errmap_ptr, abort_ptr, bufs, rank, pend, foreign, row, calls, C)
                dead = dead | (arrived == 0)
                # the next chunk's sources (or the next owned row's first chunk), before this one is finished
                if c + 1 < C.num_chunks:
                    col_n = (c + 1) * C.chunk + cols
                    v_next = tl.load(local_ptr + slot_base + srcs[:, None] * region + local + col_n,
                                     mask=and_scalar(peer_rows & (col_n < H), dead == 0), other=0.0, volatile=True)
                    t_next = tl.load(my_tags + srcs[:, None] * tag_words + index + 1,
                                     mask=and_scalar(peer_rows, dead == 0), other=0, volatile=True)
                else:
                    nxt = row + nprog
                    local_n = (nxt - rank * per_owner).to(tl.int64) * H
                    live = (dead == 0) & (nxt < own_end)
                    v_next = tl.load(local_ptr + slot_base + srcs[:, None] * region + local_n + cols,
                                     mask=and_scalar(peer_rows & (cols < H), live), other=0.0, volatile=True)
                    t_next = tl.load(my_tags + srcs[:, None] * tag_words + (nxt - rank * per_owner) * C.num_chunks,
                                     mask=and_scalar(peer_rows, live), other=0, volatile=True)
                tl.store(ptrs, fill, mask=m2)  # re-arm exactly what was read
                s = canonicalize(round_like(sum_in_rank_order(v, x, srcs, rank, C.world), x, C.soft_bf16),
                                 C.sentinel, C.elem_bits)
                for o in tl.static_range(C.world):
                    push(bufs[o] + gather_base + offs, s, and_scalar(cmask, dead == 0), C)
                if C.has_norm:
                    nr = s
                    if C.has_res:
                        nr = round_like(s.to(tl.float32) + r.to(tl.float32), s, C.soft_bf16)
                    h = nr.to(tl.float32)
                    ss += tl.sum(tl.where(cmask, h * h, 0.0))
            word = tagged(tl.where(dead, float("nan"), ss), calls)
            for o in tl.static_range(C.world):
                if dead == 0:
                    push_word64(row_words_of(bufs[o], header, region, tag_words, slot, C) + row, word, C)
            row += nprog

        # 3. receive C.per_poll items at once: their sums and their rows' sums of squares
        ks = tl.arange(0, C.per_poll)[:, None]
        my_rows = row_words_of(local_ptr, header, region, tag_words, slot, C)
        i = pid
        while i < items:
            ii = i + ks * nprog  # [per_poll, 1]
            live = ii < items
            rows_k = ii // C.num_chunks
            col = (ii % C.num_chunks) * C.chunk + cols
            cmask = (col < H) & live
            offs = rows_k.to(tl.int64) * H + col
            r = tl.load(res_ptr + offs, mask=cmask & C.has_res, other=0.0)
            w = tl.load(w_ptr + col, mask=cmask & C.has_norm, other=0.0).to(tl.float32)
            ptrs = local_ptr + gather_base + offs
            v = tl.load(ptrs, mask=and_scalar(cmask, dead == 0), other=0.0, volatile=True)
            if C.use_asm and (C.spin >= 2):
                # the row word's high half is the row's tag: spin on it with the data, per thread
                tag_ptrs = int32_ptr(my_rows + rows_k) + 1
                t = tl.load(tag_ptrs, mask=and_scalar(live, dead == 0), other=0, volatile=True)
                v, status = spin_vectors(v, ptrs, t, tag_ptrs, calls, cmask & (dead == 0), deadline, abort_ptr, C)
                rw = tl.load(my_rows + rows_k, mask=live, other=0, volatile=True)  # now holds this call's sum
            else:
                rw = tl.load(my_rows + rows_k, mask=and_scalar(live, dead == 0), other=0, volatile=True)
                want = calls.to(tl.int64)
                pending = cmask & (as_bits(v, C.elem_bits) == C.sentinel)
                foreign = live & ((rw >> 32) != want)
                busy = tl.max(tl.max((pending | foreign).to(tl.int32), axis=1), axis=0) > 0
                failed = dead
                spins = 0
                while busy & (failed == 0):
                    v = tl.load(ptrs, mask=cmask, other=0.0, volatile=True)
                    rw = tl.load(my_rows + rows_k, mask=live, other=0, volatile=True)
                    aborted = tl.load(abort_ptr, volatile=True) != 0
                    pending = cmask & (as_bits(v, C.elem_bits) == C.sentinel)
                    foreign = live & ((rw >> 32) != want)
                    busy = tl.max(tl.max((pending | foreign).to(tl.int32), axis=1), axis=0) > 0
                    spins += 1
                    failed = deadline_passed(deadline, spins, max_spins, C.use_asm) | aborted
                status = tl.where(pending, 1, tl.where(foreign & cmask, 2, 0))
            busy = tl.max(tl.max(status, axis=1), axis=0) > 0
            if busy & (dead == 0):
                owners = tl.max(tl.where(tl.max(status, axis=1, keep_dims=True) > 0, 1 << (rows_k // per_owner), 0))
                only_foreign = tl.max((status == 1).to(tl.int32)) == 0
                fail(err_ptr, errmap_ptr, abort_ptr, bufs, rank, owners, tl.where(only_foreign, owners, 0),
                     tl.min(tl.where(live, rows_k, M)), calls, C)
            dead = dead | busy
            tl.store(ptrs, sentinel_like(v, C.sentinel, C.elem_bits), mask=cmask)  # re-arm what was read
            s = tl.where(dead, float("nan"), v.to(tl.float32)).to(local_ptr.dtype.element_ty)
            if C.has_norm:
                nr = s
                if C.has_res:
                    nr = round_like(s.to(tl.float32) + r.to(tl.float32), s, C.soft_bf16)
                tl.store(newres_ptr + offs, nr, mask=cmask)
                ss = (rw & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
                ss = tl.where(dead, float("nan"), ss)
                y = normed_fp32(nr.to(tl.float32), w, ss, H, eps)
                tl.store(out_ptr + offs, round_like(y, s, C.soft_bf16), mask=cmask)
            else:
                tl.store(out_ptr + offs, s, mask=cmask)
            i += nprog * C.per_poll
        kernel_tail(newres_ptr, w_ptr, out_ptr, part_ptr, state_ptr, pid, nprog, items, M, H, eps, calls, tm, dead,
                    fx, qargs, C, Q, False)
    else:
        per_owner = tl.cdiv(items, C.world)
        # 1. scatter this rank's chunks to their owners
        if dead == 0:
            i = pid
            while i < items:
                owner = i // per_owner
                col = (i % C.num_chunks) * C.chunk + cols
                cmask = col < H
                x = canonicalize(tl.load(x_ptr + (i // C.num_chunks).to(tl.int64) * H + col, mask=cmask, other=0.0),
                                 C.sentinel, C.elem_bits)
                dst = slot_base + rank * region + (i - owner * per_owner).to(tl.int64) * C.chunk + cols
                for o in tl.static_range(C.world):
                    push(bufs[o] + dst, x, and_scalar(cmask, (o == owner) & (o != rank)), C)
                for o in tl.static_range(C.world):
                    if (o == owner) & (o != rank):
                        tags_o = tag_words_of(bufs[o], header, region, tag_words, slot, rank, C)
                        push_word(tags_o + i - owner * per_owner, calls, C)
                i += nprog

        zero_padding_scales(qargs, pid, nprog, M, H, Q)  # pushes out, nothing waited for yet

        # 2. reduce the owned chunks in rank order and publish the sums (and tags) to every rank
        own_end = tl.minimum((rank + 1) * per_owner, items)
        i = first_of(rank * per_owner, pid, nprog)
        while i < own_end:
            row = i // C.num_chunks
            col = (i % C.num_chunks) * C.chunk + cols
            cmask = col < H
            x = canonicalize(tl.load(x_ptr + row.to(tl.int64) * H + col, mask=cmask, other=0.0), C.sentinel,
                             C.elem_bits)
            index = i - rank * per_owner
            local = index.to(tl.int64) * C.chunk + cols
            if C.use_asm and (C.spin >= 4) and (C.world > 1):
                # every source's vector, every tag and the abort word reloaded together, per thread
                acc, dead = reduce_sources(x, local_ptr + slot_base, local, region, my_tags + index, tag_words, calls,
                                           cmask, row, deadline, dead, fx, C)
            else:
                ptrs = local_ptr + slot_base + srcs[:, None] * region + local
                tag_ptrs = my_tags + srcs[:, None] * tag_words + index
                acc, dead = reduce_block(x, ptrs, tag_ptrs, peer_rows & cmask, peer_rows, srcs, calls, row, deadline,
                                         max_spins, dead, fx, C)
            s = canonicalize(round_like(acc, x, C.soft_bf16), C.sentinel, C.elem_bits)
            dst = gather_base + row.to(tl.int64) * H + col
            for o in tl.static_range(C.world):
                push(bufs[o] + dst, s, and_scalar(cmask, dead == 0), C)
            for o in tl.static_range(C.world):
                if dead == 0:
                    push_word(tag_words_of(bufs[o], header, region, tag_words, slot, C.world, C) + i, calls, C)
            i += nprog

        # 3. wait for each item's sum from its owner, then residual + norm (or its partial); the next
        # item's sum and tag are loaded before this one is finished
        gather_tags = my_tags + C.world * tag_words
        z11 = tl.zeros([1, 1], dtype=tl.int32)  # the one source's tag, shaped like a [sources, 1] tag column
        i = pid
        m1 = and_scalar((i % C.num_chunks) * C.chunk + cols < H, i < items)
        v_next = tl.load(local_ptr + gather_base + (i // C.num_chunks).to(tl.int64) * H + (i % C.num_chunks) * C.chunk
                         + cols, mask=and_scalar(m1, dead == 0), other=0.0, volatile=True)
        t_next = tl.load(gather_tags + i + z11, mask=and_scalar(z11 == 0, (dead == 0) & (i < items)), other=0,
                         volatile=True)
        while i < items:
            row = i // C.num_chunks
            owner = i // per_owner
            col = (i % C.num_chunks) * C.chunk + cols
            cmask = col < H
            offs = row.to(tl.int64) * H + col
            r = tl.load(res_ptr + offs, mask=cmask & C.has_res, other=0.0)
            # a split row's chunk needs the weight now only for per-token FP8's max |h * w|
            w = tl.load(w_ptr + col, mask=cmask & C.has_norm & ((C.num_chunks == 1) | (Q.kind == KIND_FP8_TOKEN_C)),
                        other=0.0).to(tl.float32)
            ptrs = local_ptr + gather_base + offs  # a [1, chunk] block: one source
            v, status = poll_block(v_next, t_next, ptrs, cmask, gather_tags + i + z11, calls, deadline, max_spins,
                                   dead, abort_ptr, C)
            arrived = tl.max(tl.max(status, axis=0), axis=0) == 0
            if (arrived == 0) & (dead == 0):
                only_foreign = tl.max((status == 1).to(tl.int32)) == 0
                fail(err_ptr, errmap_ptr, abort_ptr, bufs, rank, 1 << owner, tl.where(only_foreign, 1 << owner, 0),
                     row, calls, C)
            dead = dead | (arrived == 0)
            j = i + nprog
            m1 = and_scalar((j % C.num_chunks) * C.chunk + cols < H, (j < items) & (dead == 0))
            v_next = tl.load(local_ptr + gather_base + (j // C.num_chunks).to(tl.int64) * H
                             + (j % C.num_chunks) * C.chunk + cols, mask=m1, other=0.0, volatile=True)
            t_next = tl.load(gather_tags + j + z11, mask=and_scalar(z11 == 0, (dead == 0) & (j < items)), other=0,
                             volatile=True)
            tl.store(ptrs, sentinel_like(v, C.sentinel, C.elem_bits), mask=cmask)  # re-arm what was read
            s = tl.where(dead, float("nan"), v.to(tl.float32)).to(local_ptr.dtype.element_ty)
            residual_step(s, row, col, cmask, offs, r, w, newres_ptr, out_ptr, part_ptr, i, M, H, eps, calls, qargs,
                          C, Q)
            i = j
        kernel_tail(newres_ptr, w_ptr, out_ptr, part_ptr, state_ptr, pid, nprog, items, M, H, eps, calls, tm, dead,
                    fx, qargs, C, Q, C.split)
