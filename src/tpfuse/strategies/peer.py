"""`PeerStrategy`: what the peer-buffer strategies (`oneshot`, `twoshot`) share: admission, the
workspace, one cached route per call shape, errors.

Collective and epilogue are one Triton kernel (`tpfuse.kernels.oneshot` or `tpfuse.kernels.twoshot`)
over peer buffers mapped through CUDA IPC (`tpfuse.strategies.workspace`, Lamport protocol).

Options (Communicator keyword options): `timeout_s` (spin bound, default TPFUSE_TIMEOUT_S),
`max_tokens` (workspace sizing when prepare() was not called), `max_programs` (grid cap; default
the GPU's SM count, divided by the number of ranks sharing that GPU so that all ranks' programs
can be resident together), `pdl` (programmatic dependent launch: "auto", the default, triggers the
next launch at a kernel's entry when every rank has its own GPU and at its end when ranks share
one (an entry trigger deadlocks there: early-launched programs of fast ranks take the SMs a slower
rank still needs); "end", "early" (refused when ranks share a GPU) and "off" force one), `spin`
(per-thread spins in inline assembly: 0 none, 1 the data polls, 2 also the norm partials' waits
and two-shot's row words, 3 also a wait on every source's tag at once before a one-shot decode
poll loads the data, 4, the default, instead a poll of every source at once in one-shot's decode
and in two-shot's chunk-owner reduce)
and `cooperative` (cooperative launch, the driver then refuses a grid that cannot be resident;
default False). Launch options change the speed, never the bits.

Workspace lifetime: allocated once, in prepare() (before graph capture) for that (hidden, dtype,
max_tokens), or by the first eager call. It is never reallocated: a later call that does not fit
(decided from the shape alone, so identically on every rank) is served by the unfused path of the
group (`nccl_epilogue` on NCCL groups, `reference` otherwise), which is also safe inside a CUDA graph
that was captured on the workspace. One workspace per dtype; calls from several streams are
ordered one after another (`LamportWorkspace._bind_stream`). Failures raise PeerTimeoutError
on an eager call once the failed kernel has recorded them, or from `check()` (which synchronises).

Per call shape (tokens, hidden, dtype, residual, norm, quantized format) the route is decided once
and cached: a `tpfuse.kernels.peer_launch.PeerLaunch` (plan, grid, bundles, pre-bound launch), the
unfused path, or the peer allreduce then the quantizing epilogue. A steady-state call reads the
host-mapped error words, allocates its outputs and launches one kernel.

Quantized output (`quant=`, every format of `tpfuse.quant`) is written by the peer kernel itself
(`tpfuse.kernels.quant.quantize_chunk` per chunk; a row split over programs exchanges its absmax for
per-token FP8 as it does its sum of squares), bit for bit the reference quantizer of the kernel's
fp32 rows, where `_quantizes_in_kernel` says so; otherwise two kernels: the peer allreduce, then the
quantizing epilogue. Run one quantized call eagerly before graph capture: prepare() does not compile
that variant.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from typing import ClassVar

import torch

from tpfuse import env
from tpfuse._version import extra_hint
from tpfuse.kernels.protocol import (
    MAX_GRID,
    MAX_HIDDEN,
    MAX_INPUT_BYTES,
    MAX_WORLD,
    make_plan,
    plan_programs,
    quantizes_in_kernel,
    region_elems_for,
    tag_words_for,
    twoshot_owns_rows,
    twoshot_plan,
)
from tpfuse.quant import KINDS, admission_reason
from tpfuse.spec import Needs, Op, Problem, Verdict
from tpfuse.strategies.base import Strategy

FUSED_DTYPES = ("float16", "bfloat16", "float32")
PDL_MODES = {"off": 0, "end": 1, "early": 2}
# The kernel forms (residual, norm) an op's calls take.
FORMS_OF = {Op.ALL_REDUCE_RESIDUAL_RMSNORM: ((True, True), (False, True)), Op.ALL_REDUCE: ((False, False),)}
ALL_FORMS = FORMS_OF[Op.ALL_REDUCE_RESIDUAL_RMSNORM] + FORMS_OF[Op.ALL_REDUCE]


class PeerStrategy(Strategy):
    """Common part of the peer-buffer strategies; a subclass names its kernel (`_kernel`)."""

    fused = True
    needs = Needs(cuda=True, peer_access=True, single_host=True, dtypes=FUSED_DTYPES, max_input_bytes=MAX_INPUT_BYTES,
                  quant=KINDS)
    twoshot: ClassVar[bool] = False  # two-shot: one gather region per slot beyond one per rank

    @classmethod
    def extra_admits(cls, problem: Problem, caps) -> Verdict:
        row_bytes = problem.hidden * problem.itemsize
        if importlib.util.find_spec("triton") is None:
            return Verdict.no(f"needs the 'triton' package ({extra_hint('triton')})")
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
        from tpfuse.kernels.peer_launch import LaunchOptions

        self.timeout_s = float(ctx.options.get("timeout_s") or env.spin_timeout_s())
        shares = bool(ctx.facts.shares_device)
        self.ranks_per_device = max(Counter(ctx.facts.devices).values()) if shares and ctx.facts.devices else (
            ctx.world_size if shares else 1)
        self.max_programs = min(int(ctx.options.get("max_programs") or self._default_programs()), MAX_GRID)
        self._max_tokens = ctx.options.get("max_tokens")
        self.plan_programs = plan_programs(ctx.world_size, shares)
        self.launch_options = LaunchOptions(pdl=self._pdl_mode(ctx.options.get("pdl", "auto"), shares),
                                            spin=int(ctx.options.get("spin", 4)),
                                            cooperative=bool(ctx.options.get("cooperative", False)))
        self._workspaces: dict = {}
        self._routes: dict = {}
        self._fallback: Strategy | None = None
        self._prepare_tokens = 0
        self._unfused_prepared: set[tuple] = set()
        self.handle = register_instance(self)

    def _pdl_mode(self, value, shares: bool) -> int:
        if value == "auto":
            return PDL_MODES["end" if shares else "early"]
        if value not in PDL_MODES:
            raise ValueError(f"{self.name}: pdl={value!r} is not one of 'auto', {', '.join(map(repr, PDL_MODES))}; "
                             "use pdl='auto'")
        if value == "early" and shares:
            raise ValueError(f"{self.name}: pdl='early' deadlocks when ranks share a GPU (early-launched programs of "
                             "fast ranks take the SMs a slower rank still needs); use pdl='auto' or 'end'")
        return PDL_MODES[value]

    def _default_programs(self) -> int:
        if self.ctx.device.type != "cuda":
            return 4
        from tpfuse.kernels.device import sm_count

        return max(1, sm_count(self.ctx.device) // self.ranks_per_device)

    def _kernel(self):
        raise NotImplementedError

    def _plan(self, num_tokens: int, hidden: int, dtype: torch.dtype):
        if self.twoshot:
            return twoshot_plan(num_tokens, hidden, dtype.itemsize, self.plan_programs, self.ctx.world_size)
        return make_plan(num_tokens, hidden, dtype.itemsize, self.plan_programs)

    def _need(self, num_tokens: int, hidden: int, dtype: torch.dtype) -> tuple[int, int]:
        """(region elements, tag words) a call of this shape needs (a pure function of the shape)."""
        plan = self._plan(num_tokens, hidden, dtype)
        return (region_elems_for(num_tokens, hidden, self.ctx.world_size, plan, twoshot=self.twoshot),
                tag_words_for(plan, num_tokens))

    def _workspace(self, dtype: torch.dtype, num_tokens: int, hidden: int):
        """The workspace for `dtype` if this call fits it, else None (the call takes the unfused path).

        Created once, for every call of up to max(this call, the max_tokens option) tokens, before
        any capture.
        """
        from tpfuse.strategies.workspace import LamportWorkspace

        need, tags = self._need(num_tokens, hidden, dtype)
        ws = self._workspaces.get(dtype)
        if ws is not None:
            return ws if ws.fits(need, tags) else None
        if self.ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{self.name}: no workspace for {dtype} during CUDA graph capture; call "
                "Communicator.prepare(hidden=..., dtype=..., max_tokens=...) before capturing"
            )
        cap = MAX_INPUT_BYTES // dtype.itemsize // hidden  # admission caps one rank's input
        tokens = min(max(num_tokens, int(self._max_tokens or 0), self._prepare_tokens), max(cap, num_tokens))
        needs = [self._need(t, hidden, dtype) for t in range(1, tokens + 1)]
        ws = LamportWorkspace(
            group=self.ctx.group, rank=self.ctx.rank, world_size=self.ctx.world_size, device=self.ctx.device,
            dtype=dtype, region_elems=max(n for n, _ in needs), num_regions=self.ctx.world_size + int(self.twoshot),
            tag_words=max(t for _, t in needs), timeout_s=self.timeout_s, where=self.name,
            ranks_per_device=self.ranks_per_device,
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
        self._prepare(hidden, dtype, max_tokens, None, ALL_FORMS)

    def prepare_buckets(self, *, hidden: int, dtype: torch.dtype, max_tokens: int, buckets: tuple[int, ...],
                        op: Op | None = None) -> None:
        """The workspace as prepare(max_tokens) allocates it; the kernel variants of the `buckets`'
        token counts only (compiled together, concurrently), and of `op`'s forms only when given
        (the fused op with and without a residual; all_reduce)."""
        self._prepare(hidden, dtype, max_tokens, buckets, ALL_FORMS if op is None else FORMS_OF[op])

    def _prepare(self, hidden: int, dtype: torch.dtype, max_tokens: int, only: tuple[int, ...] | None,
                 forms) -> None:
        cap = max(1, MAX_INPUT_BYTES // dtype.itemsize // hidden)
        tokens = min(max_tokens, cap)  # admission caps one rank's input, so more tokens buy nothing
        self._prepare_tokens = tokens
        ws = self._workspaces.get(dtype) or self._workspace(dtype, 1, hidden)
        variants = {}
        counts = range(1, tokens + 1) if only is None else sorted({m for m in only if m <= tokens})
        for m in counts:
            for has_res, has_norm in forms:
                route = self._route(ws, m, hidden, dtype, has_res, has_norm, None, compile_now=False)
                launch = getattr(route, "launch", None)
                if launch is not None:
                    variants.setdefault((launch.C, launch.Q, launch.plan.num_warps), launch)
        from tpfuse.kernels.peer_launch import compile_all

        compile_all(list(variants.values()))
        # the unfused path serves calls that do not fit: ready before any capture, like the kernels
        if (hidden, dtype, max_tokens) not in self._unfused_prepared:
            self._unfused().prepare(hidden=hidden, dtype=dtype, max_tokens=max_tokens)
            self._unfused_prepared.add((hidden, dtype, max_tokens))
        ws._barrier()  # every rank has compiled before any rank's first launch can start spinning

    def _route(self, ws, m: int, h: int, dtype, has_res: bool, has_norm: bool, quant, *, compile_now: bool):
        """The cached way calls of this shape are served (see the module docstring)."""
        key = (m, h, dtype, has_res, has_norm, None if quant is None else quant.key)
        route = self._routes.get(key)
        if route is not None:
            return route
        if ws is None:
            route = _Unfused(self._unfused(), has_norm)
        else:
            plan = self._plan(m, h, dtype)
            if quant is not None and not self._quantizes_in_kernel(plan, quant, m):
                route = _QuantizeAfter(self)
            else:
                from tpfuse.kernels.peer_launch import PeerLaunch

                launch = PeerLaunch(self._kernel(), self.name, ws, m, h, dtype, has_res=has_res, has_norm=has_norm,
                                    quant=quant, plan=plan, max_programs=self.max_programs, timeout_s=self.timeout_s,
                                    twoshot=self.twoshot, options=self.launch_options)
                if compile_now and not (self.ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                    # A variant prepare() did not compile: compile it before launching, so this rank's
                    # spin deadline starts after its own compile. No barrier here (a rank that never
                    # calls must produce a bounded timeout, not a blocked host); prepare() is the way
                    # to have every rank compiled before the first launch.
                    launch.compile()
                route = _Fused(ws, launch)
        self._routes[key] = route
        return route

    def _run(self, x, residual, weight, eps, has_norm, quant=None):
        m, h = x.shape
        key = (m, h, x.dtype, residual is not None, has_norm, None if quant is None else quant.key)
        route = self._routes.get(key)
        if route is None:
            ws = self._workspace(x.dtype, m, h)
            route = self._route(ws, m, h, x.dtype, residual is not None, has_norm, quant, compile_now=True)
        return route(x, residual, weight, eps, quant)

    def _quantizes_in_kernel(self, plan, quant, num_tokens: int) -> bool:
        """Quantize inside the peer kernel when its programs hold one item each (decode sizes), and
        for two-shot only with chunk owners; otherwise the epilogue quantizes after the peer
        allreduce. Measured with 8 ranks emulated on one H200: two kernels cost +3.1 us over the
        unquantized call at one token even for static FP8, the cheapest format
        (benchmarks/results/peer_kernels_v3_emulated.jsonl, `quant` rows), while the kernel's own
        quantization costs +0.15-0.41 us for every format, NVFP4's software e2m1 included
        (peer_kernels_v3_nvfp4_padding_h200_emulated.jsonl); a program that quantizes item after
        item (per-token FP8 at 16 tokens, measured when its row absmax took a second pass) was no
        faster than two kernels. A pure function of the shape and agreed group facts, so every rank
        takes the same path."""
        if self.twoshot and twoshot_owns_rows(num_tokens, self.ctx.world_size, plan.programs):
            return False
        return quantizes_in_kernel(plan, quant) and plan.items <= self.plan_programs

    def _quantize_after(self, x, residual, weight, eps, quant):
        """Two kernels: the peer allreduce, then the epilogue that adds, normalises and quantizes in
        registers (the kernel and bits of `nccl_epilogue`'s, from this strategy's rank-ordered sum)."""
        from tpfuse.kernels.epilogue import residual_rmsnorm

        s = self._run(x, None, None, 0.0, has_norm=False)[0]
        return residual_rmsnorm(s, residual, weight, eps, quant=quant)

    def fused_route(self, num_tokens: int, hidden: int, dtype: torch.dtype, *, has_residual: bool):
        """The cached route of unquantized fused calls of this shape (made now, as a first call makes it)."""
        ws = self._workspace(dtype, num_tokens, hidden)
        return self._route(ws, num_tokens, hidden, dtype, has_residual, True, None, compile_now=True)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None, None, 0.0, has_norm=False)[0]

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps, *, quant=None):
        """(normed, new_residual); with `quant`, a QuantOutput quantized inside the peer kernel."""
        return self._run(x, residual, weight, eps, has_norm=True, quant=quant)

    def check(self) -> None:
        """Synchronise and raise PeerTimeoutError if any call of this strategy failed (use after graph replays)."""
        for ws in self._workspaces.values():
            ws.check()

    def close(self) -> None:
        from tpfuse.kernels.custom_ops import unregister_instance

        for ws in self._workspaces.values():
            ws.close()
        self._workspaces.clear()
        self._routes.clear()
        if self._fallback is not None:
            self._fallback.close()
        unregister_instance(self.handle)


class _Fused:
    """A route through the peer kernel: check the error words, then one launch."""

    __slots__ = ("ws", "launch")

    def __init__(self, ws, launch) -> None:
        self.ws, self.launch = ws, launch

    def __call__(self, x, residual, weight, eps, quant=None):
        self.ws.before_call()
        return self.launch(x, residual, weight, eps, quant=quant)


class _Unfused:
    """A route through the group's unfused path (calls that do not fit the workspace)."""

    __slots__ = ("strategy", "has_norm")

    def __init__(self, strategy: Strategy, has_norm: bool) -> None:
        self.strategy, self.has_norm = strategy, has_norm

    def __call__(self, x, residual, weight, eps, quant=None):
        if self.has_norm:
            return self.strategy.all_reduce_residual_rmsnorm(x, residual, weight, eps, quant=quant)
        return self.strategy.all_reduce(x), None


class _QuantizeAfter:
    """A route through the peer allreduce, then the quantizing epilogue."""

    __slots__ = ("strategy",)

    def __init__(self, strategy: PeerStrategy) -> None:
        self.strategy = strategy

    def __call__(self, x, residual, weight, eps, quant=None):
        return self.strategy._quantize_after(x, residual, weight, eps, quant)
