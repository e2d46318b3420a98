"""One-shot allreduce fused with residual-add + RMSNorm, over peer buffers (Lamport protocol).

Rows are cut into items (row, chunk) by `tpfuse.kernels.protocol.make_plan`; program p handles
items p, p + G, ... in every phase:
  1. push: load the chunk, canonicalise -0.0, store it into region `rank` of the current slot of
     every *other* rank's buffer (strong 16-byte stores), then the item's tag (this call's count);
     with 128x4-swizzled NVFP4 output, the padding rows' scales are zeroed next, while peers push;
  2. reduce: issue the loads of all W - 1 sources and their tags at once, poll until none holds
     the sentinel and every tag is this call's (`sync.poll_block`), re-arm exactly what was read,
     sum in fp32 in rank order 0..W-1 with this rank's own chunk taken from its input (so every
     rank adds the same values in the same order: identical bits), round to the dtype, add the
     residual, store new_residual;
  3. norm: a row of one chunk is finished at once; a row of several chunks publishes its sum of
     squares as an epoch-tagged partial, and (after all of this program's items are published, so
     no program waits on one that waits on it) every program reads its rows' partials in chunk
     order and writes normed;
  4. `kernel_tail`: this program's epoch words, the end-of-kernel launch trigger.
At decode sizes (C.single: every program holds at most one item) phases 1-3 run in one pass with
nothing loaded twice; there, with C.spin == 3, the poll waits on every source's tag at once before
it loads the data (`sync.wait_tags`), and with C.spin >= 4 each thread polls its vector of every
source at once (`sync.poll_sources`). With programmatic dependent launch (C.pdl) every access, inputs included,
follows `pdl_wait`. A rank that failed earlier, or whose abort word is set, pushes nothing and
writes NaN. Layout, slots, epochs, tags and error words: `tpfuse.kernels.protocol`.

The finishing stages (norm, quantized stores, split-row partials) are shared with two-shot
(`tpfuse.kernels.peer_stages`), and so is the host side (`tpfuse.kernels.peer_launch`).
CUDA-graph capturable: the state lives in device memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse.kernels.epilogue import round_like
from tpfuse.kernels.peer_stages import (
    KIND_FP8_TOKEN_C,
    finish_split_chunk,
    item_at,
    kernel_tail,
    publish_row_partials,
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
    canonicalize,
    entry_state,
    fail,
    int32_ptr,
    partials_deadline,
    pdl_wait,
    poll_block,
    push,
    push_word,
    sentinel_like,
    source_status,
    start_deadline,
    wait_tags,
)

_SLOTS = tl.constexpr(NUM_SLOTS)


@triton.jit
def tags_at(buf_ptr, header, region, tag_words, slot, src, C: tl.constexpr):
    """Pointer to the tag words of region `src` of `slot` in a one-shot buffer (W regions a slot)."""
    start = (header + _SLOTS * C.world * region) * (C.elem_bits // 8) // 4
    return int32_ptr(buf_ptr) + start + (slot * C.world + src) * tag_words


@triton.jit(do_not_specialize=["rank", "M", "timeout_ns", "max_spins"])
def oneshot_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, newres_ptr, bufs, local_ptr, part_ptr, state_ptr, err_ptr, errmap_ptr, qargs,
    rank, M, H, region, header, tag_words, eps, timeout_ns, max_spins, C: tl.constexpr, Q: tl.constexpr,
):
    pdl_wait(C)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # [1, chunk] tensors share the [sources, chunk] block's layout: no layout conversions
    cols = tl.arange(0, C.chunk)[None, :]
    srcs = tl.arange(0, C.world_p2)
    items = M * C.num_chunks
    calls = tl.load(state_ptr + pid)
    abort_ptr = int32_ptr(local_ptr)
    fx = (err_ptr, errmap_ptr, abort_ptr, rank, bufs)
    slot = calls % _SLOTS
    slot_base = header + slot.to(tl.int64) * C.world * region
    my_tags = tags_at(local_ptr, header, region, tag_words, slot, 0, C)  # + src * tag_words + item
    WP: tl.constexpr = C.world_p2  # shapes take constexprs, not a bundle's plain fields
    CHUNK: tl.constexpr = C.chunk
    fill = sentinel_like(tl.zeros([WP, CHUNK], dtype=local_ptr.dtype.element_ty), C.sentinel, C.elem_bits)
    peer_rows = (srcs[:, None] != rank) & (srcs[:, None] < C.world)

    if C.single:
        # every phase in one pass, nothing loaded twice; the inputs are loaded first, so their
        # latency overlaps the reads of the error and abort words that the push has to wait for
        row, col, cmask, offs = item_at(pid, H, cols, C)
        first = and_scalar(cmask, pid < items)
        x = canonicalize(tl.load(x_ptr + offs, mask=first, other=0.0), C.sentinel, C.elem_bits)
        r = tl.load(res_ptr + offs, mask=first & C.has_res, other=0.0)
        w = tl.load(w_ptr + col, mask=first & C.has_norm, other=0.0).to(tl.float32)
        qargs = start_quantized(qargs, Q)
        dead = entry_state(err_ptr, errmap_ptr, abort_ptr, rank, calls, C)
        deadline = start_deadline(timeout_ns, C.use_asm)
        pdeadline, pspins = partials_deadline(deadline, timeout_ns, max_spins, C.use_asm)
        tm = (deadline, max_spins, pdeadline, pspins)
        if pid < items:
            dst = slot_base + rank * region + offs
            for p in tl.static_range(C.world):
                push(bufs[p] + dst, x, and_scalar(cmask, (p != rank) & (dead == 0)), C)
            for p in tl.static_range(C.world):
                if (p != rank) & (dead == 0):
                    push_word(tags_at(bufs[p], header, region, tag_words, slot, rank, C) + pid, calls, C)
        zero_padding_scales(qargs, pid, nprog, M, H, Q)  # pushes out, nothing waited for yet
        if pid < items:
            if C.use_asm and (C.spin >= 4) and (C.world > 1):
                # every source's vector, every tag and the abort word reloaded together, per thread
                acc, dead = reduce_sources(x, local_ptr + slot_base, offs, region, my_tags + pid, tag_words, calls,
                                           cmask, row, deadline, dead, fx, C)
                acc = tl.where(dead, float("nan"), acc)
            else:
                ptrs = local_ptr + slot_base + srcs[:, None] * region + offs
                m2 = peer_rows & cmask
                tag_ptrs = my_tags + srcs[:, None] * tag_words + pid
                if C.use_asm and (C.spin >= 3) and (C.world > 1):
                    # every source's tag first, all at once, then the data in one parallel load
                    wait_tags(my_tags + pid, tag_words, rank, calls, deadline, dead, abort_ptr, C)
                acc, dead = reduce_block(x, ptrs, tag_ptrs, m2, peer_rows, srcs, calls, row, deadline, max_spins,
                                         dead, fx, C)
                acc = tl.where(dead, float("nan"), acc)
            s = round_like(acc, x, C.soft_bf16)
            if C.split:  # every program has published before any waits: no program waits on a waiter
                nr = s
                if C.has_res:
                    nr = round_like(s.to(tl.float32) + r.to(tl.float32), s, C.soft_bf16)
                tl.store(newres_ptr + offs, nr, mask=cmask)
                h = nr.to(tl.float32)
                publish_row_partials(part_ptr, items, pid, h, w, cmask, calls, C, Q)
                dead = finish_split_chunk(h, w, row, (pid % C.num_chunks) * C.chunk, M, H, eps, out_ptr, offs, cmask,
                                          s, part_ptr, items, calls, tm, dead, fx, qargs, C, Q)
            else:
                residual_step(s, row, col, cmask, offs, r, w, newres_ptr, out_ptr, part_ptr, pid, M, H, eps, calls,
                              qargs, C, Q)
        # the split-row passes have nothing left to do here: single items finished their rows
        kernel_tail(newres_ptr, w_ptr, out_ptr, part_ptr, state_ptr, pid, nprog, items, M, H, eps, calls, tm, dead,
                    fx, qargs, C, Q, False)
    else:
        qargs = start_quantized(qargs, Q)
        dead = entry_state(err_ptr, errmap_ptr, abort_ptr, rank, calls, C)
        deadline = start_deadline(timeout_ns, C.use_asm)
        pdeadline, pspins = partials_deadline(deadline, timeout_ns, max_spins, C.use_asm)
        tm = (deadline, max_spins, pdeadline, pspins)
        # 1. push this rank's chunks into every other rank's current slot, region `rank`
        # (the next item's input is loaded before this one is stored: the loads overlap the stores)
        if dead == 0:
            i = pid
            _, _, cmask, offs = item_at(i, H, cols, C)
            x_next = tl.load(x_ptr + offs, mask=cmask, other=0.0)
            while i < items:
                _, _, cmask, offs = item_at(i, H, cols, C)
                x = canonicalize(x_next, C.sentinel, C.elem_bits)
                j = i + nprog
                _, _, cmask_j, offs_j = item_at(j, H, cols, C)
                x_next = tl.load(x_ptr + offs_j, mask=and_scalar(cmask_j, j < items), other=0.0)
                dst = slot_base + rank * region + offs
                for p in tl.static_range(C.world):
                    push(bufs[p] + dst, x, and_scalar(cmask, p != rank), C)
                for p in tl.static_range(C.world):
                    if p != rank:
                        push_word(tags_at(bufs[p], header, region, tag_words, slot, rank, C) + i, calls, C)
                i = j
        zero_padding_scales(qargs, pid, nprog, M, H, Q)  # pushes out, nothing waited for yet

        # 2. reduce in rank order; new_residual; normed or its partial. The next item's sources
        # and tags are loaded before this item is finished, so their latency overlaps its work.
        i = pid
        row, col, cmask, offs = item_at(i, H, cols, C)
        m2 = peer_rows & cmask
        v_next = tl.load(local_ptr + slot_base + srcs[:, None] * region + offs, mask=and_scalar(m2, dead == 0),
                         other=0.0, volatile=True)
        t_next = tl.load(my_tags + srcs[:, None] * tag_words + i, mask=and_scalar(peer_rows, dead == 0), other=0,
                         volatile=True)
        while i < items:
            row, col, cmask, offs = item_at(i, H, cols, C)
            x = canonicalize(tl.load(x_ptr + offs, mask=cmask, other=0.0), C.sentinel, C.elem_bits)
            r = tl.load(res_ptr + offs, mask=cmask & C.has_res, other=0.0)
            # a split row's chunk needs the weight now only for per-token FP8's max |h * w|
            w = tl.load(w_ptr + col, mask=cmask & C.has_norm & ((C.num_chunks == 1) | (Q.kind == KIND_FP8_TOKEN_C)),
                        other=0.0).to(tl.float32)
            ptrs = local_ptr + slot_base + srcs[:, None] * region + offs
            tag_ptrs = my_tags + srcs[:, None] * tag_words + i
            m2 = peer_rows & cmask
            v, status = poll_block(v_next, t_next, ptrs, m2, tag_ptrs, calls, deadline, max_spins, dead, abort_ptr,
                                   C)
            arrived = tl.max(tl.max(status, axis=0), axis=0) == 0
            if (arrived == 0) & (dead == 0):
                pend, foreign = source_status(status, srcs)
                fail(err_ptr, errmap_ptr, abort_ptr, bufs, rank, pend, foreign, row, calls, C)
            dead = dead | (arrived == 0)
            j = i + nprog
            _, _, cmask_j, offs_j = item_at(j, H, cols, C)
            live_j = (dead == 0) & (j < items)
            v_next = tl.load(local_ptr + slot_base + srcs[:, None] * region + offs_j,
                             mask=and_scalar(peer_rows & cmask_j, live_j), other=0.0, volatile=True)
            t_next = tl.load(my_tags + srcs[:, None] * tag_words + j, mask=and_scalar(peer_rows, live_j), other=0,
                             volatile=True)
            tl.store(ptrs, fill, mask=m2)  # re-arm exactly what was read (a failed workspace is never read again)
            acc = tl.where(dead, float("nan"), sum_in_rank_order(v, x, srcs, rank, C.world))
            s = round_like(acc, x, C.soft_bf16)
            residual_step(s, row, col, cmask, offs, r, w, newres_ptr, out_ptr, part_ptr, i, M, H, eps, calls, qargs,
                          C, Q)
            i = j
        # 3. split rows: every partial of this program is published; now finish the norm
        kernel_tail(newres_ptr, w_ptr, out_ptr, part_ptr, state_ptr, pid, nprog, items, M, H, eps, calls, tm, dead,
                    fx, qargs, C, Q, C.split)
