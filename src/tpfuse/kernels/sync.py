"""Waiting and signalling primitives of the fused collectives, safe on PCIe by construction.

The protocol (see `tpfuse.strategies.workspace`) is Lamport's "data is the flag": a receive slot
holds a sentinel bit pattern until a peer's remote store overwrites it with data. So the
kernels need only posted remote stores and polling of *local* memory: no remote
read-modify-write (which PCIe P2P may not make atomic), no barrier, no flag word to order.

Sentinel: negative zero (0x8000 for 16-bit floats, 0x80000000 for fp32), the choice of
TensorRT-LLM and FlashInfer. Real data never holds it because every writer canonicalises -0.0 to
+0.0 first (`canonicalize`); that changes only the sign of exact zeros, which no sum, residual
add or RMSNorm output distinguishes (they compare equal).

Memory model (PTX). A poll is a strong load (`ld.volatile`, relaxed at system scope); on GPU
builds (C.use_asm) every remote store is strong too (`st.relaxed.sys`, `push`), so a push racing a
poll is not a data race. Each 16-bit or 32-bit element is tested and returned as tested, so
tearing between the 32-bit parts of a 16-byte access (which PTX allows, and PCIe too) is harmless.
The epoch travels with the data: a source stores, after each item's data, a tag word holding its
call count, and a reader takes an item only when the data holds no sentinel and the tag equals
its own count. Two ranks whose call counts differ therefore never mix calls: an odd difference
puts the data in the other slot (a timeout), an even one leaves a foreign tag (ERR_EPOCH).

Every spin is bounded. On a GPU (C.use_asm) the bound is wall time read from the `%globaltimer`
register (nanoseconds) against a deadline fixed at kernel entry; the Triton interpreter has no
inline assembly, so there the bound is a spin count. A wait also ends when the rank's abort word
is set (`tpfuse.kernels.protocol`): a rank that gives up (`fail`, `stall`) tells every rank with a
plain store, so no rank waits for a call that cannot complete and none pushes into it afterwards
(`entry_state`). With C.spin (GPU builds), each thread spins on its own 16-byte vectors in inline
assembly (`spin_vectors`), reading the timer and the abort word with every reload and with no
block-wide reduction per retry; otherwise one reduction per retry decides (`poll_block`). With
C.spin == 3 a one-item poll first waits on every source's tag at once (`wait_tags`) and only then
loads the data: the vector spin reloads one vector after another, a round trip for each source
that arrived after its vector was first loaded. With C.spin >= 4 it polls every source's vector
and tag in one per-thread loop instead (`poll_sources`), reloading only the sources still missing.

Failure words: the error record (`err`, device memory, local atomics) and its mirror (`errmap`,
host-mapped memory on GPUs: the host reads the code there without a copy kernel).

`C` in signatures is the kernel's `tpfuse.kernels.peer_stages.PeerConfig` (compile-time).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse.kernels.protocol import ERR_ABORTED, ERR_EPOCH, ERR_STALL, ERR_TIMEOUT

ERR_TIMEOUT_C, ERR_ABORTED_C = tl.constexpr(ERR_TIMEOUT), tl.constexpr(ERR_ABORTED)
ERR_STALL_C, ERR_EPOCH_C = tl.constexpr(ERR_STALL), tl.constexpr(ERR_EPOCH)

# Per-thread spin over one 16-byte vector (8 x 16-bit elements, or 4 x 32-bit): operands are the
# outputs (4 words of data, then the status of each element), then the inputs, each repeated once
# per element of the pack (only the first copy is read): data (4 words), its tag as loaded, the
# tag's address, the expected tag, the abort word's address, whether the vector is polled at all,
# the data's address, the deadline. Status: 0 arrived; 1 data still pending; 2 data present but its
# tag never matched (another call's data). Labels are local to the `{}` block, so the block can be
# inlined once per vector.
_SPIN_HEAD = """{
.reg .pred pa, pl, pt, pq;
.reg .b32 tg, ab, w;
.reg .b64 now;
mov.b32 $0, $R0; mov.b32 $1, $R1; mov.b32 $2, $R2; mov.b32 $3, $R3;
mov.b32 tg, $TAG;
mov.b32 w, 0;
setp.ne.b32 pa, $ACT, 0;
@!pa bra DONE;
LOOP:
setp.ne.b32 pt, tg, $WANT;
"""
_LANES16 = "".join(f"and.b32 w, ${i}, 0xFFFF; setp.eq.or.b32 pl, w, 0x8000, pl;\n"
                   f"shr.u32 w, ${i}, 16; setp.eq.or.b32 pl, w, 0x8000, pl;\n" for i in range(4))
_LANES32 = "".join(f"setp.eq.or.b32 pl, ${i}, 0x80000000, pl;\n" for i in range(4))
_SPIN_TAIL = """or.pred pq, pl, pt;
mov.b32 w, 0;
@!pq bra DONE;
ld.volatile.global.v4.b32 {$0, $1, $2, $3}, [$PTR];
ld.volatile.global.b32 tg, [$TAGP];
ld.volatile.global.b32 ab, [$ABORTP];
mov.u64 now, %globaltimer;
setp.ne.b32 pq, ab, 0;
setp.gt.or.s64 pq, now, $DEADLINE, pq;
@!pq bra LOOP;
selp.b32 w, 1, 2, pl;
DONE:
"""


def _spin_asm(pack: int) -> tuple[str, str]:
    """(assembly, constraints) of the spin for `pack` elements per 16-byte vector (8 or 4)."""
    out_status = 4 + pack
    ops = {"R0": out_status, "R1": out_status + 1, "R2": out_status + 2, "R3": out_status + 3}
    cursor = out_status + 4
    for name in ("TAG", "TAGP", "WANT", "ABORTP", "ACT", "PTR", "DEADLINE"):
        ops[name] = cursor
        cursor += pack
    body = _SPIN_HEAD.replace("setp.ne.b32 pt", "mov.pred pl, 0;\nsetp.ne.b32 pt")
    body += _LANES16 if pack == 8 else _LANES32
    body += _SPIN_TAIL
    body += "".join(f"mov.b32 ${4 + k}, w;\n" for k in range(pack)) + "}"
    for name, index in sorted(ops.items(), key=lambda kv: -len(kv[0])):
        body = body.replace(f"${name}", f"${index}")
    kinds = ["=r"] * (4 + pack) + ["r"] * 4
    for kind in ("r", "l", "r", "l", "r", "l", "l"):  # TAG TAGP WANT ABORTP ACT PTR DEADLINE
        kinds += [kind] * pack
    return body, ",".join(kinds)


SPIN16_ASM, SPIN16_CONSTRAINTS = (tl.constexpr(s) for s in _spin_asm(8))
SPIN32_ASM, SPIN32_CONSTRAINTS = (tl.constexpr(s) for s in _spin_asm(4))
# A strong (relaxed, system-scope) 16-byte store of the vector, if its first element is unmasked.
STORE16_ASM = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $16, 0; @p st.relaxed.sys.global.v4.b32 [$8], "
                           "{$4, $5, $6, $7}; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }")
STORE16_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 4 + ["l"] * 8 + ["r"] * 8))
STORE32_ASM = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $12, 0; @p st.relaxed.sys.global.v4.b32 [$8], "
                           "{$4, $5, $6, $7}; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }")
STORE32_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 4 + ["l"] * 4 + ["r"] * 4))
# A strong store of one scalar word by the program's first thread (scalars live in every thread).
ONE_THREAD_STORE32 = tl.constexpr("{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                                  "@p st.relaxed.sys.global.b32 [$1], $2; mov.b32 $0, 0; }")
ONE_THREAD_STORE64 = tl.constexpr("{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                                  "@p st.relaxed.sys.global.b64 [$1], $2; mov.b32 $0, 0; }")


@triton.jit
def globaltimer_ns():
    """Nanoseconds from the GPU's global timer (PTX `%globaltimer`); GPU builds only."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def pdl_wait(C: tl.constexpr):
    """With programmatic dependent launch, wait here for the previous kernel on the stream to
    complete and its memory to be visible; every protocol access (and every input read) comes
    after it. C.pdl == 2 then lets the next kernel launch at once (its programs wait here too)."""
    if C.pdl > 0:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        if C.pdl == 2:
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)


@triton.jit
def pdl_trigger_at_end(C: tl.constexpr):
    """C.pdl == 1: the next kernel may launch once every program got here (after its last store)."""
    if C.pdl == 1:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def as_bits(v, ELEM_BITS: tl.constexpr):
    """Reinterpret a 16- or 32-bit float tensor as integers of the same width."""
    if ELEM_BITS == 16:
        b = v.to(tl.int16, bitcast=True)
    else:
        b = v.to(tl.int32, bitcast=True)
    return b


@triton.jit
def canonicalize(v, SENT: tl.constexpr, ELEM_BITS: tl.constexpr):
    """-0.0 -> +0.0, so that data written to a peer can never look like the sentinel."""
    b = as_bits(v, ELEM_BITS)
    b = tl.where(b == SENT, tl.zeros_like(b), b)
    return b.to(v.dtype, bitcast=True)


@triton.jit
def sentinel_like(v, SENT: tl.constexpr, ELEM_BITS: tl.constexpr):
    """A tensor shaped and typed like `v` that holds the sentinel everywhere."""
    b = as_bits(v, ELEM_BITS)
    b = tl.full(b.shape, SENT, b.dtype)
    return b.to(v.dtype, bitcast=True)


@triton.jit
def deadline_passed(deadline_ns, spins, max_spins, USE_ASM: tl.constexpr):
    """True once the wait is over its bound: wall time on GPUs, a spin count in the interpreter."""
    if USE_ASM:
        over = globaltimer_ns() > deadline_ns
    else:
        over = spins >= max_spins
    return over


@triton.jit
def start_deadline(timeout_ns, USE_ASM: tl.constexpr):
    """The absolute deadline (ns) of every wait in this program; 0 in the interpreter (unused)."""
    if USE_ASM:
        d = globaltimer_ns() + timeout_ns
    else:
        d = timeout_ns * 0
    return d


@triton.jit
def int32_ptr(ptr):
    """`ptr` (any element type) reinterpreted as a pointer to int32 words."""
    return ptr.to(tl.pointer_type(tl.int32), bitcast=True)


@triton.jit
def int64_ptr(ptr):
    """`ptr` (any element type) reinterpreted as a pointer to int64 words."""
    return ptr.to(tl.pointer_type(tl.int64), bitcast=True)


@triton.jit
def and_scalar(mask, cond):
    """`mask & cond` for a scalar `cond`, broadcast first (Triton 3.9's interpreter rejects the
    mixed form as a mask; compiled, both forms are the same predicate)."""
    return mask & ((mask.to(tl.int32) * 0 + cond.to(tl.int32)) != 0)


@triton.jit
def push(ptrs, v, mask, C: tl.constexpr):
    """Store `v` (16 bytes a thread) to peer memory: strong system-scope stores on GPU builds
    (a push races the peer's poll), a plain store in the interpreter. Masks are per 16-byte vector
    (rows are multiples of 16 bytes, so a vector is all in or all out)."""
    if C.use_asm:
        if C.elem_bits == 16:
            tl.inline_asm_elementwise(STORE16_ASM, STORE16_CONSTRAINTS, [v, ptrs.to(tl.int64), mask.to(tl.int32)],
                                      dtype=v.dtype, is_pure=False, pack=8)
        else:
            tl.inline_asm_elementwise(STORE32_ASM, STORE32_CONSTRAINTS, [v, ptrs.to(tl.int64), mask.to(tl.int32)],
                                      dtype=v.dtype, is_pure=False, pack=4)
    else:
        tl.store(ptrs, v, mask=mask)


@triton.jit
def push_word(ptr, value, C: tl.constexpr):
    """Store one int32 word (scalar) to peer memory (tags, abort words): strong on GPU builds, by
    the program's first thread."""
    if C.use_asm:
        tl.inline_asm_elementwise(ONE_THREAD_STORE32, "=r,l,r",
                                  [ptr.to(tl.int64), tl.cast(value, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, tl.cast(value, tl.int32))


@triton.jit
def push_word64(ptr, value, C: tl.constexpr):
    """Store one int64 word to peer memory (epoch-tagged row scalars): strong on GPU builds; an
    aligned 64-bit store is single-copy atomic, so the tag and the value arrive together."""
    if C.use_asm:
        tl.inline_asm_elementwise(ONE_THREAD_STORE64, "=r,l,l",
                                  [ptr.to(tl.int64), tl.cast(value, tl.int64)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, tl.cast(value, tl.int64))


@triton.jit
def spin_vectors(v, ptrs, tags, tag_ptrs, want, active, deadline_ns, abort_ptr, C: tl.constexpr):
    """Per-thread spin (GPU builds): each 16-byte vector of `v` (loaded from `ptrs`) is reloaded
    until none of its elements is the sentinel and its tag equals `want`, or the abort word is
    set, or the deadline passes. Returns (values, status per element: 0 arrived, 1 pending, 2
    present with a foreign tag)."""
    z = tl.zeros(v.shape, dtype=tl.int32)
    args = [v, (tags + z).to(tl.int32), (tag_ptrs + z).to(tl.int64), want + z, (abort_ptr + z).to(tl.int64),
            (active & (z == 0)).to(tl.int32), ptrs.to(tl.int64), deadline_ns + z.to(tl.int64)]
    if C.elem_bits == 16:
        out, status = tl.inline_asm_elementwise(SPIN16_ASM, SPIN16_CONSTRAINTS, args, dtype=(v.dtype, tl.int32),
                                                is_pure=False, pack=8)
    else:
        out, status = tl.inline_asm_elementwise(SPIN32_ASM, SPIN32_CONSTRAINTS, args, dtype=(v.dtype, tl.int32),
                                                is_pure=False, pack=4)
    return out, status


@triton.constexpr_function
def tags_asm(world):
    """Per-thread wait for the tag words of `world` sources at $1 + k * $2 bytes (k != $3: this
    rank's own region is never written): until every one equals $4, or the abort word at $5 is set,
    or the deadline $6 passes; none at all when $7 (dead) is set. Each retry issues every tag load
    and the abort load before testing any, so a retry costs one round trip whatever the world size.
    Output $0: 1 when every tag arrived."""
    w = int(world)
    tags = ", ".join(f"t{k}" for k in range(w))
    addrs = ", ".join(f"a{k}" for k in range(w))
    preds = ", ".join(f"m{k}" for k in range(w))
    body = [f"{{ .reg .pred p, q, {preds}; .reg .b32 ab, {tags}; .reg .b64 now, off, {addrs};",
            "mov.b32 $0, 0;", "setp.ne.b32 p, $7, 0;", "@p bra DONE;"]
    body += [f"setp.ne.s32 m{k}, $3, {k}; mul.lo.s64 off, $2, {k}; add.s64 a{k}, $1, off;" for k in range(w)]
    body += ["LOOP:"]
    body += [f"@m{k} ld.volatile.global.b32 t{k}, [a{k}];" for k in range(w)]
    body += ["ld.volatile.global.b32 ab, [$5];", "mov.pred p, 0;"]
    body += [f"@m{k} setp.ne.or.b32 p, t{k}, $4, p;" for k in range(w)]
    body += ["@!p bra OK;", "mov.u64 now, %globaltimer;", "setp.ne.b32 q, ab, 0;", "setp.gt.or.s64 q, now, $6, q;",
             "@!q bra LOOP;", "bra DONE;", "OK:", "mov.b32 $0, 1;", "DONE: }"]
    return "\n".join(body)


@triton.jit
def wait_tags(tag0_ptr, tag_words, rank, want, deadline_ns, dead, abort_ptr, C: tl.constexpr):
    """Wait (GPU builds) until the tag of every other source of one item, C.world of them at
    `tag0_ptr` + src * `tag_words`, equals `want`; returns 1 then, 0 when it ended on the abort
    word, the deadline or `dead`. Every thread spins on its own; the tags are reloaded together, so
    once the last source has arrived the wait ends within one round trip, where a spin on the data
    vectors one after another costs a round trip for every vector loaded before its source arrived.
    A tag says nothing of the data stored before it by other threads (relaxed stores, no order):
    the caller then loads the data and polls it (`poll_block`), which decides and classifies."""
    return tl.inline_asm_elementwise(tags_asm(C.world), "=r,l,l,r,r,l,l,r",
                                     [tag0_ptr.to(tl.int64), tag_words.to(tl.int64) * 4, rank.to(tl.int32),
                                      want.to(tl.int32), abort_ptr.to(tl.int64), deadline_ns.to(tl.int64),
                                      dead.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.constexpr_function
def sources_asm(world, pack):
    """Per-thread poll of one 16-byte vector from each of `world` sources at once (`pack`
    elements a vector: 8 of 16 bits or 4 of 32). Operands: outputs 4 words of data per source
    (source s at $4s..$4s+3; the own source's stay 0), then the status word once per element;
    inputs, each repeated once per element (only the first copy is read): source 0's vector
    address, a region's bytes, source 0's tag address, a tag column's bytes, the expected tag,
    this rank, the abort word's address, the deadline, whether the vector is polled at all. Every
    retry issues the loads of the vectors still missing, their tags and the abort word before it
    tests any, so it is one round trip whatever W, and goes on at once (the form measured best:
    reloading every source each retry, or a 100 ns pause per retry, measured no better;
    benchmarks/results/README.md, "the decode poll"). Status: bit s when source s's data still holds a
    sentinel, bit 8 + s when its tag is not the expected one; 0 when every source arrived.
    Between the outputs and the inputs: 4 words of this rank's own vector, not read (see
    `poll_sources`)."""
    w, pack = int(world), int(pack)
    out_status = 4 * w
    ops = {}
    cursor = out_status + pack + 4
    for name in ("PTR", "RSTRIDE", "TAGP", "TSTRIDE", "WANT", "RANK", "ABORTP", "DEADLINE", "ACT"):
        ops[name] = cursor
        cursor += pack
    preds = ", ".join([f"m{k}" for k in range(w)] + [f"n{k}" for k in range(w)])
    body = [f"{{ .reg .pred pl, pt, pq, {preds}; .reg .b32 w, ab, miss, bad, {', '.join(f't{k}' for k in range(w))};",
            f".reg .b64 now, off, {', '.join(f'a{k}' for k in range(w))}, {', '.join(f'g{k}' for k in range(w))};"]
    body += [f"mov.b32 ${i}, 0;" for i in range(4 * w)]
    body += ["mov.b32 miss, 0;", "mov.b32 bad, 0;", "setp.ne.b32 pq, $ACT, 0;", "@!pq bra DONE;"]
    body += [f"setp.ne.s32 m{k}, $RANK, {k}; mul.lo.s64 off, $RSTRIDE, {k}; add.s64 a{k}, $PTR, off; "
             f"mul.lo.s64 off, $TSTRIDE, {k}; add.s64 g{k}, $TAGP, off; mov.pred n{k}, m{k};" for k in range(w)]
    body += ["LOOP:"]
    body += [f"@n{k} ld.volatile.global.v4.b32 {{${4 * k}, ${4 * k + 1}, ${4 * k + 2}, ${4 * k + 3}}}, [a{k}];"
             for k in range(w)]
    body += [f"@n{k} ld.volatile.global.b32 t{k}, [g{k}];" for k in range(w)]
    body += ["ld.volatile.global.b32 ab, [$ABORTP];", "mov.b32 miss, 0;", "mov.b32 bad, 0;"]
    for k in range(w):
        body += ["mov.pred pl, 0;"]
        for i in range(4 * k, 4 * k + 4):
            if pack == 8:
                body += [f"and.b32 w, ${i}, 0xFFFF; setp.eq.or.b32 pl, w, 0x8000, pl;",
                         f"shr.u32 w, ${i}, 16; setp.eq.or.b32 pl, w, 0x8000, pl;"]
            else:
                body += [f"setp.eq.or.b32 pl, ${i}, 0x80000000, pl;"]
        body += [f"selp.b32 w, {1 << k}, 0, pl; or.b32 miss, miss, w;",
                 f"mov.pred pt, 0; @m{k} setp.ne.b32 pt, t{k}, $WANT; selp.b32 w, {1 << (8 + k)}, 0, pt; "
                 "or.b32 bad, bad, w;", f"or.pred n{k}, pl, pt; and.pred n{k}, n{k}, m{k};"]
    body += ["or.b32 w, miss, bad;", "setp.eq.b32 pq, w, 0;", "@pq bra DONE;", "mov.u64 now, %globaltimer;",
             "setp.ne.b32 pq, ab, 0;", "setp.gt.or.s64 pq, now, $DEADLINE, pq;", "@pq bra DONE;",
             "bra LOOP;", "DONE:", "or.b32 w, miss, bad;"]
    body += [f"mov.b32 ${out_status + k}, w;" for k in range(pack)]
    text = "\n".join(body) + " }"
    for name, index in sorted(ops.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(f"${name}", f"${index}")
    return text


@triton.constexpr_function
def sources_constraints(world, pack):
    """The operand constraints of `sources_asm(world, pack)`."""
    w, pack = int(world), int(pack)
    kinds = ["=r"] * (4 * w + pack) + ["r"] * 4
    for kind in ("l", "l", "l", "l", "r", "r", "l", "l", "r"):  # PTR RSTRIDE TAGP TSTRIDE WANT RANK ABORTP DEADLINE ACT
        kinds += [kind] * pack
    return ",".join(kinds)


@triton.constexpr_function
def sources_dtypes(dtype, world):
    """The result types of `sources_asm`: the data dtype once per source, then the status word."""
    return (dtype, ) * int(world) + (tl.int32, )


@triton.jit
def poll_sources(x, ptr0, region, tag0_ptr, tag_words, rank, want, active, deadline_ns, abort_ptr, C: tl.constexpr):
    """Per-thread poll (GPU builds, C.spin >= 4) of one item from every other source at once:
    `ptr0` ([1, chunk] pointers) is the item in source 0's region, source s's lies `region`
    elements further per s and its tag at `tag0_ptr` + s * `tag_words`. Each thread reloads its
    16-byte vector of every source, every tag and the abort word together until all arrived, the
    abort word is set or the deadline passes. Returns (a tuple of C.world [1, chunk] tensors, the
    own rank's zeros; a status word per element, `sources_asm`).

    `x`, this rank's own chunk as loaded (16-byte vectors), is an operand only for its layout:
    the assembly reads a whole vector at the first element's address, so a thread's `pack`
    elements must be consecutive in memory, and from pointers alone Triton gives the operation
    one element a thread (tests/kernels/test_oneshot.py lowers it and checks)."""
    z = tl.zeros(ptr0.shape, dtype=tl.int32)
    stride = (region.to(tl.int64) * (C.elem_bits // 8)) + z.to(tl.int64)
    args = [x, ptr0.to(tl.int64), stride, (tag0_ptr + z).to(tl.int64), tag_words.to(tl.int64) * 4 + z.to(tl.int64),
            want + z, rank + z, (abort_ptr + z).to(tl.int64), deadline_ns + z.to(tl.int64), active.to(tl.int32)]
    pack: tl.constexpr = 8 if C.elem_bits == 16 else 4
    out = tl.inline_asm_elementwise(sources_asm(C.world, pack),
                                    sources_constraints(C.world, pack), args,
                                    dtype=sources_dtypes(ptr0.dtype.element_ty, C.world), is_pure=False, pack=pack)
    return out


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def sources_failed(status):
    """(bitmask of the sources with an element not arrived, bitmask of those whose data was all
    present under a foreign tag) from `poll_sources`' status words: `source_status`'s record."""
    words = tl.reduce(tl.reduce(status, 1, _or), 0, _or)
    missing = words & 0xFF
    bad = (words >> 8) & 0xFF
    return missing | bad, bad & ~missing


@triton.jit
def poll_block(v, t, ptrs, mask, tag_ptrs, want, deadline_ns, max_spins, dead, abort_ptr, C: tl.constexpr):
    """Wait until the [sources, chunk] block at `ptrs` (local memory, under `mask`) holds no
    sentinel and every polled source's tag (at `tag_ptrs`, [sources, 1]) equals `want`, starting
    from values `v` and tags `t` already loaded (issued early, so their latency overlaps other
    work). Returns (values, status per element: 0 arrived, 1 pending, 2 present under a foreign
    tag; see `source_status`). The wait ends early, with elements still pending, when `dead` (an
    earlier failure of this rank) is set, when the abort word says that some rank gave up, or at
    the deadline.
    """
    rows = tl.max(mask.to(tl.int32), axis=1, keep_dims=True) > 0  # the sources polled at all
    if C.use_asm and C.spin:
        v, status = spin_vectors(v, ptrs, t, tag_ptrs, want, mask & (dead == 0), deadline_ns, abort_ptr, C)
    else:
        pending = mask & (as_bits(v, C.elem_bits) == C.sentinel)
        foreign = rows & (t != want)
        busy = tl.max(tl.max((pending | foreign).to(tl.int32), axis=0), axis=0) > 0  # in-thread first
        failed = dead
        spins = 0
        while busy & (failed == 0):
            # reload the whole block: a mask of only the pending elements would break the 16-byte
            # vector loads into 2-byte ones, and arrived data stays put until this rank re-arms it
            v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
            t = tl.load(tag_ptrs, mask=rows, other=0, volatile=True)
            aborted = tl.load(abort_ptr, volatile=True) != 0  # issued with the reload, not after it
            pending = mask & (as_bits(v, C.elem_bits) == C.sentinel)
            foreign = rows & (t != want)
            busy = tl.max(tl.max((pending | foreign).to(tl.int32), axis=0), axis=0) > 0
            spins += 1
            failed = deadline_passed(deadline_ns, spins, max_spins, C.use_asm) | aborted
        status = tl.where(pending, 1, tl.where(foreign & mask, 2, 0))
    return v, status


@triton.jit
def source_status(status, srcs):
    """(bitmask of the sources with an element not arrived, bitmask of those whose data was all
    present under a foreign tag): the failure record of a poll (`status` [sources, chunk])."""
    worst = tl.max(status, axis=1)
    missing = tl.max((status == 1).to(tl.int32), axis=1)
    pending = tl.sum((worst > 0).to(tl.int32) << srcs, axis=0)
    foreign = tl.sum(((worst == 2) & (missing == 0)).to(tl.int32) << srcs, axis=0)
    return pending, foreign


@triton.jit
def group_mask(ranks, rank, W: tl.constexpr):
    """`ranks` restricted to the group's other ranks: the record never names a rank outside it."""
    one = ranks * 0 + 1  # a tensor: `1 << W` with a constexpr W is not defined in the interpreter
    return ranks & ((one << W) - 1) & ~(one << rank)


@triton.jit
def tell_everyone(bufs, rank, C: tl.constexpr):
    """Set every rank's abort word (this rank's own included) to rank + 1: a plain remote store."""
    for r in tl.static_range(C.world):
        push_word(int32_ptr(bufs[r]), rank + 1, C)


@triton.jit
def record(err_ptr, errmap_ptr, code, ranks, row, calls):
    """Record a failure: the first code wins (local compare-and-swap), the rank masks accumulate;
    the host-mapped mirror gets the same words by plain stores (the code exactly; the rest as this
    program last saw them; `check()` reads the exact record from device memory)."""
    old = tl.atomic_cas(err_ptr, 0, code)
    if old == 0:
        tl.store(err_ptr + 2, row)
        tl.store(err_ptr + 3, calls)
        tl.store(errmap_ptr + 2, row)
        tl.store(errmap_ptr + 3, calls)
    seen = tl.atomic_or(err_ptr + 1, ranks)
    tl.store(errmap_ptr + 1, seen | ranks)
    tl.store(errmap_ptr, tl.where(old == 0, code, old))


@triton.jit
def fail(err_ptr, errmap_ptr, abort_ptr, bufs, rank, ranks, epoch_ranks, row, calls, C: tl.constexpr):
    """This rank gave up waiting on `ranks`: record it and tell every rank.

    ERR_EPOCH when every source it waited on had delivered data of another call (`epoch_ranks`),
    ERR_ABORTED naming the rank in the abort word when some rank gave up first, else ERR_TIMEOUT.
    """
    who = tl.load(abort_ptr, volatile=True)
    is_abort = who != 0
    ranks = group_mask(ranks, rank, C.world)
    epoch_ranks = group_mask(epoch_ranks, rank, C.world)
    if is_abort:
        if who - 1 != rank:
            record(err_ptr, errmap_ptr, ERR_ABORTED_C, group_mask(1 << (who - 1), rank, C.world), row, calls)
    else:
        code = tl.where((epoch_ranks == ranks) & (ranks != 0), ERR_EPOCH_C, ERR_TIMEOUT_C)
        record(err_ptr, errmap_ptr, code, ranks, row, calls)
        tell_everyone(bufs, rank, C)


@triton.jit
def stall(err_ptr, errmap_ptr, abort_ptr, bufs, rank, row, calls, C: tl.constexpr):
    """This rank's own programs did not all run in time: record ERR_STALL and, as `fail` does,
    tell every rank (their waits for this rank's data end at once)."""
    who = tl.load(abort_ptr, volatile=True)
    if who == 0:
        record(err_ptr, errmap_ptr, ERR_STALL_C, 0, row, calls)
        tell_everyone(bufs, rank, C)
    elif who - 1 != rank:
        record(err_ptr, errmap_ptr, ERR_ABORTED_C, group_mask(1 << (who - 1), rank, C.world), row, calls)


@triton.jit
def entry_state(err_ptr, errmap_ptr, abort_ptr, rank, calls, C: tl.constexpr):
    """True when this rank must not take part in the call: an earlier failure, or a rank gave up.

    The first time a peer's abort is seen, it is recorded as this rank's error (ERR_ABORTED with
    that rank), so `check()` raises here too and names who gave up.
    """
    err = tl.load(err_ptr)
    aborted = tl.load(abort_ptr, volatile=True)
    if (err == 0) & (aborted != 0) & (aborted - 1 != rank):
        record(err_ptr, errmap_ptr, ERR_ABORTED_C, group_mask(1 << (aborted - 1), rank, C.world), -1, calls)
    return (err != 0) | (aborted != 0)


@triton.jit
def publish_partial(part_ptr, item, value, calls):
    """Store one fp32 partial tagged with the call's epoch: (calls << 32) | bits(value).

    Epoch tags make the partials self-cleaning: a reader waits for its own epoch, so nothing is
    ever re-armed, and a stale value from an earlier call can never be taken for this call's.
    """
    bits = value.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    tl.store(part_ptr + item, (calls.to(tl.int64) << 32) | bits)


@triton.jit
def tagged(value, calls):
    """(calls << 32) | bits(value): an fp32 value with its call's epoch, in one int64 word."""
    bits = value.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return (calls.to(tl.int64) << 32) | bits


@triton.jit
def wait_tagged(ptrs, mask, calls, deadline_ns, max_spins, dead, USE_ASM: tl.constexpr):
    """The fp32 values at `ptrs` (epoch-tagged int64 words) once all carry this call's epoch;
    (values, ok). On `dead` the wait is skipped and ok is False."""
    want = calls.to(tl.int64)
    p = tl.load(ptrs, mask=and_scalar(mask, dead == 0), other=0, volatile=True)
    busy = tl.max((mask & ((p >> 32) != want)).to(tl.int32)) > 0
    failed = dead
    spins = 0
    while busy & (failed == 0):
        p = tl.load(ptrs, mask=mask, other=0, volatile=True)
        busy = tl.max((mask & ((p >> 32) != want)).to(tl.int32)) > 0
        spins += 1
        failed = deadline_passed(deadline_ns, spins, max_spins, USE_ASM)
    vals = (p & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.where(mask, vals, 0.0), busy == 0


@triton.jit
def wait_partials(ptrs, mask, calls, deadline_ns, max_spins, dead, USE_ASM: tl.constexpr):
    """The fp32 partials at `ptrs` once all carry this call's epoch; (values, ok).

    Producers are programs of this rank's own launch, all resident together (the launcher checks
    that the grid fits the GPU), so a timeout here means the GPU was held by other work
    (ERR_STALL). `deadline_ns` is the partials' deadline (`partials_deadline`): later than the
    data waits', so that a program delayed by a late peer has given up and published before its
    siblings decide that they stalled.
    """
    return wait_tagged(ptrs, mask, calls, deadline_ns, max_spins, dead, USE_ASM)


# Rows of more chunks than this wait for their partials with the block-wide loop (`wait_tagged`).
MAX_ASM_PARTIALS = tl.constexpr(16)


@triton.constexpr_function
def partials_asm(n, kinds):
    """Per-thread wait for a row's `n` epoch-tagged partials in each of len(kinds) sets (set j's
    words 8 bytes apart from its own base address): every word's high half equals the call's epoch,
    or the deadline passes, or `dead` is set; then each set's low halves combined in order
    0..n-1, by its kind: "s" the fp32 sum (each add rounded, no contraction), "m" the signed
    maximum. One loop polls every set, so a second set costs no second wait.
    Operands: outputs the combined bits of each set, then ok; inputs each set's base address,
    then the epoch, the deadline (ns) and dead."""
    n, kinds = int(n), str(kinds)
    sets = len(kinds)
    ok = f"${sets}"
    base = [f"${sets + 1 + j}" for j in range(sets)]
    want, deadline, dead = (f"${2 * sets + 1 + k}" for k in range(3))
    words = [[f"w{j}_{k}" for k in range(n)] for j in range(sets)]
    regs = ", ".join(w for ws in words for w in ws)
    body = [f"{{ .reg .pred p, q; .reg .b64 {regs}, now; .reg .b32 lo, hi, acc; .reg .f32 s, v;"]
    body += [f"mov.b64 {w}, 0;" for ws in words for w in ws]
    body += [f"mov.b32 {ok}, 0;", f"setp.ne.b32 p, {dead}, 0;", "@p bra DONE;", "LOOP:"]
    body += [f"ld.volatile.global.b64 {words[j][k]}, [{base[j]}+{8 * k}];" for j in range(sets) for k in range(n)]
    body += ["mov.pred p, 0;"]
    body += [f"mov.b64 {{lo, hi}}, {w}; setp.ne.or.b32 p, hi, {want}, p;" for ws in words for w in ws]
    body += ["@!p bra OK;", "mov.u64 now, %globaltimer;", f"setp.gt.s64 q, now, {deadline};", "@!q bra LOOP;",
             "bra DONE;", "OK:", f"mov.b32 {ok}, 1;", "DONE:"]
    for j, kind in enumerate(kinds):
        ws = words[j]
        if kind == "s":
            body += [f"mov.b64 {{lo, hi}}, {ws[0]}; mov.b32 s, lo;"]
            body += [f"mov.b64 {{lo, hi}}, {w}; mov.b32 v, lo; add.rn.f32 s, s, v;" for w in ws[1:]]
            body += [f"mov.b32 ${j}, s;"]
        elif kind == "m":
            body += [f"mov.b64 {{lo, hi}}, {ws[0]}; mov.b32 acc, lo;"]
            body += [f"mov.b64 {{lo, hi}}, {w}; max.s32 acc, acc, lo;" for w in ws[1:]]
            body += [f"mov.b32 ${j}, acc;"]
        else:
            raise ValueError(f"partials_asm: kind {kind!r} is not 's' (sum) or 'm' (max)")
    body += ["}"]
    return "\n".join(body)


@triton.jit
def row_partials(ptr, calls, deadline_ns, max_spins, dead, C: tl.constexpr, KIND: tl.constexpr):
    """(the row's C.num_chunks partials at `ptr` combined: KIND 0 their fp32 sum, KIND 1 the
    maximum of their bits as int32; ok). With C.spin >= 2 on GPU builds (and at most
    MAX_ASM_PARTIALS chunks) every thread waits on its own, without a block-wide reduction per
    retry, and sums in chunk order; otherwise one block reduction per retry decides (`wait_tagged`)
    and the combination is a tree. Every rank takes the same path, so the bits agree."""
    if C.use_asm and (C.spin >= 2) and (C.num_chunks <= MAX_ASM_PARTIALS):
        bits, ok = tl.inline_asm_elementwise(partials_asm(C.num_chunks, "s" if KIND == 0 else "m"), "=r,=r,l,r,l,r",
                                             [ptr.to(tl.int64), calls.to(tl.int32), deadline_ns.to(tl.int64),
                                              dead.to(tl.int32)], dtype=(tl.int32, tl.int32), is_pure=False, pack=1)
        if KIND == 0:
            value = bits.to(tl.float32, bitcast=True)
        else:
            value = bits
        ok = ok != 0
    else:
        parts = tl.arange(0, C.num_chunks_p2)
        p, ok = wait_tagged(ptr + parts, parts < C.num_chunks, calls, deadline_ns, max_spins, dead, C.use_asm)
        if KIND == 0:
            value = tl.sum(p, axis=0)
        else:
            value = tl.max(p.to(tl.int32, bitcast=True), axis=0)
    return value, ok


@triton.jit
def row_sum_and_max(sum_ptr, max_ptr, calls, deadline_ns, max_spins, dead, C: tl.constexpr):
    """(the fp32 sum of the row's partials at `sum_ptr`, the int32 maximum of those at `max_ptr`,
    ok): `row_partials` of both sets, with one wait for the two on GPU builds (C.spin >= 2), since
    they are published together and a second wait would only add a round trip."""
    if C.use_asm and (C.spin >= 2) and (C.num_chunks <= MAX_ASM_PARTIALS):
        sum_bits, mx, ok = tl.inline_asm_elementwise(
            partials_asm(C.num_chunks, "sm"), "=r,=r,=r,l,l,r,l,r",
            [sum_ptr.to(tl.int64), max_ptr.to(tl.int64), calls.to(tl.int32), deadline_ns.to(tl.int64),
             dead.to(tl.int32)], dtype=(tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)
        total, ok = sum_bits.to(tl.float32, bitcast=True), ok != 0
    else:
        total, ok_sum = row_partials(sum_ptr, calls, deadline_ns, max_spins, dead, C, 0)
        mx, ok_max = row_partials(max_ptr, calls, deadline_ns, max_spins, dead, C, 1)
        ok = ok_sum & ok_max
    return total, mx, ok


@triton.jit
def partials_deadline(deadline_ns, timeout_ns, max_spins, USE_ASM: tl.constexpr):
    """(deadline, spin bound) of waits for this rank's own programs: the data waits' plus half a
    timeout of grace (a sibling that waited out a late peer still has that long to publish)."""
    if USE_ASM:
        d = deadline_ns + timeout_ns // 2
    else:
        d = deadline_ns
    return d, max_spins + max_spins // 2
