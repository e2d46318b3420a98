"""The engine runtime without an engine: set-up agreed across ranks (one rank failing outside a
collective while the others are inside one), stand-down, the calibration into a saved table and
its reload, the per-call checks, the op's fallback, and TPFUSE_CALIBRATE's parsing."""

from __future__ import annotations

import pytest
import torch

from tpfuse import env
from tpfuse.reference import all_reduce_residual_rmsnorm_ref, small_integer_inputs
from tpfuse.spawn import run_ranks

H = 64


@pytest.mark.parametrize("value, want", [("", 15.0), ("1", 15.0), ("on", 15.0), ("0", None), ("off", None),
                                         ("30s", 30.0), (" 0.5S ", 0.5)])
def test_calibrate_switch(monkeypatch, value, want):
    monkeypatch.setenv("TPFUSE_CALIBRATE", value)
    assert env.calibrate_budget_s() == want


@pytest.mark.parametrize("value", ["2", "-1s", "0s", "fast", "infs", "nans"])
def test_calibrate_switch_rejects_other_values_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("TPFUSE_CALIBRATE", value)
    with pytest.raises(ValueError, match=r"^TPFUSE_CALIBRATE=.*: use 1 \(on, 15 s\), 0 \(off\) or a budget"):
        env.calibrate_budget_s()


def _group(name="tp:0"):
    import torch.distributed as dist

    from tpfuse.integrations.runtime import EngineGroup

    return EngineGroup(name, dist.new_group([0, 1]), dist.new_group([0, 1], backend="gloo"), "cpu")


def _agree_rank(rank, world_size):
    import torch.distributed as dist

    from tpfuse.integrations import runtime

    group = _group()

    def step():  # two object collectives, as the Communicator's constructor makes; rank 1 fails first
        if rank == 1:
            raise RuntimeError("broken on rank 1")
        for _ in range(2):
            box = [None] * world_size
            dist.all_gather_object(box, {"host": "h"}, group=group.cpu_group)
            _ = [b["host"] for b in box]

    _, error = runtime._attempt(step)
    first = runtime.agree(group, "creating the Communicator", error)
    second = runtime.agree(group, "the next step", "")  # the ranks are in step again afterwards
    return first, second


@pytest.mark.gloo
def test_agreement_meets_a_rank_that_failed_outside_the_others_collective():
    results = run_ranks(_agree_rank, 2, timeout_s=120)
    want = ("creating the Communicator failed on rank 1: RuntimeError: broken on rank 1", "")
    assert results[0] == results[1] == want


def _setup_rank(rank, world_size, cache, calibrate):
    import os

    import torch.distributed as dist

    from tpfuse.integrations import runtime

    os.environ["TPFUSE_CACHE_DIR"] = cache
    os.environ["TPFUSE_CALIBRATE"] = calibrate
    out = {}
    group = _group()
    out["served"] = runtime.prepare("vllm", group, hidden=H, dtype=torch.bfloat16, max_tokens=16, buckets=(1, 4, 32))
    out["table_tokens"] = sorted(e.tokens for e in runtime.state("tp:0").comm.table.entries) \
        if runtime.state("tp:0").comm is not None and runtime.state("tp:0").comm.table is not None else []
    x, res = small_integer_inputs(rank, 3, H, torch.bfloat16), small_integer_inputs(100, 3, H, torch.bfloat16)
    weight = small_integer_inputs(101, 1, H, torch.bfloat16)[0]
    op = torch.ops.tpfuse.engine_all_reduce_residual_rmsnorm
    out["served_call"] = op(x, res, weight, 1e-6, "tp:0")
    out["reasons"] = {
        "float16": runtime.unservable("tp:0", x.half(), res.half(), weight.half()),
        "tokens": runtime.unservable("tp:0", small_integer_inputs(rank, 17, H, torch.bfloat16), None, weight),
        "hidden": runtime.unservable("tp:0", x[:, :32], None, weight[:32]),
        "residual": runtime.unservable("tp:0", x, res.float(), weight),
        "weight": runtime.unservable("tp:0", x, res, weight[:32]),
        "unknown": runtime.unservable("tp:9", x, res, weight),
    }
    out["limit"] = runtime.prepared_tokens(["tp:0"])
    # A call tpfuse cannot serve, and no engine fallback registered: an error naming the fix, not data.
    try:
        op(x.half(), res.half(), weight.half(), 1e-6, "tp:0")
        out["no_fallback"] = "returned"
    except RuntimeError as exc:
        out["no_fallback"] = str(exc)

    def fallback(x, residual, weight, eps, name):  # an engine's own path: its allreduce, its norm
        reduced = x.float().clone()
        dist.all_reduce(reduced, group=group.device_group)
        reduced = reduced.to(x.dtype)
        new_residual = reduced if residual is None else (reduced.float() + residual.float()).to(x.dtype)
        return torch.full_like(x, 7.0), new_residual

    runtime.register_fallback("test", fallback)
    out["fallback_call"] = op(x.half(), res.half(), weight.half(), 1e-6, "tp:0")
    runtime._FALLBACKS.clear()
    runtime.close_all()
    out["limit_after_close"] = runtime.prepared_tokens(["tp:0"])
    return out


@pytest.mark.gloo
@pytest.mark.slow
def test_first_set_up_calibrates_and_saves_the_next_loads_it(tmp_path):
    cache = str(tmp_path / "cache")
    first = run_ranks(_setup_rank, 2, args=(cache, "1"), timeout_s=300)
    saved = sorted((tmp_path / "cache").glob("dispatch-*.json"))
    assert len(saved) == 1
    mtime = saved[0].stat().st_mtime_ns
    second = run_ranks(_setup_rank, 2, args=(cache, "1"), timeout_s=300)
    assert saved[0].stat().st_mtime_ns == mtime  # loaded, not measured again
    xs = [small_integer_inputs(r, 3, H, torch.bfloat16) for r in range(2)]
    res = small_integer_inputs(100, 3, H, torch.bfloat16)
    want = all_reduce_residual_rmsnorm_ref(xs, res, small_integer_inputs(101, 1, H, torch.bfloat16)[0])
    for out in first + second:
        assert out["served"] and out["table_tokens"] == [1, 4]  # 32 lies beyond max_tokens 16
        assert torch.equal(out["served_call"][0], want[0]) and torch.equal(out["served_call"][1], want[1])
        assert out["reasons"] == {"float16": "float16 x hidden 64 was not prepared",
                                  "tokens": "17 tokens exceed the 16 prepared",
                                  "hidden": "bfloat16 x hidden 32 was not prepared",
                                  "residual": "residual float32 (3, 64) does not match x",
                                  "weight": "weight bfloat16 (32,) does not match x",
                                  "unknown": "group tp:9 was not prepared"}
        assert out["limit"] == 16 and out["limit_after_close"] == 0
        assert out["no_fallback"].startswith("tpfuse::engine_all_reduce_residual_rmsnorm: group 'tp:0' has no "
                                             "Communicator (float16 x hidden 64 was not prepared) and no engine")
        normed, new_residual = out["fallback_call"]
        assert torch.equal(normed, torch.full_like(normed, 7.0))  # the engine's path ran, not tpfuse's
        assert torch.equal(new_residual, want[1].half())


@pytest.mark.gloo
def test_calibration_off_keeps_the_conservative_default_and_saves_nothing(tmp_path):
    results = run_ranks(_setup_rank, 2, args=(str(tmp_path / "cache"), "0"), timeout_s=300)
    assert not list((tmp_path / "cache").glob("dispatch-*.json"))
    for out in results:
        assert out["served"] and out["table_tokens"] == []


def _one_rank_bad_switch(rank, world_size, cache):
    import os

    from tpfuse.integrations import runtime

    os.environ["TPFUSE_CACHE_DIR"] = cache
    os.environ["TPFUSE_CALIBRATE"] = "soon" if rank == 1 else "1"
    group = _group()
    served = runtime.prepare("sglang", group, hidden=H, dtype=torch.bfloat16, max_tokens=8, buckets=(1, 2))
    return served, runtime.down_reason("tp:0"), runtime.prepared_tokens(["tp:0"])


@pytest.mark.gloo
def test_a_bad_switch_on_one_rank_stands_every_rank_down(tmp_path):
    results = run_ranks(_one_rank_bad_switch, 2, args=(str(tmp_path / "cache"),), timeout_s=300)
    assert results[0] == results[1]
    served, reason, limit = results[0]
    assert not served and limit == 0
    assert reason == ("calibration failed on every rank: ValueError: rank 1: TPFUSE_CALIBRATE='soon': use 1 "
                      "(on, 15 s), 0 (off) or a budget in seconds such as 30s")
