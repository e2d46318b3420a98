"""The host side both peer kernels share: fitting a call to the workspace, outputs, arguments,
compile-time constants, grid, and one launcher (`launch_peer_kernel`) that `oneshot_launch` and
`twoshot_launch` call with their kernel.

`ws` (the workspace) provides peers.views (W 1-D tensors), peers.local, state, err, partials,
region_elems, header_elems, sentinel and rank (`tpfuse.strategies.workspace.LamportWorkspace`,
or the emulated workspaces of benchmarks/bench_peer_kernels.py).
"""

from __future__ import annotations

import torch
import triton

from tpfuse.kernels.epilogue import interpreting
from tpfuse.kernels.protocol import MAX_HIDDEN, make_plan, partials_needed, quantizes_in_kernel, region_elems_for
from tpfuse.kernels.quant import KIND_BY_NAME, QuantBuffers

# Interpreter spin bound per second of timeout: one interpreted poll of a 32-element row took
# about 1 ms on the 2-core CI-class machine (tests/kernels/test_interpreter.py timeout test).
INTERPRETER_SPINS_PER_S = 1_000


def spin_bounds(timeout_s: float) -> tuple[int, int]:
    """(timeout in ns for GPUs, spin count for the interpreter) of one wait."""
    return int(timeout_s * 1e9), max(1, int(timeout_s * INTERPRETER_SPINS_PER_S))


def check_fits(where: str, x, ws, plan, *, twoshot: bool, quant=None) -> None:
    m, h = x.shape
    if h > MAX_HIDDEN:
        raise ValueError(f"{where}: hidden size {h} exceeds {MAX_HIDDEN}; use strategy='nccl_epilogue'")
    need = region_elems_for(m, h, len(ws.peers.views), plan, twoshot=twoshot)
    if need > ws.region_elems or (plan.split and partials_needed(plan, quant) > ws.partials.numel()):
        raise ValueError(f"{where}: {m}x{h} elements exceed the workspace region of {ws.region_elems}; "
                         "call prepare() with a larger max_tokens")
    if quant is not None and not quantizes_in_kernel(plan, quant):
        raise ValueError(f"{where}: chunks of {plan.chunk} elements do not hold whole {quant.kind} scale blocks; "
                         "quantize after the allreduce (tpfuse.kernels.epilogue.residual_rmsnorm)")


def quant_buffers(x, quant, with_normed_out):
    """(QuantBuffers or None, the kernels' qargs tuple, normed output or None) of one call."""
    if quant is None:
        return None, (x, 0, x, 0, 0, x, 0.0), None
    from tpfuse.kernels.epilogue import hardware_fp4, hardware_fp8

    m, h = x.shape
    buf = QuantBuffers(quant, m, h, x.device, hardware_fp8(x.device), hardware_fp4(x.device))
    qargs = (buf.codes, buf.codes.stride(0), buf.scales, *buf.s_strides, buf.param, buf.scale_ub)
    normed = (with_normed_out if with_normed_out is not None else torch.empty_like(x)) if quant.with_normed else None
    return buf, qargs, normed


def launch_args(x, residual, weight, ws, out, has_norm, quant=None):
    """(out, new_residual, QuantBuffers or None, the pointer arguments both peer kernels share)."""
    given, given_res = out if out is not None else (None, None)  # caller's buffers (tests poison them with NaN)
    out = given if given is not None else torch.empty_like(x)
    new_res = (given_res if given_res is not None else torch.empty_like(x)) if has_norm else out
    buf, qargs, normed = quant_buffers(x, quant, given)
    if quant is not None:
        out = normed
    ptrs = (x, residual if residual is not None else x, weight if weight is not None else x,
            out if out is not None else x, new_res, tuple(ws.peers.views), ws.peers.local, ws.partials, ws.state,
            ws.err, qargs)
    return out, new_res, buf, ptrs


def kernel_meta(x, residual, ws, plan, has_norm, quant=None) -> dict:
    world = len(ws.peers.views)
    h = x.shape[1]
    return dict(W=world, WP=triton.next_power_of_2(world), CHUNK=plan.chunk, NCHUNK=plan.num_chunks,
                NCP=triton.next_power_of_2(plan.num_chunks), SENT=ws.sentinel, ELEM_BITS=8 * x.element_size(),
                HAS_RES=residual is not None, HAS_NORM=has_norm, SPLIT=has_norm and plan.split, USE_ASM=not interpreting(),
                SOFT_BF16=interpreting(), num_warps=plan.num_warps,
                QKIND=KIND_BY_NAME[quant.kind] if quant is not None else 0, QGROUP=(quant.group or 16) if quant else 16,
                QSWIZZLED=quant is not None and quant.layout == "swizzled",
                QHAS_UB=quant is not None and quant.scale_ub is not None,
                QHW=quant_hw_bits(x.device, quant), WITH_NORMED=quant is not None and quant.with_normed,
                QNG=triton.next_power_of_2(max(4, -(-(h // 16) // 4) * 4)))


def quant_hw_bits(device, quant) -> int:
    """HW_CVT bits of `tpfuse.kernels.quant` for `device` (0 without quantization)."""
    if quant is None:
        return 0
    from tpfuse.kernels.epilogue import hardware_fp4, hardware_fp8

    return int(hardware_fp8(device)) | (2 if hardware_fp4(device) else 0)


def finish_outputs(out, new_res, buf, has_norm):
    """What a launcher returns: (out, new_residual), or a QuantOutput with quantization."""
    if buf is None:
        return out, (new_res if has_norm else None)
    from tpfuse.quant import QuantOutput

    return QuantOutput(buf.out, buf.scale, new_res, out)


def grid_for(plan, max_programs: int) -> tuple[int]:
    programs = max(1, min(plan.items, max_programs))
    if interpreting() and plan.split:
        programs = 1  # the interpreter runs programs one after another: one program owns every row
    return (programs,)


def launch_peer_kernel(kernel, where, x, residual, weight, eps, ws, *, timeout_s, max_programs, plan_programs,
                       has_norm, warmup, out, plan, quant, twoshot):
    """The launcher both peer kernels share (their arguments are the same)."""
    m, h = x.shape
    plan = plan or make_plan(m, h, x.element_size(), plan_programs)
    check_fits(where, x, ws, plan, twoshot=twoshot, quant=quant)
    out, new_res, buf, ptrs = launch_args(x, residual, weight, ws, out, has_norm, quant)
    timeout_ns, max_spins = spin_bounds(timeout_s)
    args = ptrs + (ws.rank, m, h, ws.region_elems, ws.header_elems, float(eps), timeout_ns, max_spins)
    meta = kernel_meta(x, residual, ws, plan, has_norm, quant)
    grid = grid_for(plan, max_programs)
    if warmup:
        if not interpreting():
            kernel.warmup(*args, grid=grid, **meta)
        return None
    kernel[grid](*args, **meta)
    return finish_outputs(out, new_res, buf, has_norm)
