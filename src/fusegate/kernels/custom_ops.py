"""torch.library registrations, so torch.compile graphs can call the kernels as opaque ops.

    torch.ops.fusegate.residual_rmsnorm(s, residual, weight, eps) -> (normed, new_residual)
    torch.ops.fusegate.all_reduce_residual_rmsnorm(x, residual, weight, eps, handle) -> (normed, new_residual)

The collective op names its strategy instance by an integer `handle` (a custom op cannot take a
Python object): `fusegate.backends.oneshot.PeerStrategy` registers itself at construction
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


@torch.library.custom_op("fusegate::residual_rmsnorm", mutates_args=())
def residual_rmsnorm_op(
    s: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from fusegate.kernels.epilogue import residual_rmsnorm

    return residual_rmsnorm(s.contiguous(), None if residual is None else residual.contiguous(), weight.contiguous(), eps)


@residual_rmsnorm_op.register_fake
def _(s, residual, weight, eps):
    return torch.empty_like(s), torch.empty_like(s)


@torch.library.custom_op("fusegate::all_reduce_residual_rmsnorm", mutates_args=())
def all_reduce_residual_rmsnorm_op(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, handle: int
) -> tuple[torch.Tensor, torch.Tensor]:
    strategy = _INSTANCES.get(handle)
    if strategy is None:
        raise ValueError(f"fusegate::all_reduce_residual_rmsnorm: no open strategy has handle {handle}; it was closed or never created")
    return strategy.all_reduce_residual_rmsnorm(x.contiguous(), None if residual is None else residual.contiguous(), weight.contiguous(), eps)


@all_reduce_residual_rmsnorm_op.register_fake
def _(x, residual, weight, eps, handle):
    return torch.empty_like(x), torch.empty_like(x)
