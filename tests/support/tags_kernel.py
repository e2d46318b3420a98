"""A kernel that runs `tpfuse.kernels.sync.wait_tags` once in every program on given words, for
tests/kernels/test_sync.py (GPU builds only: the wait is inline assembly). Import it only where
Triton may be imported."""

import triton
import triton.language as tl

from tpfuse.kernels.sync import globaltimer_ns, start_deadline, wait_tags


@triton.jit(do_not_specialize=["tag_words", "rank", "want", "timeout_ns", "dead"])
def wait_tags_kernel(tag_ptr, abort_ptr, out_ptr, tag_words, rank, want, timeout_ns, dead, C: tl.constexpr):
    """out[2 * pid] = wait_tags(...) as the program's first thread saw it; out[2 * pid + 1] the
    wait's length in microseconds (floor)."""
    pid = tl.program_id(0)
    start = globaltimer_ns()
    deadline = start_deadline(timeout_ns, C.use_asm)
    ok = wait_tags(tag_ptr, tag_words, rank, want, deadline, dead, abort_ptr, C)
    tl.store(out_ptr + 2 * pid, ok)
    tl.store(out_ptr + 2 * pid + 1, ((globaltimer_ns() - start) // 1000).to(tl.int32))
