"""Admission of nccl_epilogue, oneshot and twoshot from capabilities, with reasons; workspace facts.

Plain CPU tier: no kernel runs here (the interpreter tier and the GPU tier run them).
"""

import dataclasses

import pytest
import torch

from tpfuse.kernels.protocol import ERR_ABORTED, ERR_TIMEOUT
from tpfuse.probe.capabilities import Capabilities, CpuInfo, GpuInfo, Versions
from tpfuse.spec import GroupFacts, Op, Problem
from tpfuse.strategies import admission, get_strategy
from tpfuse.strategies.workspace import SENTINEL_BITS, PeerTimeoutError

NAMES = ["nccl_epilogue", "oneshot", "twoshot"]


def _caps(num_gpus):
    gpus = tuple(GpuInfo(i, "Test GPU", f"GPU-{i}", (12, 0), 188, 101376, 128 << 20, 96 << 30, 600.0, 5, 16, None)
                 for i in range(num_gpus))
    return Capabilities(gpus, (), Versions("3.11", "0.1.0"), (), CpuInfo("cpu", 2, None), nvml="test")


NCCL = GroupFacts(world_size=4, backend="nccl", device_type="cuda", devices=tuple(f"GPU-{i}" for i in range(4)), peer_access=True)
SHARED = GroupFacts(world_size=2, backend="gloo", device_type="cuda", devices=("GPU-0", "GPU-0"), peer_access=True, shares_device=True)
CPU = GroupFacts(world_size=2, backend="gloo", device_type="cpu", devices=("cpu", "cpu"))


def _problem(group, tokens=8, hidden=6144, dtype="bfloat16", op=Op.ALL_REDUCE_RESIDUAL_RMSNORM):
    return Problem(op, tokens, hidden, dtype, group)


def test_all_admitted_on_nccl_gpus_with_peer_access():
    verdicts = admission(_problem(NCCL), _caps(4), NAMES)
    assert all(v.ok for v in verdicts.values()), verdicts
    assert get_strategy("oneshot").fused and get_strategy("twoshot").fused
    assert not get_strategy("nccl_epilogue").fused  # two kernels: the unfused baseline


def test_ranks_sharing_one_gpu_over_gloo_admit_peer_strategies_only():
    verdicts = admission(_problem(SHARED), _caps(1), NAMES)
    assert verdicts["oneshot"].ok and verdicts["twoshot"].ok
    assert "needs the NCCL process-group backend" in verdicts["nccl_epilogue"].reason


@pytest.mark.parametrize(
    "group, caps, problem_kw, reason",
    [
        (CPU, _caps(0), {}, "needs CUDA tensors"),
        (dataclasses.replace(NCCL, peer_access=False), _caps(4), {}, "needs peer access"),
        (dataclasses.replace(NCCL, num_hosts=2), _caps(4), {}, "spans 2 hosts"),
        (NCCL, _caps(4), {"hidden": 6148}, "rows of 12296 bytes are not a multiple of 16"),
        (NCCL, _caps(4), {"hidden": 6146, "dtype": "float32"}, "hidden % 4 == 0 for float32"),
        (NCCL, _caps(4), {"hidden": 20480}, "exceeds 16384"),
        (NCCL, _caps(4), {"tokens": 4096, "hidden": 8192}, "exceeds the limit of 16777216 bytes"),
        (NCCL, _caps(4), {"dtype": "float64"}, "dtype float64 not supported"),
    ],
)
def test_peer_strategies_refuse_with_the_reason(group, caps, problem_kw, reason):
    for name in ("oneshot", "twoshot"):
        verdict = get_strategy(name).admits(_problem(group, **problem_kw), caps)
        assert not verdict.ok and reason in verdict.reason, (name, verdict.reason)


def test_nccl_epilogue_takes_any_alignment_but_bounds_hidden():
    cls = get_strategy("nccl_epilogue")
    assert cls.admits(_problem(NCCL, hidden=6148), _caps(4)).ok  # the epilogue kernel masks any H
    verdict = cls.admits(_problem(NCCL, hidden=20480), _caps(4))
    assert not verdict.ok and "exceeds 16384" in verdict.reason


def test_plain_allreduce_is_admitted_too():
    for name in NAMES:
        assert get_strategy(name).admits(_problem(NCCL, op=Op.ALL_REDUCE), _caps(4)).ok


def test_sentinels_are_negative_zero():
    assert torch.tensor([SENTINEL_BITS[2]], dtype=torch.int16).view(torch.bfloat16).item() == 0.0
    assert str(torch.tensor([SENTINEL_BITS[2]], dtype=torch.int16).view(torch.float16).item()) == "-0.0"
    assert str(torch.tensor([SENTINEL_BITS[4]], dtype=torch.int32).view(torch.float32).item()) == "-0.0"


def test_timeout_error_names_the_ranks_and_the_fix():
    exc = PeerTimeoutError("oneshot", 0, ERR_TIMEOUT, [2, 3], row=5, call=17, timeout_s=5.0)
    text = str(exc)
    assert isinstance(exc, RuntimeError) and exc.ranks == [2, 3]
    assert text.startswith("oneshot: rank 0 waited 5 s for data from rank(s) 2, 3")
    assert "Close the Communicator" in text and "TPFUSE_TIMEOUT_S" in text
    aborted = str(PeerTimeoutError("twoshot", 1, ERR_ABORTED, [0], row=0, call=3, timeout_s=5.0))
    assert aborted.startswith("twoshot: rank 1 stopped at call 3: rank(s) 0 gave up waiting first") and "NaN" in aborted
