"""The host side both peer kernels share: one `PeerLaunch` per call shape, built once and then
reused by every call of that shape.

A `PeerLaunch` holds what depends only on (kernel, tokens, hidden, dtype, residual or not, norm
or not, quantized-output format, workspace): the work plan, the checks that the call fits the
workspace, the compile-time bundles (`PeerConfig`, `QuantOpts`), the grid and launch options, the
workspace's pointer arguments, and a pre-bound launch of the compiled variant
(`tpfuse.kernels.launcher.bind`). A call then allocates its outputs and launches: nothing on the
host that scales with the arguments beyond that.

Launch options (`LaunchOptions`): programmatic dependent launch (`pdl`: 0 off, 1 with the
trigger at the kernel's end, 2 with the trigger at entry: the next call's programs are launched
while this one runs and wait in `griddepcontrol.wait`), the per-thread spins in inline assembly
(`spin`: 1 for the data polls, 2 for the norm partials' waits and two-shot's row words as well,
3 also a wait on every source's tag at once before a one-shot decode poll loads the data, 4 instead
a per-thread poll of every source's vector at once there)
and cooperative launch (`cooperative`). Co-residency: the partials' waits need all programs of a
launch resident together, and a rank's waits need its peers' programs resident too when ranks
share a GPU, so the first launch of a shape checks the compiled kernel's occupancy against the
grid of every rank on the GPU (twice over with an entry trigger, which keeps two launches per
rank resident), falls back from an entry trigger to the end one where two do not fit, and raises
where one does not. With `cooperative` the driver also refuses a grid that cannot be resident.

`ws` (the workspace) provides peers.views (W 1-D tensors), peers.local, state, err, errmap,
partials, region_elems, header_elems, tag_words, sentinel, rank and ranks_per_device
(`tpfuse.strategies.workspace.LamportWorkspace`, or the emulated workspaces of
benchmarks/bench_peer_kernels.py).
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels.device import hardware_fp4, hardware_fp8, interpreting, sm_count
from tpfuse.kernels.launcher import bind
from tpfuse.kernels.peer_stages import PeerConfig, QuantOpts
from tpfuse.kernels.protocol import (
    MAX_GRID,
    MAX_HIDDEN,
    Plan,
    partials_needed,
    quantizes_in_kernel,
    region_elems_for,
    tag_words_for,
    twoshot_owns_rows,
)
from tpfuse.kernels.quant import KIND_BY_NAME, QuantBuffers, hw_bits
from tpfuse.quant import QuantOutput

# Interpreter spin bound per second of timeout: the interpreter polls at a CPU core's pace, on the
# order of a poll per millisecond, not a GPU's; tests/strategies/test_peer.py's timeout test checks
# that a wait on a missing peer ends within its timeout under the interpreter.
INTERPRETER_SPINS_PER_S = 1_000
# Items a two-shot receiver polls at once with whole-row owners: enough loads in flight to cover
# a read's latency (four 4 KB chunks a program), few enough registers to stay resident.
TWOSHOT_PER_POLL = 4
# Items a two-shot program with whole-row owners scatters per step (their loads issued together,
# then their pushes). W ranks emulated on one H200 (benchmarks/results/peer_kernels_v3_scatter_emulated.jsonl),
# 256 tokens x 6144, 1 / 4 / 8 items a step: W = 8 125.3 / 119.0 / 115.4 us, W = 4 74.9 / 70.6 / 69.4,
# W = 2 37.4 / 36.5 / 36.9. Chunk owners scatter one item a step: 4 were slower at 16 tokens (W = 8
# 10.97 -> 11.69) and within 0.5 us either way at 64.
TWOSHOT_PER_PUSH = 8
# Compiles `compile_all` runs at once at most (each one thread of the compiler and one assembler process).
MAX_COMPILE_THREADS = 8
# Hopper and Ampere SM limits, for the occupancy check where torch does not report them.
DEFAULT_REGS_PER_SM, DEFAULT_THREADS_PER_SM, DEFAULT_BLOCKS_PER_SM = 65536, 2048, 32


@dataclass(frozen=True)
class LaunchOptions:
    """How a peer kernel is launched (see the module docstring); identical bits whatever they are."""

    pdl: int = 0
    spin: int = 0  # 0: block-wide polls; 1: data polls spin per thread; 2: partial waits and row words too;
    # 3: one-shot decode polls wait on all tags at once first; 4: one-shot decode polls and two-shot
    # chunk owners' reduce poll every source at once instead
    cooperative: bool = False

    def __post_init__(self) -> None:
        if self.pdl not in (0, 1, 2):
            raise ValueError(f"LaunchOptions: pdl={self.pdl!r} is not 0 (off), 1 (trigger at the end) or 2 (at entry)")
        if self.spin not in (0, 1, 2, 3, 4):
            raise ValueError(f"LaunchOptions: spin={self.spin!r} is not 0, 1, 2, 3 or 4 (see LaunchOptions.spin)")


def spin_bounds(timeout_s: float) -> tuple[int, int]:
    """(timeout in ns for GPUs, spin count for the interpreter) of one wait."""
    return int(timeout_s * 1e9), max(1, int(timeout_s * INTERPRETER_SPINS_PER_S))


def check_fits(where: str, m: int, h: int, ws, plan: Plan, *, twoshot: bool, quant=None, rows: bool = False) -> None:
    if h > MAX_HIDDEN:
        raise ValueError(f"{where}: hidden size {h} exceeds {MAX_HIDDEN}; use strategy='nccl_epilogue'")
    need = region_elems_for(m, h, len(ws.peers.views), plan, twoshot=twoshot)
    if (need > ws.region_elems or tag_words_for(plan, m) > ws.tag_words
            or (plan.split and partials_needed(plan, quant) > ws.partials.numel())):
        raise ValueError(f"{where}: {m}x{h} elements exceed the workspace region of {ws.region_elems}; "
                         "call prepare() with a larger max_tokens")
    if quant is not None and not quantizes_in_kernel(plan, quant):
        raise ValueError(f"{where}: chunks of {plan.chunk} elements do not hold whole {quant.kind} scale blocks; "
                         "quantize after the allreduce (tpfuse.kernels.epilogue.residual_rmsnorm)")
    if quant is not None and rows:
        raise ValueError(f"{where}: two-shot with whole-row owners ({m} tokens, {len(ws.peers.views)} ranks) does "
                         "not quantize in the kernel; quantize after the allreduce "
                         "(tpfuse.kernels.epilogue.residual_rmsnorm)")


def quant_opts(device, quant) -> QuantOpts:
    if quant is None:
        return QuantOpts.of()
    hw = hw_bits(hardware_fp8(device), hardware_fp4(device))
    return QuantOpts.of(kind=KIND_BY_NAME[quant.kind], group=quant.group or 16, swizzled=quant.layout == "swizzled",
                     has_ub=quant.scale_ub is not None, hw=hw, with_normed=quant.with_normed)


def peer_config(m: int, ws, plan: Plan, grid: int, *, itemsize: int, has_res: bool, has_norm: bool, twoshot: bool,
                rows: bool, options: LaunchOptions, quantized: bool, per_push: int | None = None) -> PeerConfig:
    world = len(ws.peers.views)
    several = -(-plan.items // grid) > 1  # a program holds more than one item
    if per_push is None:
        per_push = TWOSHOT_PER_PUSH if rows and several else 1  # chunk owners ignore it
    if per_push < 1 or per_push & (per_push - 1):
        raise ValueError(f"per_push={per_push!r}: the items a two-shot program scatters per step must be a power of "
                         "two (1, 2, 4, ...); pass None for the default")
    gpu = not interpreting()
    return PeerConfig.of(
        world=world, world_p2=triton.next_power_of_2(world), chunk=plan.chunk, num_chunks=plan.num_chunks,
        num_chunks_p2=triton.next_power_of_2(plan.num_chunks), sentinel=ws.sentinel, elem_bits=8 * itemsize,
        has_res=has_res, has_norm=has_norm, split=has_norm and plan.split and not rows, use_asm=gpu,
        soft_bf16=not gpu, pdl=options.pdl if gpu else 0, spin=int(options.spin) if gpu else 0,
        single=not twoshot and plan.items <= grid, rows_owned=rows,
        per_poll=TWOSHOT_PER_POLL if rows and not quantized and several else 1, per_push=per_push)


def grid_for(plan: Plan, max_programs: int) -> int:
    programs = max(1, min(plan.items, max_programs, MAX_GRID))
    if interpreting() and plan.split:
        programs = 1  # the interpreter runs programs one after another: one program owns every row
    return programs


class PeerLaunch:
    """One call shape of one peer kernel on one workspace (see the module docstring).

    `__call__(x, residual, weight, eps, out=None, quant=None)` runs one call on the current stream
    and returns (out, new_residual) (new_residual None without norm), or a QuantOutput with
    `quant` (its format must be the one this launch was built for; its scale tensors are data).
    `owns_rows` forces two-shot's cut (None: `twoshot_owns_rows`; benchmarks force one to compare),
    `per_push` the items a program of two-shot's whole-row owners scatters per step (None:
    TWOSHOT_PER_PUSH where a program holds several items; a power of two; chunk owners scatter one
    item a step whatever it is; the bits do not depend on it).
    `out=(out, new_residual)` writes into given buffers (with `quant`: out is the unquantized
    normed output the spec asks for). `compile()` compiles the variant without launching.
    """

    def __init__(self, kernel, where: str, ws, num_tokens: int, hidden: int, dtype: torch.dtype, *, has_res: bool,
                 has_norm: bool, quant, plan: Plan, max_programs: int, timeout_s: float, twoshot: bool,
                 options: LaunchOptions = LaunchOptions(), owns_rows: bool | None = None,
                 per_push: int | None = None) -> None:
        rows = twoshot and (twoshot_owns_rows(num_tokens, len(ws.peers.views), plan.programs) if owns_rows is None
                            else owns_rows)
        check_fits(where, num_tokens, hidden, ws, plan, twoshot=twoshot, quant=quant, rows=rows)
        self.kernel, self.where, self.ws, self.plan = kernel, where, ws, plan
        self.num_tokens, self.hidden, self.dtype, self.has_norm, self.quant = num_tokens, hidden, dtype, has_norm, quant
        self.grid = (grid_for(plan, max_programs),)
        device = ws.peers.local.device
        self.device = device
        self.Q = quant_opts(device, quant)
        self.options = options
        self.C = peer_config(num_tokens, ws, plan, self.grid[0], itemsize=dtype.itemsize, has_res=has_res,
                             has_norm=has_norm, twoshot=twoshot, rows=rows, options=options,
                             quantized=quant is not None, per_push=per_push)
        timeout_ns, max_spins = spin_bounds(timeout_s)
        self._workspace_args = (tuple(ws.peers.views), ws.peers.local, ws.partials, ws.state, ws.err, ws.errmap)
        self._shape_args = (ws.rank, num_tokens, hidden, ws.region_elems, ws.header_elems, ws.tag_words)
        self._wait_args = (timeout_ns, max_spins)
        self._launch = None
        self._checked = False

    def meta(self) -> dict:
        meta = dict(C=self.C, Q=self.Q, num_warps=self.plan.num_warps)
        if not interpreting():
            meta.update(launch_pdl=bool(self.C.pdl > 0), launch_cooperative_grid=self.options.cooperative)
        return meta

    def args(self, x, residual, weight, eps, out, new_res, qargs) -> tuple:
        bufs, local, partials, state, err, errmap = self._workspace_args
        return ((x, residual if residual is not None else x, weight if weight is not None else x, out, new_res, bufs,
                 local, partials, state, err, errmap, qargs) + self._shape_args + (float(eps),) + self._wait_args)

    def compile(self) -> None:
        """Compile this variant without launching it (and check that its grid can be resident)."""
        if interpreting():
            return
        self._check_resident(self._warmup())

    def _warmup(self):
        """Triton's compile of this variant (a future inside `triton.AsyncCompileMode`)."""
        x = torch.zeros(self.num_tokens, self.hidden, dtype=self.dtype, device=self.device)
        _, qargs, _ = self._outputs(x, None, self.quant) if self.quant is not None else (None, _plain_qargs(x), None)
        return self.kernel.warmup(*self.args(x, x, x[0], 1e-6, x, x, qargs), grid=self.grid, **self.meta())

    def _check_resident(self, compiled) -> None:
        if self._checked or compiled is None or self.device.type != "cuda":
            return
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        compiled.run  # noqa: B018 - loads the binary, which sets n_regs
        props = torch.cuda.get_device_properties(self.device)
        warps = compiled.metadata.num_warps
        per_warp = -(-max(1, compiled.n_regs) * 32 // 256) * 256  # registers are allocated 256 a warp
        blocks = min(DEFAULT_BLOCKS_PER_SM,
                     getattr(props, "max_threads_per_multi_processor", DEFAULT_THREADS_PER_SM) // (32 * warps),
                     getattr(props, "regs_per_multiprocessor", DEFAULT_REGS_PER_SM) // (per_warp * warps))
        shared = compiled.metadata.shared
        if shared:
            blocks = min(blocks, getattr(props, "shared_memory_per_multiprocessor", shared) // shared)
        capacity = blocks * sm_count(self.device)
        ranks = max(1, int(getattr(self.ws, "ranks_per_device", 1)))
        need = self.grid[0] * ranks
        if need > capacity:
            raise RuntimeError(
                f"{self.where}: {ranks} rank(s) x {self.grid[0]} programs of {warps} warps and {compiled.n_regs} "
                f"registers cannot be resident together on this GPU ({blocks} per SM x {sm_count(self.device)} SMs), "
                "and the protocol's waits need them resident; pass a smaller max_programs")
        if int(self.C.pdl) == 2 and 2 * need > capacity:  # two launches per rank: fall back to the end trigger
            self.C = self.C._replace(pdl=tl.constexpr(1))
            self.compile()
        self._checked = True

    def _outputs(self, x, out, quant):
        """(QuantBuffers, qargs, normed output or None) of one quantized call (`quant`: this
        launch's format; its scale tensors are the call's data)."""
        m, h = x.shape
        buf = QuantBuffers(quant, m, h, x.device, hardware_fp8(x.device), hardware_fp4(x.device))
        qargs = (buf.codes, buf.codes.stride(0), buf.scales, *buf.s_strides, buf.param, buf.scale_ub)
        given = out[0] if out is not None else None
        normed = (given if given is not None else torch.empty_like(x)) if quant.with_normed else None
        return buf, qargs, normed

    def __call__(self, x, residual, weight, eps, out=None, quant=None):
        if quant is not None:
            if quant.key != self.quant.key:
                raise ValueError(f"{self.where}: this launch quantizes to {self.quant.key}, not {quant.key}")
            buf, qargs, normed = self._outputs(x, out, quant)
            new_res = out[1] if out is not None and out[1] is not None else torch.empty_like(x)
            target = normed if normed is not None else x
        else:
            qargs = _plain_qargs(x)
            if out is not None:
                target, new_res = out[0], (out[1] if self.has_norm else out[0])
            elif self.has_norm:  # two allocations: outputs must not alias (torch.library ops check it)
                target, new_res = torch.empty_like(x), torch.empty_like(x)
            else:
                target = new_res = torch.empty_like(x)
        args = self.args(x, residual, weight, eps, target, new_res, qargs)
        launch = self._launch
        if launch is None:
            if not interpreting() and not self._checked:
                self._check_resident(self.kernel.warmup(*args, grid=self.grid, **self.meta()))
            launch = self._launch = bind(self.kernel, self.grid, args, self.meta(), launch=True)
        else:
            launch(*args)
        if quant is not None:
            return QuantOutput(buf.out, buf.scale, new_res, normed)
        return target, (new_res if self.has_norm else None)


def compile_all(launches: list[PeerLaunch]) -> None:
    """`launch.compile()` of every launch, the variants compiled concurrently where this Triton
    can (`triton.AsyncCompileMode`: each compile runs on a worker thread, so their assembler
    processes overlap); each launch's residency is then checked one after another, as
    `compile()` does."""
    if len(launches) > 1 and not interpreting() and hasattr(triton, "AsyncCompileMode"):
        workers = min(len(launches), os.cpu_count() or 1, MAX_COMPILE_THREADS)
        with ThreadPoolExecutor(max_workers=workers) as pool, contextlib.ExitStack() as stack:
            try:
                stack.enter_context(triton.AsyncCompileMode(pool))
            except RuntimeError:  # a caller's AsyncCompileMode is active here: compile one by one below
                pass
            else:
                for launch in launches:
                    launch._warmup()
    for launch in launches:  # loads each compiled variant (cached now) and checks its residency
        launch.compile()


def _plain_qargs(x) -> tuple:
    """The kernels' qargs without quantization (never read)."""
    return (x, 0, x, 0, 0, x, 0.0)
