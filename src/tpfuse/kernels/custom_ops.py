"""torch.library registrations, so torch.compile graphs can call the kernels as opaque ops.

    torch.ops.tpfuse.residual_rmsnorm(s, residual, weight, eps) -> (normed, new_residual)
    torch.ops.tpfuse.residual_rmsnorm_quant(s, residual, weight, eps, kind, group, layout, scale_ub,
                                              with_normed, scale) -> (codes, scales, new_residual, normed)
    torch.ops.tpfuse.all_reduce_residual_rmsnorm(x, residual, weight, eps, handle) -> (normed, new_residual)

`residual_rmsnorm_quant_op(s, residual, weight, eps, quant)` is the Python face of the quantized
op: it passes the QuantSpec's fields and returns a `tpfuse.quant.QuantOutput` shaped as the
launcher's (the op itself returns plain contiguous tensors: DeepGEMM's column-major scales as their
(H/g, align4(M)) storage, an empty scale for fp8_static and an empty normed without with_normed).

The collective op names its strategy instance by an integer `handle` (a custom op cannot take a
Python object): `tpfuse.strategies.peer.PeerStrategy` registers itself at construction
(`strategy.handle`) and unregisters in close(). Both ops return fresh tensors and mutate nothing;
their fake (meta) implementations give the output shapes to the compiler. Importing this module
registers the ops (it imports torch, not Triton).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

_INSTANCES: dict[int, Any] = {}
_NEXT = itertools.count(1)


def register_instance(strategy: Any) -> int:
    """A new handle for `strategy` (a Strategy with all_reduce_residual_rmsnorm)."""
    handle = next(_NEXT)
    _INSTANCES[handle] = strategy
    return handle


def unregister_instance(handle: int) -> None:
    _INSTANCES.pop(handle, None)


@torch.library.custom_op("tpfuse::residual_rmsnorm", mutates_args=())
def residual_rmsnorm_op(
    s: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from tpfuse.kernels.epilogue import residual_rmsnorm

    return residual_rmsnorm(s.contiguous(), None if residual is None else residual.contiguous(), weight.contiguous(), eps)


@residual_rmsnorm_op.register_fake
def _(s, residual, weight, eps):
    return torch.empty_like(s), torch.empty_like(s)


@torch.library.custom_op("tpfuse::all_reduce_residual_rmsnorm", mutates_args=())
def all_reduce_residual_rmsnorm_op(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, handle: int
) -> tuple[torch.Tensor, torch.Tensor]:
    strategy = _INSTANCES.get(handle)
    if strategy is None:
        raise ValueError(f"tpfuse::all_reduce_residual_rmsnorm: no open strategy has handle {handle}; it was closed or never created")
    return strategy.all_reduce_residual_rmsnorm(x.contiguous(), None if residual is None else residual.contiguous(), weight.contiguous(), eps)


@all_reduce_residual_rmsnorm_op.register_fake
def _(x, residual, weight, eps, handle):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("tpfuse::residual_rmsnorm_quant", mutates_args=())
def _residual_rmsnorm_quant(
    s: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, kind: str, group: int,
    layout: str, scale_ub: float | None, with_normed: bool, scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from tpfuse.kernels.epilogue import residual_rmsnorm
    from tpfuse.quant import QuantSpec

    quant = QuantSpec(kind, group, layout, scale_ub, with_normed, scale)
    out = residual_rmsnorm(s.contiguous(), None if residual is None else residual.contiguous(), weight.contiguous(), eps, quant=quant)
    scales = out.scale
    if kind == "fp8_static":
        scales = s.new_empty(0, dtype=torch.float32)
    elif kind == "fp8_per_group" and layout == "col":
        # the (M, G) view with strides (1, align4(M)) -> its whole (G, align4(M)) storage
        scales = scales.as_strided((scales.shape[1], scales.stride(1)), (scales.stride(1), 1))
    normed = out.normed if out.normed is not None else s.new_empty(0)
    return out.out, scales, out.residual, normed


@_residual_rmsnorm_quant.register_fake
def _(s, residual, weight, eps, kind, group, layout, scale_ub, with_normed, scale):
    m, h = s.shape
    f32 = torch.float32
    if kind == "nvfp4":
        codes = s.new_empty(m, h // 2, dtype=torch.uint8)
        k = h // 16
        shape = (-(-m // 128) * 128, -(-k // 4) * 4) if layout == "swizzled" else (m, k)
        scales = s.new_empty(*shape, dtype=torch.float8_e4m3fn)
    else:
        codes = s.new_empty(m, h, dtype=torch.float8_e4m3fn)
        if kind == "fp8_static":
            scales = s.new_empty(0, dtype=f32)
        elif kind == "fp8_per_token":
            scales = s.new_empty(m, 1, dtype=f32)
        elif layout == "col":
            scales = s.new_empty(h // group, -(-m // 4) * 4, dtype=f32)
        else:
            scales = s.new_empty(m, h // group, dtype=f32)
    return codes, scales, torch.empty_like(s), torch.empty_like(s) if with_normed else s.new_empty(0)


def residual_rmsnorm_quant_op(s, residual, weight, eps: float, quant):
    """The quantized epilogue through `torch.ops.tpfuse.residual_rmsnorm_quant`, as a QuantOutput."""
    from tpfuse.quant import QuantOutput

    scale = quant.scale
    if quant.kind in ("fp8_static", "nvfp4") and not isinstance(scale, torch.Tensor):
        scale = torch.full((1,), float(scale), dtype=torch.float32, device=s.device)
    codes, scales, new_res, normed = torch.ops.tpfuse.residual_rmsnorm_quant(
        s, residual, weight, eps, quant.kind, quant.group, quant.layout, quant.scale_ub, quant.with_normed,
        scale if quant.kind in ("fp8_static", "nvfp4") else None,
    )
    if quant.kind == "fp8_static":
        scales = scale
    elif quant.kind == "fp8_per_group" and quant.layout == "col":
        scales = scales.t()[: s.shape[0]]
    return QuantOutput(codes, scales, new_res, normed if quant.with_normed else None)
