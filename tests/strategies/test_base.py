"""Admission's needs (`tpfuse.strategies.base.check_needs`) checked against probed facts: each unmet
need gives the reason that says which check failed, and met needs are admitted."""

import dataclasses

import pytest

from support.caps import fake_caps
from tpfuse.probe.capabilities import PackageStatus
from tpfuse.spec import GroupFacts, Needs, Op, Problem
from tpfuse.strategies.base import check_needs

CPU_GROUP = GroupFacts(world_size=2, backend="gloo", device_type="cpu", devices=("cpu", "cpu"))
GPU_GROUP = GroupFacts(world_size=2, backend="nccl", device_type="cuda", devices=("GPU-0", "GPU-1"), peer_access=True)


def _problem(group, hidden=6144, tokens=8, dtype="bfloat16"):
    return Problem(Op.ALL_REDUCE_RESIDUAL_RMSNORM, tokens, hidden, dtype, group)


@pytest.mark.parametrize(
    "needs, group, caps, reason",
    [
        (Needs(cuda=True), CPU_GROUP, fake_caps(), "needs CUDA tensors; this group runs on cpu"),
        (Needs(cuda=True), GPU_GROUP, fake_caps(0), "needs a CUDA GPU; the probe found none"),
        (Needs(nccl=True), CPU_GROUP, fake_caps(), "needs the NCCL process-group backend; this group uses gloo"),
        (Needs(peer_access=True), dataclasses.replace(GPU_GROUP, peer_access=False), fake_caps(2), "needs peer access"),
        (Needs(single_host=True), dataclasses.replace(GPU_GROUP, num_hosts=2), fake_caps(2), "spans 2 hosts"),
        (Needs(package="flashinfer"), GPU_GROUP,
         fake_caps(2, [PackageStatus("flashinfer", False, reason="not installed")]),
         "needs the package 'flashinfer': not installed"),
        (Needs(package="flashinfer"), GPU_GROUP, fake_caps(2), "needs the package 'flashinfer': not probed"),
        (Needs(hidden_multiple=8), GPU_GROUP, fake_caps(2), "hidden size 6143 is not a multiple of 8"),
        (Needs(max_input_bytes=1024), GPU_GROUP, fake_caps(2), "exceeds the limit of 1024 bytes"),
        (Needs(dtypes=("bfloat16",)), GPU_GROUP, fake_caps(2), "dtype float32 not supported"),
        (Needs(ops=(Op.ALL_REDUCE,)), GPU_GROUP, fake_caps(2), "does not implement all_reduce_residual_rmsnorm"),
    ],
)
def test_each_unmet_need_gives_its_reason(needs, group, caps, reason):
    hidden = 6143 if needs.hidden_multiple > 1 else 6144
    dtype = "float32" if needs.dtypes == ("bfloat16",) else "bfloat16"
    verdict = check_needs(needs, _problem(group, hidden=hidden, dtype=dtype), caps)
    assert not verdict.ok and reason in verdict.reason


def test_met_needs_are_admitted():
    needs = Needs(cuda=True, nccl=True, peer_access=True, single_host=True, package="flashinfer", hidden_multiple=8)
    caps = fake_caps(2, [PackageStatus("flashinfer", True, "0.6.8")])
    assert check_needs(needs, _problem(GPU_GROUP), caps).ok
