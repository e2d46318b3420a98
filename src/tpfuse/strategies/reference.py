"""The `reference` strategy: torch.distributed all_reduce, then add and RMSNorm in plain torch.

Runs wherever torch.distributed runs (gloo on CPU, NCCL on GPUs, across nodes). 16-bit inputs are
reduced in fp32 (twice the bytes of a bf16 allreduce) so that the sum is accumulated in fp32 as
the op's contract says; the epilogue is `tpfuse.reference.residual_rmsnorm_ref` itself, so this
strategy matches the reference bit for bit whenever the fp32 sum is exact. Every rank receives the
same reduced buffer from the collective, so every rank returns identical bits.

Peer failure: over gloo the allreduce runs on a `HostGroup` (a private gloo group whose own
timeout is `timeout_s`: Communicator option, default TPFUSE_TIMEOUT_S) and is waited on for at most
that long, then raises `PeerLostError` naming the ranks that failed; later calls refuse at once, and
`close()` and process exit return within the bound (`tpfuse.strategies.host_wait`). CUDA tensors
of a gloo group are staged through host memory (refused under CUDA-graph capture). Over NCCL,
NCCL's watchdog and the group timeout apply.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.quant import KINDS
from tpfuse.reference import accumulation_dtype, residual_rmsnorm_quant_ref, residual_rmsnorm_ref
from tpfuse.spec import Needs
from tpfuse.strategies.base import Strategy
from tpfuse.strategies.host_wait import HostGroup, PeerGuard, goes_through_host, refuse_capture, strategy_timeout_s


class ReferenceStrategy(Strategy):
    name = "reference"
    description = "torch.distributed all_reduce (fp32 accumulation), then torch add + RMSNorm"
    fused = False
    needs = Needs(quant=KINDS)  # quantized output through tpfuse.reference.quantize_ref

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        timeout_s = strategy_timeout_s(ctx.options, self.name)
        bounded = goes_through_host(ctx.group, ctx.device)
        self._host = HostGroup(ctx.group, timeout_s, self.name) if bounded and ctx.world_size > 1 else None
        self._guard = PeerGuard(self.name, ctx.rank, timeout_s, bounded=bounded, host_group=self._host)
        others = [r for r in range(ctx.world_size) if r != ctx.rank]
        self._peers = f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"

    def check(self) -> None:
        self._guard.check()

    def close(self) -> None:
        self._guard.close()
        self._host = None

    def _reduced(self, x: torch.Tensor) -> torch.Tensor:
        if self._host is not None and x.is_cuda:
            refuse_capture(self.name)
        acc = x.to(accumulation_dtype(x.dtype), copy=True)
        if self.ctx.world_size == 1:
            return acc
        if self._host is None:
            self._guard.wait([dist.all_reduce(acc, group=self.ctx.group, async_op=True)], self._peers)
            return acc
        wire = acc.cpu() if acc.is_cuda else acc
        self._guard.wait([self._host.pg.allreduce([wire])], self._peers)
        return wire.to(acc.device) if acc.is_cuda else wire

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduced(x).to(x.dtype)

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps, *, quant=None):
        s = self._reduced(x).to(x.dtype)
        if quant is not None:
            return residual_rmsnorm_quant_ref(s, residual, weight, eps, quant)
        return residual_rmsnorm_ref(s, residual, weight, eps)
