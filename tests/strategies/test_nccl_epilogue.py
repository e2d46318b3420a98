"""The `nccl_epilogue` strategy (NCCL allreduce, then the epilogue kernel) on one GPU, and its
admission: any hidden alignment, a bounded hidden size."""

import pytest
import torch

from support.caps import fake_caps
from support.peer import GPU_ENV
from tpfuse.reference import (
    TOLERANCE,
    all_reduce_residual_rmsnorm_ref,
    random_inputs,
    relative_error,
    small_integer_inputs,
)
from tpfuse.spawn import run_ranks
from tpfuse.spec import GroupFacts, Op, Problem
from tpfuse.strategies import get_strategy


def _poison_cache(nbytes: int) -> None:
    """Leave NaN in the caching allocator's free blocks, so fresh outputs start as NaN."""
    torch.empty(nbytes // 4 + 1, dtype=torch.float32, device="cuda").fill_(float("nan"))


def _nccl_epilogue_rank(rank, world_size):
    from tpfuse import Communicator

    out = []
    with Communicator(strategy="nccl_epilogue") as comm:
        for kind, dtype in (("int", torch.bfloat16), ("rand", torch.float16)):
            make = small_integer_inputs if kind == "int" else random_inputs
            x, res, w = (make(r, 9, 6144, dtype, device="cuda") for r in (rank, 100, 101))
            _poison_cache(4 * 9 * 6144 * 4)
            normed, new_res = comm.all_reduce_residual_rmsnorm(x, res, w[0])
            out.append((kind, dtype, normed.cpu(), new_res.cpu()))
    return out


@pytest.mark.gpu
def test_nccl_epilogue_world_size_one():
    (out,) = run_ranks(_nccl_epilogue_rank, 1, backend="nccl", env=GPU_ENV, timeout_s=300)
    for kind, dtype, normed, new_res in out:
        make = small_integer_inputs if kind == "int" else random_inputs
        x, res, w = (make(r, 9, 6144, dtype) for r in (0, 100, 101))
        ref = all_reduce_residual_rmsnorm_ref([x], res, w[0])
        assert torch.equal(new_res, ref[1])
        if kind == "int":
            assert torch.equal(normed, ref[0])
        else:
            ref64 = all_reduce_residual_rmsnorm_ref([x], res, w[0], acc_dtype=torch.float64)[0]
            assert relative_error(normed, ref64) <= TOLERANCE[dtype]


NCCL = GroupFacts(world_size=4, backend="nccl", device_type="cuda", devices=tuple(f"GPU-{i}" for i in range(4)),
                  peer_access=True)


def _problem(group, tokens=8, hidden=6144, dtype="bfloat16", op=Op.ALL_REDUCE_RESIDUAL_RMSNORM):
    return Problem(op, tokens, hidden, dtype, group)


def test_nccl_epilogue_takes_any_alignment_but_bounds_hidden():
    cls = get_strategy("nccl_epilogue")
    assert cls.admits(_problem(NCCL, hidden=6148), fake_caps(4)).ok  # the epilogue kernel masks any H
    verdict = cls.admits(_problem(NCCL, hidden=20480), fake_caps(4))
    assert not verdict.ok and "exceeds 16384" in verdict.reason


def test_without_triton_the_reason_names_both_install_commands(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    for name in ("nccl_epilogue", "oneshot", "twoshot"):
        verdict = get_strategy(name).admits(_problem(NCCL), fake_caps(4))
        assert not verdict.ok
        assert "`pip install 'tpfuse[triton]'` (from a checkout: `pip install '.[triton]'`)" in verdict.reason, name


class _Group:
    """A process group stand-in: its allreduce doubles the tensor (two ranks of equal inputs) and
    returns `work`, as NCCL returns no work for a call it ran on the caller's stream."""

    def __init__(self, work):
        self.work, self.options = work, []

    def allreduce(self, tensors, options):
        self.options.append(options)
        tensors[0].mul_(2)
        return self.work


class _Work:
    waited = 0

    def wait(self):
        _Work.waited += 1
        return True


@pytest.mark.parametrize("work", [None, _Work()], ids=["no work (NCCL, caller's stream)", "a work to wait on"])
def test_all_reduce_enters_the_group_once_out_of_place_and_waits_only_on_a_work(work):
    from tpfuse.strategies.base import StrategyContext

    group = _Group(work)
    ctx = StrategyContext(group=group, rank=0, world_size=2, facts=NCCL, caps=fake_caps(), device=torch.device("cpu"))
    strategy = get_strategy("nccl_epilogue")(ctx)
    x = random_inputs(0, 3, 64, torch.float32)
    before, waited = x.clone(), _Work.waited
    y = strategy.all_reduce(x)
    assert torch.equal(y, 2 * before) and torch.equal(x, before)  # out of place: the input is left alone
    assert len(group.options) == 1 and group.options[0].reduceOp == torch.distributed.ReduceOp.SUM
    assert _Work.waited == waited + (work is not None)
