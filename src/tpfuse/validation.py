"""Input checks for the public ops: every error names the argument, what was wrong, and the fix.

The checks run on every call: the common valid call passes in a few attribute reads (`_plain_*`),
anything else takes the full checks, which name what is wrong.

Contract on layout: inputs of shape (..., hidden) are accepted and viewed as (tokens, hidden);
non-contiguous inputs are copied to a contiguous tensor first (one extra copy; pass contiguous
tensors on hot paths). Outputs are always contiguous and have the input's shape.
"""

from __future__ import annotations

import math
import numbers

import torch

from tpfuse.quant import KINDS, LAYOUTS, NVFP4_BLOCK, QuantSpec

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


def _fail(op: str, message: str, exc=ValueError):
    raise exc(f"{op}: {message}")


def check_tensor(op: str, arg: str, t, *, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{arg} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if t.dim() == 0:
        _fail(op, f"{arg} is a 0-dim tensor; pass at least (hidden,) or (tokens, hidden), e.g. {arg}.reshape(1, -1)")
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        _fail(op, f"{arg} has dtype {t.dtype}; supported floating dtypes are {names}; "
                  f"cast with {arg}.to(torch.bfloat16)", TypeError)
    if t.device.type != device.type or (device.type == "cuda" and device.index is not None
                                        and t.device.index != device.index):
        _fail(op, f"{arg} is on {t.device} but this communicator works on {device}; "
                  f"move it with {arg}.to({str(device)!r})")


def check_hidden(op: str, x) -> None:
    """The last dimension is the hidden size; 0 has no rows to view as (tokens, hidden)."""
    if x.shape[-1] == 0:
        _fail(op, f"x has shape {tuple(x.shape)}: hidden size (the last dimension) 0; pass (..., hidden) with "
                  "hidden >= 1 (zero tokens is fine: shape (0, hidden))")


def _plain_tensor(t, device: torch.device) -> bool:
    """True for a tensor that `check_tensor` and `check_hidden` accept: a supported dtype on
    `device`, at least 1-D, hidden >= 1."""
    return (isinstance(t, torch.Tensor) and t.dtype in _SUPPORTED and t.device == device and t.dim() > 0
            and t.shape[-1] > 0)


def check_all_reduce(x, *, device: torch.device) -> None:
    if _plain_tensor(x, device):  # the common valid call in a few attribute reads
        return
    check_tensor("all_reduce", "x", x, device=device)
    check_hidden("all_reduce", x)


def _plain_residual_rmsnorm(x, residual, weight, eps, device: torch.device) -> bool:
    """True for a call that the checks of `check_residual_rmsnorm` accept, read in a few attribute
    reads, each once (a Python float eps, every tensor on `device`); False only means: check in full."""
    if type(eps) is not float or not 0.0 <= eps < math.inf or not isinstance(x, torch.Tensor) \
            or not isinstance(weight, torch.Tensor):  # weights are often nn.Parameter
        return False
    dtype, shape, where = x.dtype, x.shape, x.device
    if dtype not in _SUPPORTED or where != device or not shape or not shape[-1]:
        return False
    if weight.dtype is not dtype or weight.device != where or weight.shape != shape[-1:]:
        return False
    return residual is None or (isinstance(residual, torch.Tensor) and residual.dtype is dtype
                                and residual.device == where and residual.shape == shape)


def check_residual_rmsnorm(x, residual, weight, eps, *, device: torch.device) -> None:
    if _plain_residual_rmsnorm(x, residual, weight, eps, device):
        return
    op = "all_reduce_residual_rmsnorm"
    check_tensor(op, "x", x, device=device)
    check_hidden(op, x)
    hidden = x.shape[-1]
    if residual is not None:
        check_tensor(op, "residual", residual, device=device)
        if residual.shape != x.shape:
            _fail(op, f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}; "
                      "they must match (pass residual=None for the first layer)")
        if residual.dtype != x.dtype:
            _fail(op, f"residual has dtype {residual.dtype} but x has {x.dtype}; cast with residual.to(x.dtype)",
                  TypeError)
    check_tensor(op, "weight", weight, device=device)
    if weight.shape != (hidden,):
        _fail(op, f"weight has shape {tuple(weight.shape)} but the hidden size of x is {hidden}; "
                  f"weight must have shape ({hidden},)")
    if weight.dtype != x.dtype:
        _fail(op, f"weight has dtype {weight.dtype} but x has {x.dtype}; cast with weight.to(x.dtype)", TypeError)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        _fail(op, f"eps must be a float, got {type(eps).__name__}", TypeError)
    if not math.isfinite(eps) or eps < 0:
        _fail(op, f"eps is {eps}; it must be a finite number >= 0 (typically 1e-6 or 1e-5)")


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """(..., hidden) -> contiguous (tokens, hidden) view (a copy only when `t` is not contiguous;
    `t` itself when it is already contiguous rows)."""
    if t.dim() == 2 and t.is_contiguous():
        return t
    return t.contiguous().view(-1, t.shape[-1])


def check_quant(op: str, quant, hidden: int, *, device: torch.device) -> None:
    """`quant` is a tpfuse.quant.QuantSpec that fits rows of `hidden` on `device`."""

    if not isinstance(quant, QuantSpec):
        _fail(op, "quant must be a tpfuse.QuantSpec (from tpfuse.fp8_static, fp8_per_token, fp8_per_group or nvfp4), "
                  f"got {type(quant).__name__}", TypeError)
    if quant.kind not in KINDS or quant.layout not in LAYOUTS[quant.kind]:
        _fail(op, f"quant {quant.kind!r} with layout {quant.layout!r} is not a format; "
                  f"build it with tpfuse.{'/'.join(KINDS)}()")
    if quant.kind == "fp8_per_group" and (quant.group < 16 or quant.group & (quant.group - 1)):
        _fail(op, f"fp8_per_group group {quant.group} must be a power of two >= 16; use tpfuse.fp8_per_group(128)")
    group = quant.group if quant.kind == "fp8_per_group" else NVFP4_BLOCK if quant.kind == "nvfp4" else 1
    if hidden % group:
        _fail(op, f"hidden size {hidden} is not a multiple of {group}, the {quant.kind} group; "
                  "pad the hidden dimension or use a group that divides it")
    if quant.kind in ("fp8_static", "nvfp4"):
        what = "scale" if quant.kind == "fp8_static" else "global_scale"
        value = quant.scale
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or value.dtype != torch.float32:
                _fail(op, f"the {quant.kind} {what} has shape {tuple(value.shape)} and dtype {value.dtype}; "
                          "pass a float32 tensor of one element", TypeError)
            if value.device.type != device.type or (device.type == "cuda" and device.index is not None
                                                    and value.device.index != device.index):
                _fail(op, f"the {quant.kind} {what} is on {value.device} but the data is on {device}; "
                          f"move it with .to({str(device)!r})")
        elif (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
              or value <= 0):
            _fail(op, f"the {quant.kind} {what} is {value!r}; "
                      "pass a finite number > 0 or a float32 tensor of one element")
