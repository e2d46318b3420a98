"""The quantization references, the format specs, their validation and admission (plain CPU tier).

The reference is checked against definitions written out by hand here (grid values, ties, the
128x4 offset formula) and against torch's own float8_e4m3fn conversion, so that the kernels'
bit-exact tests compare against something independently right.
"""

import dataclasses

import pytest
import torch

import tpfuse
from tpfuse import quant as Q
from tpfuse.probe.capabilities import Capabilities, CpuInfo, GpuInfo, Versions
from tpfuse.reference import (
    _e2m1_codes,
    _e4m3_codes,
    quantize_ref,
    residual_rmsnorm_quant_ref,
    small_integer_inputs,
    swizzle_128x4,
)
from tpfuse.spec import GroupFacts, Op, Problem
from tpfuse.strategies import admission, get_strategy
from tpfuse.validation import check_quant

E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e4m3_reference_equals_torch_conversion_in_range():
    # torch rounds to nearest even but maps values beyond 464 to NaN (no saturation), so compare
    # on [-448, 448] with every binade, the subnormals and fp32 subnormals included.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=gen) * torch.exp2(torch.randint(-30, 10, (100_000,), generator=gen).float())
    x = torch.cat([x.clamp(-448, 448), torch.tensor([0.0, -0.0, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 1e-40, -1e-40, 448.0])])
    assert torch.equal(_e4m3_codes(x.double()), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_e4m3_ties_saturation_and_specials():
    finite = E4M3_VALUES[:0x7F]  # codes 0 .. 0x7E: 0 .. 448, increasing
    mids = (finite[1:] + finite[:-1]) / 2  # exact midpoints: ties go to the even code
    lower = torch.arange(0x7E)
    even = torch.where(lower % 2 == 0, lower, lower + 1).to(torch.uint8)
    assert torch.equal(_e4m3_codes(mids), even)
    assert torch.equal(_e4m3_codes(-mids), even | 0x80)
    special = torch.tensor([464.0, 1e30, float("inf"), -float("inf"), float("nan"), -float("nan"), -0.0, 2.0**-10, 3 * 2.0**-10])
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
    assert torch.equal(codes[1].float(), y[1]) and torch.equal(codes[0].view(torch.uint8), torch.zeros(8, dtype=torch.uint8))
    z = torch.cat([y.repeat(1, 2), y.repeat(1, 2) / 4], dim=1)  # two groups of 16 per row
    codes, scale = quantize_ref(z, Q.fp8_per_group(16))
    assert scale.tolist() == [[0.0, 0.0], [1.0, 0.25]]
    assert torch.equal(codes.float(), y.repeat(1, 4))
    _, ub = quantize_ref(y, Q.fp8_per_token(scale_ub=0.5))
    assert ub.tolist() == [[0.0], [0.5]]
    _, col = quantize_ref(torch.randn(5, 64), Q.fp8_per_group(16, layout="col"))
    assert col.shape == (5, 4) and col.stride() == (1, 8)  # M padded to a multiple of 4


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


@pytest.mark.parametrize("make, message", [
    (lambda: Q.fp8_per_group(100), "power of two >= 16"),
    (lambda: Q.fp8_per_group(128, layout="k"), "layout 'k'"),
    (lambda: Q.fp8_per_token(scale_ub=-1.0), "finite number > 0"),
])
def test_spec_constructors_refuse_bad_input(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("quant, hidden, exc, message", [
    (Q.fp8_per_group(128), 6000, ValueError, "not a multiple of 128"),
    (Q.nvfp4(1.0), 6152, ValueError, "not a multiple of 16"),
    (Q.fp8_static(torch.ones(2)), 64, TypeError, "one element"),
    (Q.fp8_static(0.0), 64, ValueError, "finite number > 0"),
    ("fp8", 64, TypeError, "must be a tpfuse.QuantSpec"),
    (Q.QuantSpec("fp4", 16), 64, ValueError, "is not a format"),
    (Q.QuantSpec("nvfp4", 16, "row", scale=1.0), 64, ValueError, "layout 'row' is not a format"),
    (Q.QuantSpec("fp8_per_group", 24), 48, ValueError, "power of two"),
])
def test_check_quant_names_the_problem(quant, hidden, exc, message):
    with pytest.raises(exc, match=message):
        check_quant("op", quant, hidden, device=torch.device("cpu"))


def _caps(cc):
    gpu = GpuInfo(0, "Test GPU", "GPU-0", cc, 132, 232448, 60 << 20, 140 << 30, 700.0, 5, 16, None)
    return Capabilities((gpu,), (), Versions("3.11", "0.1.0"), (), CpuInfo("cpu", 2, None), nvml="test")


NCCL = GroupFacts(world_size=2, backend="nccl", device_type="cuda", devices=("GPU-0", "GPU-1"), peer_access=True)


@pytest.mark.parametrize("kind", Q.KINDS)
def test_admission_states_the_conversion_path(kind):
    problem = Problem(Op.ALL_REDUCE_RESIDUAL_RMSNORM, 8, 6144, "bfloat16", NCCL, quant=kind)
    for cc, fp8_words in (((9, 0), "hardware cvt"), ((8, 0), "software conversion")):
        verdicts = admission(problem, _caps(cc), ["reference", "nccl_epilogue", "nccl_eager", "oneshot", "twoshot"])
        assert verdicts["nccl_epilogue"].ok and fp8_words in verdicts["nccl_epilogue"].reason, verdicts["nccl_epilogue"].reason
        if kind == "nvfp4":
            assert "e2m1 by the software conversion" in verdicts["nccl_epilogue"].reason
        assert verdicts["reference"].ok and verdicts["nccl_eager"].ok
        for name in ("oneshot", "twoshot"):  # the peer allreduce, then the quantizing epilogue
            assert verdicts[name].ok and fp8_words in verdicts[name].reason, verdicts[name].reason


def test_e2m1_hardware_cvt_from_compute_capability_10():
    problem = Problem(Op.ALL_REDUCE_RESIDUAL_RMSNORM, 8, 6144, "bfloat16", NCCL, quant="nvfp4")
    for cc in ((10, 0), (12, 0)):
        reason = get_strategy("nccl_epilogue").admits(problem, _caps(cc)).reason
        assert "e2m1 by the hardware cvt" in reason and "e4m3 by the hardware cvt" in reason, reason


def test_unquantized_problems_are_unchanged():
    problem = Problem(Op.ALL_REDUCE_RESIDUAL_RMSNORM, 8, 6144, "bfloat16", NCCL)
    assert get_strategy("oneshot").admits(problem, _caps((9, 0))).ok
    assert dataclasses.replace(problem, quant="nvfp4").quant == "nvfp4"
