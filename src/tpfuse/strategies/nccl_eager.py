"""The `nccl_eager` strategy: NCCL all_reduce in the input dtype, then add + RMSNorm in eager torch.

The unfused path as engines run it before any fusion work: one NCCL call, then the residual add
and the RMSNorm as separate torch kernels (`tpfuse.reference.residual_rmsnorm_ref`, fp32
math, three roundings). It is the baseline the do-no-harm guard protects: a fused strategy has to
beat the best of this, `nccl_epilogue` and `reference` to be chosen. Not fused (`fused = False`).

Numerics: NCCL reduces in the input dtype, in an order it chooses, so on random bf16/fp16 inputs
the sum can differ from the reference's single fp32 rounding (held to `reference.TOLERANCE`);
sums of small integers are exact in any order, so it matches the reference bit for bit on them.
Every rank receives the same reduced buffer, so every rank returns identical bits. Runs on the
caller's stream; CUDA-graph capturable as far as NCCL is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.quant import KINDS
from tpfuse.reference import residual_rmsnorm_quant_ref, residual_rmsnorm_ref
from tpfuse.spec import Needs
from tpfuse.strategies.base import Strategy


class NcclEagerStrategy(Strategy):
    name = "nccl_eager"
    description = "NCCL all_reduce (input dtype), then torch add + RMSNorm (separate kernels)"
    fused = False
    needs = Needs(cuda=True, nccl=True, quant=KINDS)  # quantized output: the reference quantizer (eager torch)

    def _reduced(self, x: torch.Tensor) -> torch.Tensor:
        s = x.clone()
        if self.ctx.world_size > 1:
            dist.all_reduce(s, group=self.ctx.group)
        return s

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduced(x)

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps, *, quant=None):
        if quant is not None:
            return residual_rmsnorm_quant_ref(self._reduced(x), residual, weight, eps, quant)
        return residual_rmsnorm_ref(self._reduced(x), residual, weight, eps)
