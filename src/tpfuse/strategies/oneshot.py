"""The `oneshot` strategy: every rank reads every peer's rows and applies the epilogue, in one kernel.

Collective and epilogue are one Triton kernel (`tpfuse.kernels.oneshot`) over peer buffers
(`tpfuse.strategies.peer`: options, workspace lifetime, errors): lowest latency at decode sizes,
W x the bytes of the input over the fabric.
"""

from __future__ import annotations

from tpfuse.strategies.peer import PeerStrategy


class OneShotStrategy(PeerStrategy):
    name = "oneshot"
    description = "one-shot allreduce + residual + RMSNorm in one Triton kernel over CUDA IPC peer buffers (Lamport)"

    def _kernel(self):
        from tpfuse.kernels.oneshot import oneshot_kernel

        return oneshot_kernel
