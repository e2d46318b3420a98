"""The strategy registry (`tpfuse.strategies`): names, lazily imported classes, plugins named by
TPFUSE_STRATEGIES or `register` (a bad one is not admitted, with the reason, and breaks nothing
else; ranks agree on them), and admission over every strategy."""

import pytest

from support.caps import fake_caps
from tpfuse.dispatch.choice import default_choice
from tpfuse.spec import GroupFacts, Op, Problem, Verdict
from tpfuse.strategies import admission, get_strategy, register, strategy_names

CPU_GROUP = GroupFacts(world_size=2, backend="gloo", device_type="cpu", devices=("cpu", "cpu"))
GPU_GROUP = GroupFacts(world_size=2, backend="nccl", device_type="cuda", devices=("GPU-0", "GPU-1"), peer_access=True)


def _problem(group, hidden=6144, tokens=8, dtype="bfloat16"):
    return Problem(Op.ALL_REDUCE_RESIDUAL_RMSNORM, tokens, hidden, dtype, group)


def test_reference_is_admitted_everywhere_and_chosen_by_default():
    for group, caps in ((CPU_GROUP, fake_caps()), (GPU_GROUP, fake_caps(2))):
        verdicts = admission(_problem(group), caps, ["reference"])
        assert verdicts["reference"].ok
    assert default_choice({"reference": Verdict.yes()}).name == "reference"


def test_unknown_strategy_lists_the_registered_ones():
    with pytest.raises(ValueError, match="registered strategies: reference"):
        get_strategy("no-such-strategy")


def test_a_strategy_that_fails_to_import_is_not_admitted_with_the_import_error(monkeypatch):
    monkeypatch.setitem(__import__("tpfuse.strategies", fromlist=["_REGISTRY"])._REGISTRY, "broken",
                        "tpfuse.no_such_module:X")
    verdict = admission(_problem(CPU_GROUP), fake_caps(), ["broken"])["broken"]
    assert not verdict.ok and "cannot import tpfuse.no_such_module:X" in verdict.reason
    assert "broken" in strategy_names()


def test_register_rejects_a_malformed_target():
    with pytest.raises(ValueError, match="package.module:Class"):
        register("x", "no_colon_here")


def test_a_former_strategy_name_is_unknown():
    """`nccl_fused` was renamed `nccl_epilogue` before any release: the old name selects nothing."""
    with pytest.raises(ValueError, match="unknown strategy 'nccl_fused'"):
        get_strategy("nccl_fused")


def test_a_plugin_that_is_not_a_strategy_is_not_admitted_and_breaks_nothing_else(monkeypatch):
    monkeypatch.setenv("TPFUSE_STRATEGIES", "x=os:getcwd,y=os:no_such_name")
    verdicts = admission(_problem(CPU_GROUP), fake_caps())  # every strategy, as strategy="auto" asks
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
