"""Pure-PyTorch references: the meaning of every fused op, and the tolerances it is held to.

Tests, `selftest`, `tune` and `verify` compare every strategy against these functions. They take
the per-rank inputs as a list (index = rank), so the whole collective is computed in one process.

Rounding points of `all_reduce_residual_rmsnorm` (the contract every strategy implements), with
`acc` the accumulation dtype (float32 by default; float64 for verification) and `dt` the input
dtype:

    s          = round_dt( sum_{r=0..W-1} acc(x_r) )        # the allreduce output, as unfused code has it
    new_res    = round_dt( acc(s) + acc(residual) )         # or s itself when residual is None
    h          = acc(new_res)                               # normalise from the rounded residual
    normed     = round_dt( h * (1 / sqrt(sum(h^2) / H + eps)) * acc(weight) )

Exactly three roundings to `dt`. Inside the norm each step (the division by H, the square root,
the reciprocal) is one correctly rounded IEEE operation in `acc`, which is what the Triton epilogue
computes (div_rn, sqrt_rn), so CPU, CUDA and the kernels agree bit for bit. Plain torch does not
give that: on CUDA `torch.rsqrt` is approximate and `tensor / python_float` multiplies by the
reciprocal; on CPU, float32 `torch.sqrt` is not correctly rounded for about a fifth of inputs
(torch 2.13, AVX512). So the division by H is by a tensor, the root is `sqrt` then `reciprocal`
(both IEEE in fp32 on CUDA, where torch is built without fast math), and on CPU these steps run in
float64 and are rounded once, which is exact: float64 has more than 2 x 24 + 2 bits, so sqrt and
division rounded twice still give the correctly rounded fp32 result.

Summation order over ranks is 0..W-1; strategies may reduce in another order only where that
cannot change the result (fp32 sums of small integers are exact).

Tolerances: `TOLERANCE[dtype]` bounds the norm-wise relative error ||out - ref64|| / ||ref64||
against the float64 reference. Error model: three roundings to the dtype, each at most half an ulp
(unit roundoff u), plus fp32 accumulation error over W ranks and H elements of the mean; the
bound is 4u for the 16-bit types and a fixed few-ulp figure for fp32.
"""

from __future__ import annotations

from typing import Sequence

import torch

# Norm-wise relative error against the float64 reference, by dtype. u = unit roundoff.
TOLERANCE = {
    torch.bfloat16: 4 * 2.0**-9,  # u = 2^-9; three roundings + slack: 7.8e-3
    torch.float16: 4 * 2.0**-12,  # u = 2^-12: 9.8e-4
    torch.float32: 2e-5,  # u = 6e-8; fp32 sums over W ranks and the H-term mean dominate
    torch.float64: 1e-12,  # float64 strategies against the float64 reference: rounding only
}


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit and 32-bit inputs, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def all_reduce_ref(xs: Sequence[torch.Tensor], *, acc_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum of the per-rank inputs in rank order 0..W-1, accumulated in `acc_dtype`, rounded once."""
    if len(xs) == 0:
        raise ValueError("all_reduce_ref: xs is empty; pass one tensor per rank")
    dtype = xs[0].dtype
    acc = acc_dtype or accumulation_dtype(dtype)
    total = xs[0].to(acc)
    for x in xs[1:]:
        total = total + x.to(acc)
    return total.to(dtype)


def residual_rmsnorm_ref(
    s: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    acc_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused epilogue: (normed, new_residual) from an allreduce output `s`, rounded as documented."""
    dtype = s.dtype
    acc = acc_dtype or accumulation_dtype(dtype)
    new_residual = s if residual is None else (s.to(acc) + residual.to(acc)).to(dtype)
    h = new_residual.to(acc)
    inv_rms = _inverse_rms(h, eps)
    normed = (h * inv_rms * weight.to(acc)).to(dtype)
    return normed, new_residual


def _inverse_rms(h: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(sum(h^2) / H + eps) per row, each step correctly rounded in h's dtype (module docstring)."""
    sum_sq = h.pow(2).sum(dim=-1, keepdim=True)
    # float64 only where float32 sqrt is not IEEE (CPU); on CUDA the casts below are no-ops, so
    # the unfused GPU path costs no extra kernels.
    wide = torch.float64 if h.device.type == "cpu" else h.dtype
    # H as a tensor on h's device: dividing by a Python number may multiply by its reciprocal.
    # Filled on the device (new_full), not copied from the host, so CUDA graphs can capture it.
    hidden = h.new_full((1,), float(h.shape[-1]), dtype=wide)
    mean_sq = (sum_sq.to(wide) / hidden).to(h.dtype)
    root = torch.sqrt((mean_sq + eps).to(wide)).to(h.dtype)
    return torch.reciprocal(root.to(wide)).to(h.dtype)


def all_reduce_residual_rmsnorm_ref(
    xs: Sequence[torch.Tensor],
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    acc_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """allreduce(xs) -> residual add -> RMSNorm, with the rounding points in the module docstring."""
    s = all_reduce_ref(xs, acc_dtype=acc_dtype)
    return residual_rmsnorm_ref(s, residual, weight, eps, acc_dtype=acc_dtype)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when `out` has a NaN or inf (a poisoned element)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if out64.numel() == 0:
        return 0.0
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    diff = (out64 - ref64).norm().item()
    return diff / denom if denom > 0 else diff


def small_integer_inputs(
    rank: int, num_tokens: int, hidden: int, dtype: torch.dtype, *, seed: int = 0, device="cpu"
) -> torch.Tensor:
    """Rank-tagged small integers whose fp32 sum over up to 64 ranks is exact in every dtype.

    Values lie in [-8, 8] plus `rank % 4`, so a misrouted peer buffer changes the sum.
    Deterministic in (seed, rank), so any process can rebuild any rank's input.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    x = torch.randint(-8, 9, (num_tokens, hidden), generator=gen, dtype=torch.int32) + (rank % 4)
    return x.to(dtype).to(device)


def random_inputs(
    rank: int, num_tokens: int, hidden: int, dtype: torch.dtype, *, seed: int = 0, device="cpu"
) -> torch.Tensor:
    """Deterministic standard-normal inputs for `rank` (never zeros), rebuildable by any process."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank + 7919)
    return torch.randn(num_tokens, hidden, generator=gen, dtype=torch.float32).to(dtype).to(device)
