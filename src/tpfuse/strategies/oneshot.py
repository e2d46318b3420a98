"""The `oneshot` strategy: every rank reads every peer's rows and applies the epilogue, in one kernel.

Collective and epilogue are one Triton kernel (`tpfuse.kernels.oneshot`) over peer buffers
mapped through CUDA IPC (`tpfuse.strategies.workspace`, Lamport protocol): lowest latency at
decode sizes, W x the bytes of the input over the fabric. `PeerStrategy` here is also the base of
`twoshot`.

Options (Communicator keyword options): `timeout_s` (spin bound, default TPFUSE_TIMEOUT_S),
`max_tokens` (workspace sizing when prepare() was not called), `max_programs` (grid cap; default
the GPU's SM count, divided by the number of ranks sharing that GPU so that all ranks' programs
can be resident together).

Workspace lifetime: allocated once, in prepare() (before graph capture) for that (hidden, dtype,
max_tokens), or by the first eager call. It is never reallocated: a later call that does not fit
(decided from the shape alone, so identically on every rank) is served by the unfused path of the
group (`nccl_epilogue` on NCCL groups, `reference` otherwise), which is also safe inside a CUDA graph
that was captured on the workspace. One workspace per dtype; calls from several streams are
ordered one after another (`LamportWorkspace._bind_stream`). Failures raise
PeerTimeoutError on the next eager call, or from `check()` (which synchronises).

Quantized output (`quant=`, every format of `tpfuse.quant`) is written by the peer kernel
itself (`tpfuse.kernels.quant.quantize_chunk` per chunk; a row split over programs exchanges
its absmax for per-token FP8 as it does its sum of squares), bit for bit the reference quantizer
of the kernel's fp32 rows. A plan whose chunks do not hold whole scale blocks (per-group FP8 with
a group above 128) takes two kernels instead: the peer allreduce, then the quantizing epilogue.
Run one quantized call eagerly before graph capture: prepare() does not compile that variant.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import ClassVar

import torch

from tpfuse import env
from tpfuse.kernels.protocol import (
    MAX_HIDDEN,
    MAX_INPUT_BYTES,
    MAX_WORLD,
    make_plan,
    plan_programs,
    quantizes_in_kernel,
    region_elems_for,
)
from tpfuse.quant import KINDS, admission_reason
from tpfuse.spec import Needs, Problem, Verdict
from tpfuse.strategies.base import Strategy

FUSED_DTYPES = ("float16", "bfloat16", "float32")


class PeerStrategy(Strategy):
    """Common part of the peer-buffer strategies: admission, workspace, launch, errors."""

    fused = True
    needs = Needs(cuda=True, peer_access=True, single_host=True, dtypes=FUSED_DTYPES, max_input_bytes=MAX_INPUT_BYTES,
                  quant=KINDS)
    extra_regions: ClassVar[int] = 0  # regions per slot beyond one per rank (twoshot: the gather region)

    @classmethod
    def extra_admits(cls, problem: Problem, caps) -> Verdict:
        row_bytes = problem.hidden * problem.itemsize
        if importlib.util.find_spec("triton") is None:
            return Verdict.no("needs the 'triton' package (pip install 'tpfuse[triton]')")
        if problem.hidden > MAX_HIDDEN:
            return Verdict.no(f"hidden size {problem.hidden} exceeds {MAX_HIDDEN} (one row per program in registers)")
        if row_bytes % 16:
            return Verdict.no(
                f"rows of {row_bytes} bytes are not a multiple of 16 (128-bit peer stores need hidden "
                f"% {16 // problem.itemsize} == 0 for {problem.dtype}); pad the hidden dimension"
            )
        if problem.world_size > MAX_WORLD:
            return Verdict.no(f"world size {problem.world_size} exceeds {MAX_WORLD}")
        reason = f"peer access, rows of {row_bytes} bytes (16-byte multiple), input <= {MAX_INPUT_BYTES} bytes"
        if problem.quant is not None:
            reason += ("; quantized output in the peer kernel (by the epilogue after it when a program holds several "
                       f"items), {admission_reason(problem.quant, caps)}")
        return Verdict.yes(reason)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        from tpfuse.kernels.custom_ops import register_instance

        self.timeout_s = float(ctx.options.get("timeout_s") or env.spin_timeout_s())
        self.max_programs = int(ctx.options.get("max_programs") or self._default_programs())
        self._max_tokens = ctx.options.get("max_tokens")
        self.plan_programs = plan_programs(ctx.world_size, bool(ctx.facts.shares_device))
        self._workspaces: dict = {}
        self._fallback: Strategy | None = None
        self._prepare_tokens = 0
        self._compiled: set = set()  # kernel variants this process has compiled (see _precompile)
        self.handle = register_instance(self)

    def _default_programs(self) -> int:
        if self.ctx.device.type != "cuda":
            return 4
        sms = torch.cuda.get_device_properties(self.ctx.device).multi_processor_count
        sharing = self.ctx.world_size if self.ctx.facts.shares_device else 1
        return max(1, sms // sharing)

    def _launcher(self) -> Callable:
        raise NotImplementedError

    def _plan(self, num_tokens: int, hidden: int, dtype: torch.dtype):
        return make_plan(num_tokens, hidden, dtype.itemsize, self.plan_programs)

    def _need(self, num_tokens: int, hidden: int, dtype: torch.dtype) -> int:
        """Region elements a call of this shape needs (a pure function of the shape)."""
        plan = self._plan(num_tokens, hidden, dtype)
        return region_elems_for(num_tokens, hidden, self.ctx.world_size, plan, twoshot=self.extra_regions > 0)

    def _workspace(self, dtype: torch.dtype, num_tokens: int, hidden: int):
        """The workspace for `dtype` if this call fits it, else None (the call takes the unfused path).

        Created once, for every call of up to max(this call, the max_tokens option) tokens, before
        any capture.
        """
        from tpfuse.strategies.workspace import LamportWorkspace

        need = self._need(num_tokens, hidden, dtype)
        ws = self._workspaces.get(dtype)
        if ws is not None:
            return ws if ws.fits(need) else None
        if self.ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{self.name}: no workspace for {dtype} during CUDA graph capture; call "
                "Communicator.prepare(hidden=..., dtype=..., max_tokens=...) before capturing"
            )
        cap = MAX_INPUT_BYTES // dtype.itemsize // hidden  # admission caps one rank's input
        tokens = min(max(num_tokens, int(self._max_tokens or 0), self._prepare_tokens), max(cap, num_tokens))
        ws = LamportWorkspace(
            group=self.ctx.group, rank=self.ctx.rank, world_size=self.ctx.world_size, device=self.ctx.device,
            dtype=dtype, region_elems=max(self._need(t, hidden, dtype) for t in range(1, tokens + 1)),
            num_regions=self.ctx.world_size + self.extra_regions, timeout_s=self.timeout_s, where=self.name,
            shares_device=bool(self.ctx.facts.shares_device),
        )
        self._workspaces[dtype] = ws
        return ws

    def _unfused(self) -> Strategy:
        """The group's unfused path, for calls that do not fit the workspace."""
        if self._fallback is None:
            from tpfuse.strategies import get_strategy

            name = "nccl_epilogue" if self.ctx.facts.backend == "nccl" else "reference"
            self._fallback = get_strategy(name)(self.ctx)
        return self._fallback

    def prepare(self, *, hidden: int, dtype: torch.dtype, max_tokens: int) -> None:
        """Allocate the workspace for max_tokens x hidden and compile every kernel variant those calls use."""
        cap = max(1, MAX_INPUT_BYTES // dtype.itemsize // hidden)
        tokens = min(max_tokens, cap)  # admission caps one rank's input, so more tokens buy nothing
        self._prepare_tokens = tokens
        ws = self._workspaces.get(dtype) or self._workspace(dtype, 1, hidden)
        plans = {self._plan(m, hidden, dtype) for m in range(1, tokens + 1)}
        for plan in sorted(plans, key=lambda p: (p.chunk, p.num_chunks)):
            for has_res, has_norm in ((True, True), (False, True), (False, False)):
                self._precompile(ws, dtype, hidden, plan, has_res, has_norm)
        # the unfused path serves calls that do not fit: ready before any capture, like the kernels
        self._unfused().prepare(hidden=hidden, dtype=dtype, max_tokens=max_tokens)
        ws._barrier()  # every rank has compiled before any rank's first launch can start spinning

    def _precompile(self, ws, dtype, hidden, plan, has_res, has_norm, quant=None) -> None:
        """Compile a kernel variant without launching it (once per process and variant).

        prepare() follows it with a barrier: a rank that compiled faster would otherwise start
        spinning while a peer still compiles, and a cold compile takes a good part of a timeout.
        """
        variant = None if quant is None else (quant.kind, quant.group, quant.layout, quant.scale_ub is not None,
                                              quant.with_normed)
        key = (dtype, hidden, plan, has_res, has_norm, variant)
        if key in self._compiled:
            return
        x = torch.zeros(1, hidden, dtype=dtype, device=self.ctx.device)
        self._launcher()(x, x if has_res else None, x[0], 1e-6, ws, timeout_s=self.timeout_s,
                         max_programs=self.max_programs, plan_programs=self.plan_programs, has_norm=has_norm,
                         warmup=True, plan=plan, quant=quant)
        self._compiled.add(key)

    def _run(self, x, residual, weight, eps, has_norm, quant=None):
        m, h = x.shape
        ws = self._workspace(x.dtype, m, h)
        if ws is None:
            fallback = self._unfused()
            if has_norm:
                return fallback.all_reduce_residual_rmsnorm(x, residual, weight, eps, quant=quant)
            return fallback.all_reduce(x), None
        plan = self._plan(m, h, x.dtype)
        if quant is not None and not self._quantizes_in_kernel(plan, quant):
            return self._quantize_after(x, residual, weight, eps, quant)
        ws.before_call()
        capturing = self.ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:
            # A variant prepare() did not compile: compile it before launching, so this rank's
            # spin deadline starts after its own compile. No barrier here (a rank that never calls
            # must produce a bounded timeout, not a blocked host); prepare() is the way to have
            # every rank compiled before the first launch.
            self._precompile(ws, x.dtype, h, plan, residual is not None, has_norm, quant)
        out = self._launcher()(x, residual, weight, eps, ws, timeout_s=self.timeout_s, max_programs=self.max_programs,
                               plan_programs=self.plan_programs, has_norm=has_norm, plan=plan, quant=quant)
        ws.after_call()
        return out

    def _quantizes_in_kernel(self, plan, quant) -> bool:
        """Quantize inside the peer kernel when its programs hold one item each (decode sizes);
        larger calls quantize in the epilogue after the peer allreduce. Measured with W ranks
        emulated on one H200 (benchmarks/results/peer_kernels_emulated.jsonl, `quant` rows): at
        1 token the kernel's own FP8 quantization saves 1.4-2.4 us against the two kernels (NVFP4,
        whose e2m1 conversion is software on SM90, loses 0.1-0.5 us), while at 64 tokens a
        program that quantizes item after item (per-token FP8: a second pass for the row's
        absmax) cost up to 1.34x the two kernels. A pure function of the shape and agreed
        group facts, so every rank takes the same path."""
        return quantizes_in_kernel(plan, quant) and plan.items <= self.plan_programs

    def _quantize_after(self, x, residual, weight, eps, quant):
        """Two kernels: the peer allreduce, then the epilogue that adds, normalises and quantizes in
        registers (the kernel and bits of `nccl_epilogue`'s, from this strategy's rank-ordered sum)."""
        from tpfuse.kernels.epilogue import residual_rmsnorm

        s = self._run(x, None, None, 0.0, has_norm=False)[0]
        return residual_rmsnorm(s, residual, weight, eps, quant=quant)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None, None, 0.0, has_norm=False)[0]

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps, *, quant=None):
        """(normed, new_residual); with `quant`, a QuantOutput quantized inside the peer kernel."""
        return self._run(x, residual, weight, eps, has_norm=True, quant=quant)

    def check(self) -> None:
        """Synchronise and raise PeerTimeoutError if any call of this strategy timed out (use after graph replays)."""
        for ws in self._workspaces.values():
            ws.check()

    def close(self) -> None:
        from tpfuse.kernels.custom_ops import unregister_instance

        for ws in self._workspaces.values():
            ws.close()
        self._workspaces.clear()
        if self._fallback is not None:
            self._fallback.close()
        unregister_instance(self.handle)


class OneShotStrategy(PeerStrategy):
    name = "oneshot"
    description = "one-shot allreduce + residual + RMSNorm in one Triton kernel over CUDA IPC peer buffers (Lamport)"

    def _launcher(self):
        from tpfuse.kernels.oneshot import oneshot_launch

        return oneshot_launch

