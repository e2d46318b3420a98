"""The references against independent float64 math, and their documented rounding points.

The quantization references are checked against definitions written out by hand here (grid values,
ties, the 128x4 offset formula) and against torch's own float8_e4m3fn conversion, so that the
kernels' bit-exact tests compare against something independently right.
"""

import pytest
import torch

import tpfuse
from tpfuse import quant as Q
from tpfuse.reference import (
    TOLERANCE,
    _e2m1_codes,
    _e4m3_codes,
    all_reduce_ref,
    all_reduce_residual_rmsnorm_ref,
    normed_unrounded_ref,
    quantize_ref,
    random_inputs,
    relative_error,
    residual_rmsnorm_quant_ref,
    residual_rmsnorm_ref,
    small_integer_inputs,
    swizzle_128x4,
)


def _f64_math(xs, residual, weight, eps):
    s = sum(x.double() for x in xs)
    h = s + residual.double() if residual is not None else s
    return h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps) * weight.double(), h


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_fused_ref_within_tolerance_of_float64_math(dtype, world_size):
    xs = [random_inputs(r, 6, 2880, dtype) for r in range(world_size)]
    residual = random_inputs(99, 6, 2880, dtype)
    weight = (1 + 0.1 * torch.randn(2880, generator=torch.Generator().manual_seed(5))).to(dtype)
    normed, new_res = all_reduce_residual_rmsnorm_ref(xs, residual, weight, 1e-6)
    ref_normed, ref_res = _f64_math(xs, residual, weight, 1e-6)
    assert normed.dtype == new_res.dtype == dtype
    assert relative_error(new_res, ref_res) <= TOLERANCE[dtype]
    assert relative_error(normed, ref_normed) <= TOLERANCE[dtype]


def test_float64_ref_matches_float64_math_to_rounding():
    xs = [random_inputs(r, 3, 64, torch.float64) for r in range(4)]
    weight = random_inputs(7, 1, 64, torch.float64)[0]
    normed, new_res = all_reduce_residual_rmsnorm_ref(xs, None, weight, 1e-5)
    ref_normed, ref_res = _f64_math(xs, None, weight, 1e-5)
    torch.testing.assert_close(new_res, ref_res, rtol=1e-14, atol=0)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-13, atol=0)


def test_fp32_norm_steps_are_correctly_rounded():
    # Independent IEEE float32 math in numpy (correctly rounded sqrt and division), row by row:
    # the reference must equal it bit for bit, as the Triton epilogue (sqrt_rn, div_rn) does.
    # Plain float32 torch.sqrt on CPU misses on about a fifth of such inputs.
    np = pytest.importorskip("numpy")
    h = small_integer_inputs(0, 64, 96, torch.float32) + small_integer_inputs(1, 64, 96, torch.float32)
    weight = small_integer_inputs(2, 1, 96, torch.float32)[0]
    normed, _ = residual_rmsnorm_ref(h, None, weight, 1e-6)
    hn, wn = h.numpy(), weight.numpy()
    mean_sq = (hn * hn).sum(axis=-1, keepdims=True, dtype=np.float32) / np.float32(96)
    inv = np.float32(1) / np.sqrt(mean_sq + np.float32(1e-6))
    assert torch.equal(normed, torch.from_numpy((hn * wn) * inv))  # the weight first (module docstring)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_gives_the_same_bits_on_cuda_and_cpu(dtype):
    # The CUDA branch of the norm: torch.rsqrt there is approximate, which made fp32 exact checks
    # fail by one ulp; every step must be correctly rounded on the GPU as on the CPU.
    for make in (small_integer_inputs, random_inputs):
        xs = [make(r, 64, 2880, dtype) for r in range(2)]
        residual = make(9, 64, 2880, dtype)
        weight = make(10, 1, 2880, dtype)[0].abs() + 1
        on_cpu = all_reduce_residual_rmsnorm_ref(xs, residual, weight, 1e-6)
        on_gpu = all_reduce_residual_rmsnorm_ref([x.cuda() for x in xs], residual.cuda(), weight.cuda(), 1e-6)
        assert torch.equal(on_gpu[1].cpu(), on_cpu[1])
        if make is small_integer_inputs:  # exact sums of squares: only the rounding of each step is left
            assert torch.equal(on_gpu[0].cpu(), on_cpu[0])
        else:  # random: the H-term sum is reduced in another order on the GPU
            assert relative_error(on_gpu[0], on_cpu[0].double()) <= TOLERANCE[dtype]


def test_rounding_points_are_the_documented_ones():
    # bf16 has an ulp of 2^-7 at 1. The allreduce output is rounded before the residual add:
    # s = round(1 + 2^-9) = 1, then new_res = round(1 + 2^-8) = 1 (a tie, to even). Adding the
    # unrounded sum instead would give round(1 + 2^-9 + 2^-8) = 1 + 2^-7.
    xs = [torch.tensor([[1.0]]).bfloat16(), torch.tensor([[2.0**-9]]).bfloat16()]
    residual = torch.tensor([[2.0**-8]]).bfloat16()
    s = all_reduce_ref(xs)
    assert s.item() == 1.0
    _, new_res = residual_rmsnorm_ref(s, residual, torch.ones(1, dtype=torch.bfloat16))
    assert new_res.item() == 1.0
    unrounded = (xs[0].float() + xs[1].float() + residual.float()).bfloat16()
    assert unrounded.item() == 1.0 + 2.0**-7


def test_rank_order_sum_in_fp32_not_in_dtype():
    # Summing in bf16 would lose the small terms: 256 + 1 + 1 -> 256 in bf16 steps, 258 in fp32.
    xs = [torch.tensor([[256.0]]).bfloat16(), torch.tensor([[1.0]]).bfloat16(), torch.tensor([[1.0]]).bfloat16()]
    assert all_reduce_ref(xs).item() == 258.0


def test_small_integer_inputs_sum_exactly_and_depend_on_rank():
    xs = [small_integer_inputs(r, 4, 32, torch.bfloat16) for r in range(64)]
    assert torch.equal(all_reduce_ref(xs).double(), sum(x.double() for x in xs))
    assert not torch.equal(small_integer_inputs(0, 4, 32, torch.float32), small_integer_inputs(1, 4, 32, torch.float32))
    assert torch.equal(small_integer_inputs(3, 4, 32, torch.float32), small_integer_inputs(3, 4, 32, torch.float32))


def test_relative_error_flags_poison():
    ref = torch.ones(4)
    out = ref.clone()
    out[2] = float("nan")
    assert relative_error(out, ref) == float("inf")
    assert relative_error(ref, ref) == 0.0


def test_all_reduce_ref_rejects_empty():
    with pytest.raises(ValueError, match="one tensor per rank"):
        all_reduce_ref([])


# ---- quantization --------------------------------------------------------------------------------

E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e4m3_reference_equals_torch_conversion_in_range():
    # torch rounds to nearest even but maps values beyond 464 to NaN (no saturation), so compare
    # on [-448, 448] with every binade, the subnormals and fp32 subnormals included.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=gen) * torch.exp2(torch.randint(-30, 10, (100_000,), generator=gen).float())
    x = torch.cat([x.clamp(-448, 448),
                   torch.tensor([0.0, -0.0, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 1e-40, -1e-40, 448.0])])
    assert torch.equal(_e4m3_codes(x.double()), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_e4m3_ties_saturation_and_specials():
    finite = E4M3_VALUES[:0x7F]  # codes 0 .. 0x7E: 0 .. 448, increasing
    mids = (finite[1:] + finite[:-1]) / 2  # exact midpoints: ties go to the even code
    lower = torch.arange(0x7E)
    even = torch.where(lower % 2 == 0, lower, lower + 1).to(torch.uint8)
    assert torch.equal(_e4m3_codes(mids), even)
    assert torch.equal(_e4m3_codes(-mids), even | 0x80)
    special = torch.tensor([464.0, 1e30, float("inf"), -float("inf"), float("nan"), -float("nan"), -0.0, 2.0**-10,
                            3 * 2.0**-10])
    assert _e4m3_codes(special.double()).tolist() == [0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x7F, 0x80, 0x00, 0x02]


def test_e2m1_grid_ties_and_specials():
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    assert _e2m1_codes(grid).tolist() == list(range(8))
    assert _e2m1_codes(-grid[1:]).tolist() == list(range(9, 16))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    assert _e2m1_codes(ties).tolist() == [0, 2, 2, 4, 4, 6, 6]  # to the even mantissa
    special = torch.tensor([0.2500001, 7.0, 1e9, float("inf"), -float("inf"), float("nan"), -0.0])
    assert _e2m1_codes(special.double()).tolist() == [1, 7, 7, 7, 15, 7, 8]


def test_swizzle_matches_the_offset_formula():
    m, k = 130, 6
    sf = torch.arange(m * k, dtype=torch.int32).remainder(251).add(1).to(torch.uint8).view(m, k)
    out = swizzle_128x4(sf.view(torch.float8_e4m3fn)).reshape(-1)
    k4 = -(-k // 4)
    assert out.numel() == 256 * 4 * k4
    for r in range(m):
        for c in range(k):
            offset = (r // 128) * (k4 * 512) + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            assert out[offset] == sf[r, c]
    assert int(out.to(torch.int32).sum()) == int(sf.to(torch.int32).sum())  # padding is zero


def test_per_token_and_group_scales_by_definition():
    y = torch.tensor([[0.0] * 8, [1.0, -2.0, 3.0, -448.0, 0.5, 0.25, 7.0, 9.0]], dtype=torch.float32)
    codes, scale = quantize_ref(y, Q.fp8_per_token())
    assert scale.tolist() == [[0.0], [1.0]]  # all-zero row: scale 0, codes 0
    assert torch.equal(codes[1].float(), y[1]) and torch.equal(codes[0].view(torch.uint8),
                                                               torch.zeros(8, dtype=torch.uint8))
    z = torch.cat([y.repeat(1, 2), y.repeat(1, 2) / 4], dim=1)  # two groups of 16 per row
    codes, scale = quantize_ref(z, Q.fp8_per_group(16))
    assert scale.tolist() == [[0.0, 0.0], [1.0, 0.25]]
    assert torch.equal(codes.float(), y.repeat(1, 4))
    _, ub = quantize_ref(y, Q.fp8_per_token(scale_ub=0.5))
    assert ub.tolist() == [[0.0], [0.5]]
    _, col = quantize_ref(torch.randn(5, 64), Q.fp8_per_group(16, layout="col"))
    assert col.shape == (5, 4) and col.stride() == (1, 8)  # M padded to a multiple of 4


def test_per_token_absmax_comes_from_the_norm_factors():
    """The fused op's per-token absmax is inv_rms * max |h * w| (the contract in tpfuse.reference):
    the same bits as max |y| of its own normed rows, save a degenerate row (inv_rms inf)."""
    s, r = random_inputs(0, 6, 256, torch.bfloat16), random_inputs(1, 6, 256, torch.bfloat16)
    w = (1 + 0.1 * random_inputs(2, 1, 256, torch.float32)[0]).to(torch.bfloat16)
    y, _ = normed_unrounded_ref(s, r, w, 1e-6)
    fused = residual_rmsnorm_quant_ref(s, r, w, 1e-6, Q.fp8_per_token())
    codes, scale = quantize_ref(y.float(), Q.fp8_per_token())
    assert torch.equal(fused.scale, scale) and torch.equal(fused.out.view(torch.uint8), codes.view(torch.uint8))
    # eps = 0 and rows whose squares underflow: inv_rms is inf, y is +-inf or NaN (0 * inf)
    tiny = torch.tensor([[2.0**-80, 0.0, -2.0**-80, 2.0**-81] * 4, [0.0] * 16], dtype=torch.bfloat16)
    out = residual_rmsnorm_quant_ref(tiny, None, torch.ones(16, dtype=torch.bfloat16), 0.0, Q.fp8_per_token())
    assert out.scale[0].item() == float("inf")  # inf * max |h * w|, where max |y| would be NaN
    assert out.scale[1].isnan().all()  # 0 * inf: the all-zero row has no scale
    with pytest.raises(ValueError, match="row_amax is per-token FP8's"):
        quantize_ref(y.float(), Q.fp8_static(1.0), row_amax=torch.ones(6, 1))


def test_nvfp4_block_scale_recipe():
    y = torch.zeros(1, 32)
    y[0, :16] = torch.tensor([6.0, -3.0, 1.0, 0.5] + [0.0] * 12)
    codes, sf = quantize_ref(y, Q.nvfp4(1.0, swizzled=False))
    assert sf.view(torch.uint8).tolist() == [[0x38, 0x00]]  # e4m3(1 * 6 / 6) = 1.0; zero block: scale 0
    assert codes[0, :2].tolist() == [0x7 | (0xD << 4), 0x2 | (0x1 << 4)]  # (6, -3), (1, 0.5): low nibble first
    assert codes[0, 8:].tolist() == [0] * 8


def test_epilogue_reference_with_normed():
    s, r = small_integer_inputs(0, 4, 64, torch.bfloat16), small_integer_inputs(1, 4, 64, torch.bfloat16)
    w = small_integer_inputs(2, 1, 64, torch.bfloat16)[0]
    out = residual_rmsnorm_quant_ref(s, r, w, 1e-6, Q.fp8_per_token(with_normed=True))
    normed, new_res = tpfuse.residual_rmsnorm_ref(s, r, w, 1e-6)
    assert torch.equal(out.normed, normed) and torch.equal(out.residual, new_res)
    assert residual_rmsnorm_quant_ref(s, r, w, 1e-6, Q.fp8_per_token()).normed is None
