"""The `twoshot` strategy: reduce-scatter by token rows, gather the sums, epilogue on every rank.

One Triton kernel (`tpfuse.kernels.twoshot`) over the same peer buffers and Lamport protocol
as `oneshot` (`tpfuse.strategies.workspace`). Each rank reduces R = ceil(M / W) rows and pushes
the rounded sums to every rank, so each input byte crosses the fabric about twice instead of
W - 1 times: the better trade once messages are large. Options and workspace lifetime as in
`tpfuse.strategies.oneshot`.
"""

from __future__ import annotations

from tpfuse.strategies.oneshot import PeerStrategy


class TwoShotStrategy(PeerStrategy):
    name = "twoshot"
    description = "two-shot (reduce-scatter rows, gather sums) allreduce + residual + RMSNorm in one Triton kernel over CUDA IPC peer buffers"
    extra_regions = 1  # the gather region of each slot

    def _launcher(self):
        from tpfuse.kernels.twoshot import twoshot_launch

        return twoshot_launch
