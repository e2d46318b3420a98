"""The quantization formats (`tpfuse.quant`): the spec constructors refuse bad input, and admission
states each format's conversion path (hardware cvt or the software conversion, by compute
capability) in its reason (plain CPU tier)."""

import dataclasses

import pytest

from tpfuse import quant as Q
from tpfuse.probe.capabilities import Capabilities, CpuInfo, GpuInfo, Versions
from tpfuse.spec import GroupFacts, Op, Problem
from tpfuse.strategies import admission, get_strategy


@pytest.mark.parametrize("make, message", [
    (lambda: Q.fp8_per_group(100), "power of two >= 16"),
    (lambda: Q.fp8_per_group(128, layout="k"), "layout 'k'"),
    (lambda: Q.fp8_per_token(scale_ub=-1.0), "finite number > 0"),
])
def test_spec_constructors_refuse_bad_input(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def _caps(cc):
    gpu = GpuInfo(0, "Test GPU", "GPU-0", cc, 132, 232448, 60 << 20, 140 << 30, 700.0, 5, 16, None)
    return Capabilities((gpu,), (), Versions("3.11", "0.1.0"), (), CpuInfo("cpu", 2, None), nvml="test")


NCCL = GroupFacts(world_size=2, backend="nccl", device_type="cuda", devices=("GPU-0", "GPU-1"), peer_access=True)


@pytest.mark.parametrize("kind", Q.KINDS)
def test_admission_states_the_conversion_path(kind):
    problem = Problem(Op.ALL_REDUCE_RESIDUAL_RMSNORM, 8, 6144, "bfloat16", NCCL, quant=kind)
    for cc, fp8_words in (((9, 0), "hardware cvt"), ((8, 0), "software conversion")):
        verdicts = admission(problem, _caps(cc), ["reference", "nccl_epilogue", "nccl_eager", "oneshot", "twoshot"])
        assert verdicts["nccl_epilogue"].ok and fp8_words in verdicts["nccl_epilogue"].reason, (
            verdicts["nccl_epilogue"].reason)
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
