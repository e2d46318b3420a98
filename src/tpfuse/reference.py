"""Pure-PyTorch references: the meaning of every fused op, and the tolerances it is held to.

Tests, `selftest`, `tune` and `verify` compare every strategy against these functions. They take
the per-rank inputs as a list (index = rank), so the whole collective is computed in one process.

Rounding points of `all_reduce_residual_rmsnorm` (the contract every strategy implements), with
`acc` the accumulation dtype (float32 by default; float64 for verification) and `dt` the input
dtype:

    s          = round_dt( sum_{r=0..W-1} acc(x_r) )        # the allreduce output, as unfused code has it
    new_res    = round_dt( acc(s) + acc(residual) )         # or s itself when residual is None
    h          = acc(new_res)                               # normalise from the rounded residual
    inv        = 1 / sqrt(sum(h^2) / H + eps)                # per row
    normed     = round_dt( (h * acc(weight)) * inv )

Exactly three roundings to `dt`. The weight is applied before the row's scalar `inv`, so that
|normed| is a monotone function of |h * weight| alone: a split row's absmax (per-token FP8) is
then `inv` times the largest of its chunks' maxima of |h * weight|, known as soon as the sum of
squares is (one exchange of partials, not two). Inside the norm each step (the division by H, the
square root, the reciprocal) is one correctly rounded IEEE operation in `acc`, which is what the
Triton epilogue computes (div_rn, sqrt_rn), so CPU, CUDA and the kernels agree bit for bit. Plain
torch does not give that: on CUDA `torch.rsqrt` is approximate and `tensor / python_float`
multiplies by the reciprocal; on CPU, float32 `torch.sqrt` is not correctly rounded for about a
fifth of inputs (torch 2.13, AVX512). So the division by H is by a tensor, the root is `sqrt` then
`reciprocal` (both IEEE in fp32 on CUDA, where torch is built without fast math), and on CPU these
steps run in float64 and are rounded once, which is exact: float64 has more than 2 x 24 + 2 bits,
so sqrt and division rounded twice still give the correctly rounded fp32 result.

Summation order over ranks is 0..W-1; strategies may reduce in another order only where that
cannot change the result (fp32 sums of small integers are exact).

Tolerances: `TOLERANCE[dtype]` bounds the norm-wise relative error ||out - ref64|| / ||ref64||
against the float64 reference. Error model: three roundings to the dtype, each at most half an ulp
(unit roundoff u), plus fp32 accumulation error over W ranks and H elements of the mean; the
bound is 4u for the 16-bit types and a fixed few-ulp figure for fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tpfuse.quant import QuantOutput

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
    y, new_residual = normed_unrounded_ref(s, residual, weight, eps, acc_dtype=acc_dtype)
    return y.to(s.dtype), new_residual


def normed_unrounded_ref(
    s: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6, *, acc_dtype=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, new_residual): the normed output before its rounding to the data dtype (in `acc`,
    fp32 by default), which is what quantized output is computed from."""
    hw, inv, new_residual = _normed_factors(s, residual, weight, eps, acc_dtype)
    return hw * inv, new_residual


def _normed_factors(s, residual, weight, eps, acc_dtype):
    """(h * weight, inv per row (M, 1), new_residual): normed before its rounding is their product."""
    dtype = s.dtype
    acc = acc_dtype or accumulation_dtype(dtype)
    new_residual = s if residual is None else (s.to(acc) + residual.to(acc)).to(dtype)
    h = new_residual.to(acc)
    return h * weight.to(acc), _inverse_rms(h, eps), new_residual


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


# ---- quantized output ------------------------------------------------------------------------
#
# Every step below is one IEEE fp32 operation: computed in float64 and rounded once to fp32
# (`_f32`), which is the correctly rounded fp32 result for +, x and / (float64 carries more than
# 2 x 24 + 2 bits). The last step rounds onto the format's grid by definition (`_to_grid`):
# round to nearest, ties to even, saturating to the largest finite value. Contract:
#
#   inv(s)       = 0 if s == 0 else f32(1 / s)
#   fp8_static   : q = e4m3(f32(y * inv(scale)))
#   fp8_per_token: amax = max |y| over the row; scale = f32(amax / 448), then min(scale, scale_ub);
#                  q = e4m3(f32(y * inv(scale)))            (an all-zero row: scale 0, q = 0)
#                  In the fused op y = f32(hw * inv_rms) (module docstring) and amax is taken as
#                  f32(inv_rms * max |hw|): the same value, as rounding is monotone, save where
#                  inv_rms is inf (eps = 0 and a sum of squares of 0), which gives inf, not NaN,
#                  when only some hw are 0. A split row needs no second exchange for it.
#   fp8_per_group: the same over each `group` consecutive columns
#   nvfp4        : amax over 16 columns; sf = e4m3(f32(gs * f32(amax * f32(1/6))));
#                  out_scale = 0 if sf == 0 else f32(gs / sf); q = e2m1(f32(y * out_scale))
#
# NaN and inf: a NaN in y makes amax NaN (max over the bit patterns: NaN is above inf), so its
# row (per token), group or block gets a NaN scale (e4m3 0x7F for nvfp4 block scales) and every
# element of it a NaN code: 0x7F in e4m3 (the sign is dropped), 0x7 (+6) in e2m1, which has no
# NaN (its block scale is NaN, so it dequantizes to NaN). inf saturates to +-448 / +-6 where it
# is quantized with a finite non-zero inverse scale; a dynamic scale of inf has inverse 0, and
# inf * 0 is NaN. -0.0 keeps its sign (e4m3 0x80, e2m1 0x8).

_E4M3 = (3, -6, 448.0)  # mantissa bits, smallest normal exponent, largest finite
_E2M1 = (1, 0, 6.0)
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _f32(t: torch.Tensor) -> torch.Tensor:
    """One rounding to fp32, kept in float64."""
    return t.to(torch.float32).to(torch.float64)


def _to_grid(v: torch.Tensor, fmt: tuple[int, int, float]) -> torch.Tensor:
    """float64 `v` rounded to nearest-even onto a minifloat grid, saturating; NaN stays NaN."""
    mant_bits, emin, largest = fmt
    a = v.abs()
    _, e = torch.frexp(a)  # a = m * 2^e with m in [0.5, 1): floor(log2 a) = e - 1
    quantum = torch.ldexp(torch.ones_like(a), torch.clamp(e - 1, min=emin) - mant_bits)
    r = torch.clamp(torch.round(a / quantum) * quantum, max=largest)  # a / quantum is exact
    return torch.copysign(r, v)


def _e4m3_codes(v: torch.Tensor) -> torch.Tensor:
    codes = _to_grid(v, _E4M3).to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(v), torch.full_like(codes, 0x7F), codes)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    r = _to_grid(v, _E2M1)
    a = r.abs().nan_to_num(nan=6.0)
    # position on the grid _E2M1_GRID: 2a below 2, a + 2 below 4, a / 2 + 4 above (exact)
    index = torch.where(a < 2, 2 * a, torch.where(a < 4, a + 2, a / 2 + 4)).to(torch.int64)
    codes = (index + 8 * torch.signbit(r).to(index.dtype)).to(torch.uint8)
    return torch.where(torch.isnan(v), torch.full_like(codes, 0x7), codes)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.zeros_like(scale), _f32(1.0 / scale))


def _amax(blocks: torch.Tensor) -> torch.Tensor:
    """max |.| over the last dimension, NaN if any element is NaN (torch.amax propagates NaN)."""
    return blocks.abs().amax(dim=-1, keepdim=True)


def _scalar(value, device) -> torch.Tensor:
    """A given scale as float64 (1,) on `device`; a float is filled there (graph-capturable)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float32).reshape(1).to(torch.float64)
    return torch.full((1,), float(value), dtype=torch.float32, device=device).to(torch.float64)


def quantize_ref(y: torch.Tensor, quant, *, row_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of fp32 rows `y` (M, H) in the format and layout of `quant`
    (a `tpfuse.quant.QuantSpec`; shapes and layouts in `tpfuse.quant`), by the contract above.
    `row_amax` (M, 1), per-token FP8 only: each row's absmax given (the fused op's), not max |y|."""
    m, h = y.shape
    if row_amax is not None and quant.kind != "fp8_per_token":
        raise ValueError(f"quantize_ref: row_amax is per-token FP8's; {quant.kind} computes its own absmax "
                         "(pass row_amax=None)")
    y64 = y.to(torch.float32).to(torch.float64)
    if quant.kind == "fp8_static":
        scale = _scalar(quant.scale, y.device)
        return _e4m3_codes(_f32(y64 * _inverse(scale))).view(torch.float8_e4m3fn), scale.to(torch.float32)
    if quant.kind in ("fp8_per_token", "fp8_per_group"):
        group = h if quant.kind == "fp8_per_token" else quant.group
        blocks = y64.reshape(m, h // group, group)
        amax = _amax(blocks) if row_amax is None else row_amax.to(torch.float32).reshape(m, 1, 1).to(torch.float64)
        scale = _f32(amax / 448.0)
        if quant.scale_ub is not None:
            ub = float(torch.tensor(quant.scale_ub, dtype=torch.float32))  # the bound as fp32, as the kernel takes it
            scale = torch.where(scale > ub, torch.full_like(scale, ub), scale)
        codes = _e4m3_codes(_f32(blocks * _inverse(scale))).reshape(m, h).view(torch.float8_e4m3fn)
        scale = scale.reshape(m, h // group).to(torch.float32)
        if quant.kind == "fp8_per_token" or quant.layout == "row":
            return codes, scale
        return codes, _column_major(scale)
    assert quant.kind == "nvfp4", quant.kind
    gs = _scalar(quant.scale, y.device)
    blocks = y64.reshape(m, h // 16, 16)
    sixth = float(torch.tensor(1.0 / 6.0, dtype=torch.float32))  # fp32(1/6), FlashInfer's RECIPROCAL_6
    sf_codes = _e4m3_codes(_f32(gs * _f32(_amax(blocks) * sixth)))
    sf = sf_codes.view(torch.float8_e4m3fn).to(torch.float64)
    out_scale = torch.where(sf == 0, torch.zeros_like(sf), _f32(gs / sf))
    codes = _e2m1_codes(_f32(blocks * out_scale)).reshape(m, h)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    sf_codes = sf_codes.reshape(m, h // 16)
    if quant.layout == "swizzled":
        sf_codes = swizzle_128x4(sf_codes)
    return packed, sf_codes.view(torch.float8_e4m3fn)


def _column_major(scale: torch.Tensor) -> torch.Tensor:
    """(M, G) scales as a view of a (G, align4(M)) buffer: DeepGEMM's MN-major TMA-aligned layout."""
    m, g = scale.shape
    storage = torch.zeros(g, -(-m // 4) * 4, dtype=scale.dtype, device=scale.device)
    storage[:, :m] = scale.t()
    return storage.t()[:m]


def swizzle_128x4(sf: torch.Tensor) -> torch.Tensor:
    """(M, K) block scales (one byte each) in the 128x4 layout: (align128(M), align4(K)) bytes,
    padding zero, offset formula in `tpfuse.quant`."""
    m, k = sf.shape
    mp, kp = -(-m // 128) * 128, -(-k // 4) * 4
    padded = torch.zeros(mp, kp, dtype=torch.uint8, device=sf.device)
    padded[:m, :k] = sf.view(torch.uint8)
    # (m_tile, 4 m_inner, 32 m_outer, k_tile, 4 k_inner) -> (m_tile, k_tile, m_outer, m_inner, k_inner)
    tiles = padded.reshape(mp // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(mp, kp).contiguous()


def residual_rmsnorm_quant_ref(s, residual, weight, eps: float, quant, *, acc_dtype=None):
    """The epilogue with quantized output: a `tpfuse.quant.QuantOutput` (out, scale, residual, normed)."""

    hw, inv, new_residual = _normed_factors(s, residual, weight, eps, acc_dtype)
    y = hw * inv
    # (contract above); abs: 0 * inf is a NaN whose sign differs by machine, an absmax has none
    row_amax = (inv * _amax(hw)).abs() if quant.kind == "fp8_per_token" else None
    codes, scales = quantize_ref(y.to(torch.float32), quant, row_amax=row_amax)
    return QuantOutput(codes, scales, new_residual, y.to(s.dtype) if quant.with_normed else None)


def all_reduce_residual_rmsnorm_quant_ref(xs, residual, weight, eps: float, quant):
    """allreduce(xs) -> residual add -> RMSNorm -> quantization (contract above)."""
    return residual_rmsnorm_quant_ref(all_reduce_ref(xs), residual, weight, eps, quant)
