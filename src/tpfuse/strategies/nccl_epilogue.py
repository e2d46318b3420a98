"""The `nccl_epilogue` strategy: NCCL all_reduce, then the fused residual-add + RMSNorm kernel.

What serving engines do without a fused collective, with the add and the norm in one Triton pass
(`tpfuse.kernels.epilogue`) instead of several torch kernels. Not fused in the strategy sense
(`fused = False`): the collective and the epilogue are two kernels, so this is the unfused
baseline that a fused strategy must beat.

Numerics: NCCL reduces in the input dtype (as engines call it), rounding partial sums at every
hop in an order NCCL chooses, not once in fp32 in rank order 0..W-1. Sums of small integers are
exact either way, so it matches the reference bit for bit on them; on other inputs it is held to
`tpfuse.reference.TOLERANCE` instead. Every rank receives the same reduced buffer, so every
rank still returns identical bits. Runs on the caller's stream; CUDA-graph capturable as far as
NCCL is (it is, with NCCL groups).

Quantized output (`quant=`, every format of `tpfuse.quant`): the same epilogue kernel quantizes
the normed rows before they leave registers (`tpfuse.kernels.quant.quantize_row`), bit for bit
the reference quantizer of the kernel's fp32 rows. Admitted on every GPU Triton runs on: the e4m3
and e2m1 conversions have a software path from integer ops; the hardware e4m3 (sm_89+) and e2m1
(compute capability 10.0+) cvts are used where the capability has them (admission's reason says
which); the bits are the same.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

from tpfuse._version import extra_hint
from tpfuse.kernels.protocol import MAX_HIDDEN  # imports no Triton: admission stays light
from tpfuse.quant import KINDS, admission_reason
from tpfuse.spec import Needs, Problem, Verdict
from tpfuse.strategies.base import Strategy


class NcclEpilogueStrategy(Strategy):
    name = "nccl_epilogue"
    description = "NCCL all_reduce (input dtype), then one fused residual-add + RMSNorm Triton kernel"
    fused = False
    needs = Needs(cuda=True, nccl=True, dtypes=("float16", "bfloat16", "float32"), quant=KINDS)

    @classmethod
    def extra_admits(cls, problem: Problem, caps) -> Verdict:
        if importlib.util.find_spec("triton") is None:
            return Verdict.no(f"needs the 'triton' package for the epilogue kernel ({extra_hint('triton')})")
        if problem.hidden > MAX_HIDDEN:
            return Verdict.no(f"hidden size {problem.hidden} exceeds {MAX_HIDDEN} (one row per program in registers)")
        if problem.quant is not None:
            return Verdict.yes(f"NCCL group with CUDA tensors; {admission_reason(problem.quant, caps)}")
        return Verdict.yes("NCCL group with CUDA tensors")

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        # Imported here, not at module top: admission imports this module and must not load Triton.
        from tpfuse.kernels.epilogue import launch_config, launch_residual_rmsnorm

        self._epilogue, self._launch_config = launch_residual_rmsnorm, launch_config
        # The process group's own allreduce with its options built once: what dist.all_reduce
        # does without its per-call Python checks (torch's NCCL watchdog still covers the call).
        self._group = ctx.group if ctx.group is not None else dist.group.WORLD
        self._options = dist.AllreduceOptions()
        self._options.reduceOp = dist.ReduceOp.SUM
        if hasattr(self._options, "asyncOp"):  # torch >= 2.7: on the caller's stream, as async_op=False runs
            self._options.asyncOp = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        # also at world size 1, so one GPU exercises the NCCL path
        work = self._group.allreduce([y], self._options)
        if work is not None:  # NCCL with asyncOp=False ran it on this stream and returns no work
            work.wait()
        return y

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps, *, quant=None):
        # The Communicator validated the arguments (and quant): the epilogue's unchecked launch,
        # pre-bound per shape.
        return self._epilogue(self.all_reduce(x), residual, weight, eps, quant=quant)

    def prepare(self, *, hidden: int, dtype: torch.dtype, max_tokens: int) -> None:
        """Compile every epilogue variant that calls of up to `max_tokens` use, before any graph capture."""
        itemsize = dtype.itemsize
        # launch_config is piecewise constant in the token count, changing at these counts
        configs = {}
        for tokens in (1, 256, 1024, 2048):
            if tokens <= max_tokens:
                configs.setdefault(self._launch_config(hidden, itemsize, tokens), tokens)
        for tokens in configs.values():
            x = torch.ones(tokens, hidden, dtype=dtype, device=self.ctx.device)
            self._epilogue(x, x, x[0], 1e-6)
            self._epilogue(x, None, x[0], 1e-6)
