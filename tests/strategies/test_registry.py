"""Admission: needs checked against probed facts, reasons that say which check failed."""

import dataclasses

import pytest

from tpfuse.dispatch.choice import default_choice
from tpfuse.probe.capabilities import Capabilities, CpuInfo, GpuInfo, PackageStatus, Versions
from tpfuse.spec import GroupFacts, Needs, Op, Problem, Verdict
from tpfuse.strategies import admission, get_strategy, register, strategy_names
from tpfuse.strategies.base import check_needs


def _caps(num_gpus=0, packages=()):
    gpus = tuple(
        GpuInfo(i, "Test GPU", f"GPU-{i}", (12, 0), 188, 101376, 128 << 20, 96 << 30, 600.0, 5, 16, None)
        for i in range(num_gpus)
    )
    return Capabilities(gpus, (), Versions("3.11", "0.1.0"), tuple(packages), CpuInfo("cpu", 2, None), nvml="test")


CPU_GROUP = GroupFacts(world_size=2, backend="gloo", device_type="cpu", devices=("cpu", "cpu"))
GPU_GROUP = GroupFacts(world_size=2, backend="nccl", device_type="cuda", devices=("GPU-0", "GPU-1"), peer_access=True)


def _problem(group, hidden=6144, tokens=8, dtype="bfloat16"):
    return Problem(Op.ALL_REDUCE_RESIDUAL_RMSNORM, tokens, hidden, dtype, group)


def test_reference_is_admitted_everywhere_and_chosen_by_default():
    for group, caps in ((CPU_GROUP, _caps()), (GPU_GROUP, _caps(2))):
        verdicts = admission(_problem(group), caps, ["reference"])
        assert verdicts["reference"].ok
    assert default_choice({"reference": Verdict.yes()}).name == "reference"


@pytest.mark.parametrize(
    "needs, group, caps, reason",
    [
        (Needs(cuda=True), CPU_GROUP, _caps(), "needs CUDA tensors; this group runs on cpu"),
        (Needs(cuda=True), GPU_GROUP, _caps(0), "needs a CUDA GPU; the probe found none"),
        (Needs(nccl=True), CPU_GROUP, _caps(), "needs the NCCL process-group backend; this group uses gloo"),
        (Needs(peer_access=True), dataclasses.replace(GPU_GROUP, peer_access=False), _caps(2), "needs peer access"),
        (Needs(single_host=True), dataclasses.replace(GPU_GROUP, num_hosts=2), _caps(2), "spans 2 hosts"),
        (Needs(package="flashinfer"), GPU_GROUP, _caps(2, [PackageStatus("flashinfer", False, reason="not installed")]),
         "needs the package 'flashinfer': not installed"),
        (Needs(package="flashinfer"), GPU_GROUP, _caps(2), "needs the package 'flashinfer': not probed"),
        (Needs(hidden_multiple=8), GPU_GROUP, _caps(2), "hidden size 6143 is not a multiple of 8"),
        (Needs(max_input_bytes=1024), GPU_GROUP, _caps(2), "exceeds the limit of 1024 bytes"),
        (Needs(dtypes=("bfloat16",)), GPU_GROUP, _caps(2), "dtype float32 not supported"),
        (Needs(ops=(Op.ALL_REDUCE,)), GPU_GROUP, _caps(2), "does not implement all_reduce_residual_rmsnorm"),
    ],
)
def test_each_unmet_need_gives_its_reason(needs, group, caps, reason):
    hidden = 6143 if needs.hidden_multiple > 1 else 6144
    dtype = "float32" if needs.dtypes == ("bfloat16",) else "bfloat16"
    verdict = check_needs(needs, _problem(group, hidden=hidden, dtype=dtype), caps)
    assert not verdict.ok and reason in verdict.reason


def test_met_needs_are_admitted():
    needs = Needs(cuda=True, nccl=True, peer_access=True, single_host=True, package="flashinfer", hidden_multiple=8)
    caps = _caps(2, [PackageStatus("flashinfer", True, "0.6.8")])
    assert check_needs(needs, _problem(GPU_GROUP), caps).ok


def test_unknown_strategy_lists_the_registered_ones():
    with pytest.raises(ValueError, match="registered strategies: reference"):
        get_strategy("no-such-strategy")


def test_a_strategy_that_fails_to_import_is_not_admitted_with_the_import_error(monkeypatch):
    monkeypatch.setitem(__import__("tpfuse.strategies", fromlist=["_REGISTRY"])._REGISTRY, "broken", "tpfuse.no_such_module:X")
    verdict = admission(_problem(CPU_GROUP), _caps(), ["broken"])["broken"]
    assert not verdict.ok and "cannot import tpfuse.no_such_module:X" in verdict.reason
    assert "broken" in strategy_names()


def test_register_rejects_a_malformed_target():
    with pytest.raises(ValueError, match="package.module:Class"):
        register("x", "no_colon_here")


def test_default_choice_explains_every_rejection():
    with pytest.raises(ValueError, match="a: needs CUDA; b: too big"):
        default_choice({"a": Verdict.no("needs CUDA"), "b": Verdict.no("too big")})


def test_problem_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="dtype 'int8'"):
        Problem(Op.ALL_REDUCE, 1, 8, "int8", CPU_GROUP)


def test_a_former_strategy_name_is_unknown():
    """`nccl_fused` was renamed `nccl_epilogue` before any release: the old name selects nothing."""
    with pytest.raises(ValueError, match="unknown strategy 'nccl_fused'"):
        get_strategy("nccl_fused")


def test_a_plugin_that_is_not_a_strategy_is_not_admitted_and_breaks_nothing_else(monkeypatch):
    monkeypatch.setenv("TPFUSE_STRATEGIES", "x=os:getcwd,y=os:no_such_name")
    verdicts = admission(_problem(CPU_GROUP), _caps())  # every strategy, as strategy="auto" asks
    assert verdicts["reference"].ok and verdicts["ring"].ok
    assert not verdicts["x"].ok and verdicts["x"].reason == (
        "TPFUSE_STRATEGIES: strategy 'x' = os:getcwd is a builtin_function_or_method, not a "
        "tpfuse.strategies.base.Strategy subclass; name a Strategy subclass")
    assert not verdicts["y"].ok and "os has no 'no_such_name'" in verdicts["y"].reason
    with pytest.raises(ValueError, match="^TPFUSE_STRATEGIES: strategy 'x' = os:getcwd is a"):
        get_strategy("x")


def test_register_checks_its_target_is_a_strategy_when_called(monkeypatch):
    registry = __import__("tpfuse.strategies", fromlist=["_REGISTRY"])._REGISTRY
    monkeypatch.setattr("tpfuse.strategies._REGISTRY", dict(registry))
    with pytest.raises(ValueError, match="^register: strategy 'x' = os:getcwd is a builtin_function_or_method"):
        register("x", "os:getcwd")
    with pytest.raises(ImportError):
        register("x", "tpfuse.no_such_module:X")
    assert "x" not in strategy_names()
    register("again", "tpfuse.strategies.ring:RingStrategy")
    assert get_strategy("again").name == "ring"


def _plugin_spec_rank(rank, world_size, specs):
    import os

    import torch

    from tpfuse import Communicator

    os.environ["TPFUSE_STRATEGIES"] = specs[rank]
    try:
        with Communicator(strategy="auto") as comm:
            return ("ok", comm.all_reduce(torch.full((2, 8), float(rank + 1))).tolist())
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return (type(exc).__name__, str(exc))


@pytest.mark.gloo
@pytest.mark.parametrize("specs, outcome", [
    (["x=os:getcwd", "x=os:getcwd"], ("ok", [[3.0] * 8] * 2)),  # not a Strategy: not admitted, auto still works
    (["x=os:getcwd", "x=bad spec"], ("ValueError", "Communicator: on rank 1: TPFUSE_STRATEGIES: entry 'x=bad spec' "
                                                  "must look like name=package.module:Class")),
    (["", "x=os:getcwd"], ("ValueError", "Communicator: ranks disagree on plugins (rank 0: {}; rank 1: "
                                        "{'x': 'os:getcwd'}); set TPFUSE_STRATEGIES the same on every rank")),
], ids=["not-a-strategy-everywhere", "malformed-on-one-rank", "different-registries"])
def test_a_plugin_spec_is_agreed_across_ranks_and_a_bad_one_raises_the_reason_everywhere(specs, outcome):
    from tpfuse.spawn import run_ranks

    assert run_ranks(_plugin_spec_rank, 2, args=(specs,), timeout_s=120) == [outcome, outcome]


def test_the_strategies_known_to_need_cuda_before_import_are_those_that_declare_it():
    from tpfuse.strategies import _BUILT_IN, needs_cuda

    for name in _BUILT_IN:
        assert needs_cuda(name) is get_strategy(name).needs.cuda, name
    assert needs_cuda("no-such-strategy") is None
