"""A one-program kernel that runs `tpfuse.kernels.sync.fail` or `stall` on given words, for
tests/kernels/test_sync.py. Import it only where Triton may be imported (inside spawned
interpreter ranks after TRITON_INTERPRET is set, or in GPU tests)."""

import triton
import triton.language as tl

from tpfuse.kernels.sync import fail, int32_ptr, stall


@triton.jit(do_not_specialize=["rank"])
def record_kernel(err_ptr, errmap_ptr, bufs, rank, ranks, epoch_ranks, STALL: tl.constexpr, C: tl.constexpr):
    abort_ptr = int32_ptr(bufs[0])
    if rank == 1:  # the abort word of this rank's own buffer (the tests use ranks 0 and 1)
        abort_ptr = int32_ptr(bufs[1])
    if STALL:
        stall(err_ptr, errmap_ptr, abort_ptr, bufs, rank, 5, 9, C)
    else:
        fail(err_ptr, errmap_ptr, abort_ptr, bufs, rank, ranks, epoch_ranks, 5, 9, C)
