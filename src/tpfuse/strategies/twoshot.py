"""The `twoshot` strategy: reduce-scatter to owners, gather the sums, epilogue on every rank.

One Triton kernel (`tpfuse.kernels.twoshot`) over the same peer buffers and Lamport protocol
as `oneshot` (`tpfuse.strategies.peer`: options, workspace lifetime, errors). Each input byte
crosses the fabric about twice instead of W - 1 times: the better trade once messages are large.
From as many tokens a rank as its plan has programs (`tpfuse.kernels.protocol.twoshot_owns_rows`),
owners hold whole rows and push each row's sum of squares with its sums, so no rank exchanges norm
partials; quantized output is then written by the epilogue after the allreduce.
"""

from __future__ import annotations

from tpfuse.strategies.peer import PeerStrategy


class TwoShotStrategy(PeerStrategy):
    name = "twoshot"
    description = ("two-shot (reduce-scatter to owners, gather sums) allreduce + residual + RMSNorm in one Triton "
                   "kernel over CUDA IPC peer buffers")
    twoshot = True  # one gather region per slot beyond one per rank

    def _kernel(self):
        from tpfuse.kernels.twoshot import twoshot_kernel

        return twoshot_kernel
