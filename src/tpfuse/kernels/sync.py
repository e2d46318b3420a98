"""Waiting primitives of the fused collectives, safe on PCIe by construction.

The protocol (see `tpfuse.strategies.workspace`) is Lamport's "data is the flag": a receive slot
holds a sentinel bit pattern until a peer's plain remote store overwrites it with data. So the
kernels need only posted remote stores and volatile polling of *local* memory: no remote
read-modify-write (which PCIe P2P may not make atomic), no barrier, no flag word to order.

Sentinel: negative zero (0x8000 for 16-bit floats, 0x80000000 for fp32), the choice of
TensorRT-LLM and FlashInfer. Real data never holds it because every writer canonicalises -0.0 to
+0.0 first (`canonicalize`); that changes only the sign of exact zeros, which no sum, residual
add or RMSNorm output distinguishes (they compare equal).

Every spin is bounded. On a GPU (`USE_ASM=True`) the bound is wall time read from the
`%globaltimer` register (nanoseconds) against a deadline fixed at kernel entry; the Triton
interpreter has no inline assembly, so there (`USE_ASM=False`) the bound is a spin count. A wait
also ends when the rank's abort word is set (`tpfuse.kernels.protocol`): a rank that gives up
(`fail`) tells every rank with a plain store, so no rank waits for a call that cannot complete
and none pushes into it afterwards (`entry_state`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse.kernels.protocol import ERR_ABORTED, ERR_STALL, ERR_TIMEOUT

ERR_TIMEOUT_C, ERR_ABORTED_C, ERR_STALL_C = tl.constexpr(ERR_TIMEOUT), tl.constexpr(ERR_ABORTED), tl.constexpr(ERR_STALL)

@triton.jit
def globaltimer_ns():
    """Nanoseconds from the GPU's global timer (PTX `%globaltimer`); GPU builds only."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


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
def and_scalar(mask, cond):
    """`mask & cond` for a scalar `cond`, broadcast first (Triton 3.9's interpreter rejects the
    mixed form as a mask; compiled, both forms are the same predicate)."""
    return mask & ((mask.to(tl.int32) * 0 + cond.to(tl.int32)) != 0)


@triton.jit
def poll_block(
    ptrs, mask, deadline_ns, max_spins, dead, abort_ptr,
    SENT: tl.constexpr, ELEM_BITS: tl.constexpr, USE_ASM: tl.constexpr,
):
    """Volatile-load every element of `ptrs` under `mask` (local memory) until none holds the sentinel.

    All sources' loads are issued at once (`ptrs` is a [sources, chunk] block, 16 bytes per
    thread and source); one reduction per retry decides whether to go on.
    Returns (values, pending, arrived): `arrived` is the scalar "nothing pending" (`pending` says
    which elements are not, for the failure record). The wait ends early, with
    elements still pending, when `dead` (an earlier failure of this rank) is set, when the abort
    word says that some rank gave up, or at the deadline.
    """
    v = tl.load(ptrs, mask=and_scalar(mask, dead == 0), other=0.0, volatile=True)
    return poll_from(v, ptrs, mask, deadline_ns, max_spins, dead, abort_ptr, SENT, ELEM_BITS, USE_ASM)


@triton.jit
def poll_from(
    v, ptrs, mask, deadline_ns, max_spins, dead, abort_ptr,
    SENT: tl.constexpr, ELEM_BITS: tl.constexpr, USE_ASM: tl.constexpr,
):
    """`poll_block` starting from values `v` already loaded from `ptrs` (a prefetch)."""
    pending = mask & (as_bits(v, ELEM_BITS) == SENT)
    busy = tl.max(tl.max(pending.to(tl.int32), axis=0), axis=0) > 0  # sources (in-thread) first
    failed = dead
    spins = 0
    while busy & (failed == 0):
        # reload the whole block: a mask of only the pending elements would break the 16-byte
        # vector loads into 2-byte ones, and arrived data stays put until this rank re-arms it
        v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
        pending = mask & (as_bits(v, ELEM_BITS) == SENT)
        busy = tl.max(tl.max(pending.to(tl.int32), axis=0), axis=0) > 0  # sources (in-thread) first
        spins += 1
        aborted = tl.load(abort_ptr, volatile=True) != 0
        failed = deadline_passed(deadline_ns, spins, max_spins, USE_ASM) | aborted
    return v, pending, busy == 0


@triton.jit
def pending_ranks(pending, srcs):
    """Bitmask of the sources (rows of `pending`) with an element still pending."""
    return tl.sum(tl.max(pending.to(tl.int32), axis=1) << srcs, axis=0)


@triton.jit
def fail(err_ptr, abort_ptr, bufs, rank, ranks, row, calls, W: tl.constexpr):
    """This rank gave up waiting on `ranks`: record it (first failure wins) and tell every rank.

    The error words are local (device-scope atomics on local memory); each rank's abort word,
    this rank's own included, gets `rank + 1` by a plain store, which PCIe peers support.
    """
    is_abort = tl.load(abort_ptr, volatile=True) != 0
    code = tl.where(is_abort, ERR_ABORTED_C, ERR_TIMEOUT_C)
    if tl.atomic_cas(err_ptr, 0, code) == 0:
        tl.store(err_ptr + 2, row)
        tl.store(err_ptr + 3, calls)
    if is_abort:
        who = tl.load(abort_ptr, volatile=True) - 1
        if who != rank:
            tl.atomic_or(err_ptr + 1, 1 << who)
    else:
        tl.atomic_or(err_ptr + 1, ranks)
        for r in tl.static_range(W):
            tl.store(int32_ptr(bufs[r]), rank + 1)


@triton.jit
def entry_state(err_ptr, abort_ptr, rank, calls):
    """True when this rank must not take part in the call: an earlier failure, or a rank gave up.

    The first time a peer's abort is seen, it is recorded as this rank's error (ERR_ABORTED with
    that rank), so `check()` raises here too and names who gave up.
    """
    err = tl.load(err_ptr)
    aborted = tl.load(abort_ptr, volatile=True)
    if (err == 0) & (aborted != 0) & (aborted - 1 != rank):
        if tl.atomic_cas(err_ptr, 0, ERR_ABORTED_C) == 0:
            tl.atomic_or(err_ptr + 1, 1 << (aborted - 1))
            tl.store(err_ptr + 3, calls)
    return (err != 0) | (aborted != 0)


@triton.jit
def publish_partial(part_ptr, item, value, calls):
    """Store one fp32 norm partial tagged with the call's epoch: (calls << 32) | bits(value).

    Epoch tags make the partials self-cleaning: a reader waits for its own epoch, so nothing is
    ever re-armed, and a stale value from an earlier call can never be taken for this call's.
    """
    bits = value.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    tl.store(part_ptr + item, (calls.to(tl.int64) << 32) | bits)


@triton.jit
def wait_partials(ptrs, mask, calls, deadline_ns, max_spins, dead, USE_ASM: tl.constexpr):
    """The fp32 partials at `ptrs` once all carry this call's epoch; (values, ok).

    On `dead` the wait is skipped and ok is False. Producers are programs of this rank's own
    launch, all resident together (the grid never exceeds the SMs available to this rank), so a
    timeout here means the GPU was held by other work (ERR_STALL).
    """
    want = calls.to(tl.int64)
    p = tl.load(ptrs, mask=and_scalar(mask, dead == 0), other=0, volatile=True)
    busy = tl.max((mask & ((p >> 32) != want)).to(tl.int32), axis=0) > 0
    failed = dead
    spins = 0
    while busy & (failed == 0):
        p = tl.load(ptrs, mask=mask, other=0, volatile=True)
        busy = tl.max((mask & ((p >> 32) != want)).to(tl.int32), axis=0) > 0
        spins += 1
        failed = deadline_passed(deadline_ns, spins, max_spins, USE_ASM)
    vals = (p & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.where(mask, vals, 0.0), busy == 0


@triton.jit
def stall(err_ptr, row, calls):
    """Record ERR_STALL (this rank's own programs did not all run in time)."""
    if tl.atomic_cas(err_ptr, 0, ERR_STALL_C) == 0:
        tl.store(err_ptr + 2, row)
        tl.store(err_ptr + 3, calls)
