"""The `oneshot` strategy: every rank reads every peer's rows and applies the epilogue, in one kernel.

Collective and epilogue are one Triton kernel (`fusegate.kernels.oneshot`) over peer buffers
mapped through CUDA IPC (`fusegate.backends.workspace`, Lamport protocol): lowest latency at
decode sizes, W x the bytes of the input over the fabric. `PeerStrategy` here is also the base of
`twoshot`.

Options (Communicator keyword options): `timeout_s` (spin bound, default FUSEGATE_TIMEOUT_S),
`max_tokens` (workspace sizing when prepare() was not called), `max_programs` (grid cap; default
the GPU's SM count, divided by the number of ranks sharing that GPU so that all ranks' programs
can be resident together).

Workspace lifetime: allocated in prepare() (before graph capture) for that (hidden, dtype,
max_tokens); an eager call that does not fit grows it (a collective: all ranks make the same call,
so all grow alike); growing during graph capture raises. One workspace per dtype. Timeouts raise
PeerTimeoutError on the next eager call, or from `check()` (which synchronises).
"""

from __future__ import annotations

import importlib.util
from typing import Callable, ClassVar

import torch

from fusegate import env
from fusegate.backends.base import Strategy
from fusegate.spec import Needs, Problem, Verdict

MAX_HIDDEN = 16384  # fusegate.kernels.epilogue.MAX_HIDDEN (not imported: admission needs no Triton)
MAX_WORLD = 16  # the timeout record is a 31-bit peer mask; W is a compile-time constant
# Per-rank input cap: TensorRT-LLM's custom allreduce workspace limit for TP <= 2 (16 MB,
# customAllReduceUtils.h); the one-shot workspace is 3 x W x this per rank.
MAX_INPUT_BYTES = 16 * 1024 * 1024
FUSED_DTYPES = ("float16", "bfloat16", "float32")


class PeerStrategy(Strategy):
    """Common part of the peer-buffer strategies: admission, workspace, launch, errors."""

    fused = True
    needs = Needs(cuda=True, peer_access=True, single_host=True, dtypes=FUSED_DTYPES, max_input_bytes=MAX_INPUT_BYTES)
    extra_regions: ClassVar[int] = 0  # regions per slot beyond one per rank (twoshot: the gather region)

    @classmethod
    def extra_admits(cls, problem: Problem, caps) -> Verdict:
        row_bytes = problem.hidden * problem.itemsize
        if importlib.util.find_spec("triton") is None:
            return Verdict.no("needs the 'triton' package (pip install 'fusegate[triton]')")
        if problem.hidden > MAX_HIDDEN:
            return Verdict.no(f"hidden size {problem.hidden} exceeds {MAX_HIDDEN} (one row per program in registers)")
        if row_bytes % 16:
            return Verdict.no(
                f"rows of {row_bytes} bytes are not a multiple of 16 (128-bit peer stores need hidden "
                f"% {16 // problem.itemsize} == 0 for {problem.dtype}); pad the hidden dimension"
            )
        if problem.world_size > MAX_WORLD:
            return Verdict.no(f"world size {problem.world_size} exceeds {MAX_WORLD}")
        return Verdict.yes(f"peer access, rows of {row_bytes} bytes (16-byte multiple), input <= {MAX_INPUT_BYTES} bytes")

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        from fusegate.kernels.custom_ops import register_instance

        self.timeout_s = float(ctx.options.get("timeout_s") or env.spin_timeout_s())
        self.max_programs = int(ctx.options.get("max_programs") or self._default_programs())
        self._max_tokens = ctx.options.get("max_tokens")
        self._workspaces: dict = {}
        self._compiled: set = set()  # kernel variants this process has compiled (see _precompile)
        self.handle = register_instance(self)

    def _default_programs(self) -> int:
        if self.ctx.device.type != "cuda":
            return 4
        sms = torch.cuda.get_device_properties(self.ctx.device).multi_processor_count
        sharing = self.ctx.world_size if getattr(self.ctx.problem_group, "shares_device", False) else 1
        return max(1, sms // sharing)

    def _launcher(self) -> Callable:
        raise NotImplementedError

    def _workspace(self, dtype: torch.dtype, elems: int, *, size: int = 0):
        """The workspace for `dtype`, (re)allocated to max(elems, size) elements if `elems` do not fit."""
        from fusegate.backends.workspace import LamportWorkspace

        ws = self._workspaces.get(dtype)
        if ws is not None and ws.fits(elems):
            return ws
        if self.ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{self.name}: a call of {elems} elements does not fit the workspace during CUDA graph "
                "capture; call Communicator.prepare(hidden=..., dtype=..., max_tokens=...) before capturing"
            )
        if ws is not None:
            ws.close()
        ws = LamportWorkspace(
            group=self.ctx.group, rank=self.ctx.rank, world_size=self.ctx.world_size, device=self.ctx.device,
            dtype=dtype, region_elems=max(elems, size), num_regions=self.ctx.world_size + self.extra_regions,
            timeout_s=self.timeout_s, where=self.name,
            shares_device=bool(getattr(self.ctx.problem_group, "shares_device", False)),
        )
        self._workspaces[dtype] = ws
        return ws

    def prepare(self, *, hidden: int, dtype: torch.dtype, max_tokens: int) -> None:
        """Allocate the workspace for max_tokens x hidden and compile every kernel variant."""
        # Admission caps one rank's input at MAX_INPUT_BYTES, so a larger max_tokens buys nothing.
        ws = self._workspace(dtype, min(max_tokens * hidden, MAX_INPUT_BYTES // dtype.itemsize))
        for has_res, has_norm in ((True, True), (False, True), (False, False)):
            self._precompile(ws, dtype, hidden, has_res, has_norm)
        ws._barrier()  # every rank has compiled before any rank's first launch can start spinning

    def _precompile(self, ws, dtype, hidden, has_res, has_norm) -> None:
        """Compile a kernel variant without launching it (once per process and variant).

        prepare() follows it with a barrier: a rank that compiled faster would otherwise start
        spinning while a peer still compiles, and a cold compile takes a good part of a timeout.
        """
        key = (dtype, hidden, has_res, has_norm)
        if key in self._compiled:
            return
        x = torch.zeros(1, hidden, dtype=dtype, device=self.ctx.device)
        self._launcher()(x, x if has_res else None, x[0], 1e-6, ws, timeout_s=self.timeout_s,
                         max_programs=self.max_programs, has_norm=has_norm, warmup=True)
        self._compiled.add(key)

    def _run(self, x, residual, weight, eps, has_norm):
        m, h = x.shape
        size = min(max(m, int(self._max_tokens or 0)) * h, MAX_INPUT_BYTES // x.element_size())
        ws = self._workspace(x.dtype, m * h, size=size)
        ws.before_call()
        capturing = self.ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:
            # A variant prepare() did not compile: compile it before launching, so this rank's
            # spin deadline starts after its own compile. No barrier here (a rank that never calls
            # must produce a bounded timeout, not a blocked host); prepare() is the way to have
            # every rank compiled before the first launch.
            self._precompile(ws, x.dtype, h, residual is not None, has_norm)
        out = self._launcher()(x, residual, weight, eps, ws, timeout_s=self.timeout_s,
                               max_programs=self.max_programs, has_norm=has_norm)
        ws.after_call()
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None, None, 0.0, has_norm=False)[0]

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps):
        return self._run(x, residual, weight, eps, has_norm=True)

    def check(self) -> None:
        """Synchronise and raise PeerTimeoutError if any call of this strategy timed out (use after graph replays)."""
        for ws in self._workspaces.values():
            ws.check()

    def close(self) -> None:
        from fusegate.kernels.custom_ops import unregister_instance

        for ws in self._workspaces.values():
            ws.close()
        self._workspaces.clear()
        unregister_instance(self.handle)


class OneShotStrategy(PeerStrategy):
    name = "oneshot"
    description = "one-shot allreduce + residual + RMSNorm in one Triton kernel over CUDA IPC peer buffers (Lamport)"

    def _launcher(self):
        from fusegate.kernels.oneshot import oneshot_launch

        return oneshot_launch

