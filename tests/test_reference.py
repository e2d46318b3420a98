"""The references against independent float64 math, and their documented rounding points."""

import pytest
import torch

from tpfuse.reference import (
    TOLERANCE,
    all_reduce_ref,
    all_reduce_residual_rmsnorm_ref,
    random_inputs,
    relative_error,
    residual_rmsnorm_ref,
    small_integer_inputs,
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
    assert torch.equal(normed, torch.from_numpy(hn * inv * wn))


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
