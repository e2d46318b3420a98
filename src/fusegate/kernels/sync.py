"""Waiting primitives of the fused collectives, safe on PCIe by construction.

The protocol (see `fusegate.backends.workspace`) is Lamport's "data is the flag": a receive slot
holds a sentinel bit pattern until a peer's plain remote store overwrites it with data. So the
kernels need only posted remote stores and volatile polling of *local* memory: no remote
read-modify-write (which PCIe P2P may not make atomic), no barrier, no flag word to order.

Sentinel: negative zero (0x8000 for 16-bit floats, 0x80000000 for fp32), the choice of
TensorRT-LLM and FlashInfer. Real data never holds it because every writer canonicalises -0.0 to
+0.0 first (`canonicalize`); that changes only the sign of exact zeros, which no sum, residual
add or RMSNorm output distinguishes (they compare equal).

Every spin is bounded. On a GPU (`USE_ASM=True`) the bound is wall time read from the
`%globaltimer` register (nanoseconds) against a deadline fixed at kernel entry; the Triton
interpreter has no inline assembly, so there (`USE_ASM=False`) the bound is a spin count. A poll
that gives up returns `ok=False`; the caller records which peer never arrived and exits.
"""

from __future__ import annotations

import triton
import triton.language as tl

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
def poll_ready(
    ptrs, mask, deadline_ns, max_spins, dead,
    SENT: tl.constexpr, ELEM_BITS: tl.constexpr, USE_ASM: tl.constexpr,
):
    """Volatile-load `ptrs` (local memory) until no element under `mask` holds the sentinel.

    Returns (values, ok). `dead` (a kernel-wide earlier failure) skips the wait: the row is
    returned as it is and ok is False, so a failed call finishes fast instead of waiting once per
    row. Volatile loads bypass L1, so every iteration sees stores that have reached memory.
    """
    v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    busy = tl.sum((mask & (as_bits(v, ELEM_BITS) == SENT)).to(tl.int32), axis=0) > 0
    failed = dead
    spins = 0
    while busy & (failed == 0):
        v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
        busy = tl.sum((mask & (as_bits(v, ELEM_BITS) == SENT)).to(tl.int32), axis=0) > 0
        spins += 1
        failed = deadline_passed(deadline_ns, spins, max_spins, USE_ASM)
    return v, busy == 0


@triton.jit
def record_timeout(err_ptr, peer, row, calls):
    """Record that `peer`'s data for `row` never arrived: err[0]=1, err[1] |= 1<<peer, err[2]=row, err[3]=call.

    Only this rank's own (local) error words are touched; the atomics are device-local.
    """
    tl.atomic_or(err_ptr + 1, 1 << peer)
    tl.store(err_ptr + 2, row)
    tl.store(err_ptr + 3, calls)
    tl.atomic_xchg(err_ptr, 1)
