"""The start-up calibration end to end: a first start with no table on 2 ranks calibrates within the
budget and saves the table; a start after the table holds every bucket loads it without measuring
(the second, when the first start's budget reached every bucket). CPU form over gloo; GPU
form with the 2 ranks sharing one GPU (gloo group, device="cuda"; the peer strategies are
candidates there, NCCL refuses two ranks on one GPU).

    python -m pytest -q -p no:cacheprovider tests/integrations/test_calibrate.py    # both forms
"""

from __future__ import annotations

import re

import pytest
import torch

from tpfuse.env import CALIBRATE_DEFAULT_S
from tpfuse.reference import all_reduce_residual_rmsnorm_ref, small_integer_inputs
from tpfuse.spawn import run_ranks

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
GPU_ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NCCL_NVLS_ENABLE": "0", "TPFUSE_TIMEOUT_S": "20"}


def _start(rank, world_size, cache, device, hidden):
    import logging
    import os
    import time

    import torch.distributed as dist

    from tpfuse.integrations import runtime

    os.environ["TPFUSE_CACHE_DIR"] = cache
    if device == "cuda":
        torch.cuda.set_device(0)
    log = []
    handler = logging.Handler()
    handler.emit = lambda record: log.append(record.getMessage())
    logging.getLogger("tpfuse.integrations").addHandler(handler)
    logging.getLogger("tpfuse.integrations").setLevel(logging.INFO)
    group = runtime.EngineGroup("tp:0", dist.new_group([0, 1]), dist.new_group([0, 1], backend="gloo"), device)
    started = time.perf_counter()
    served = runtime.prepare("vllm", group, hidden=hidden, dtype=torch.bfloat16, max_tokens=64, buckets=BUCKETS)
    seconds = time.perf_counter() - started
    comm = runtime.state("tp:0").comm
    if comm is None:  # stood down: the log says why, and the caller's assertion shows it
        runtime.close_all()
        return {"served": served, "log": log}
    chosen = {t: comm.strategy_for("all_reduce_residual_rmsnorm", t, hidden, torch.bfloat16).name for t in BUCKETS}
    x = small_integer_inputs(rank, 24, hidden, torch.bfloat16, device=device)
    res = small_integer_inputs(100, 24, hidden, torch.bfloat16, device=device)
    weight = small_integer_inputs(101, 1, hidden, torch.bfloat16, device=device)[0]
    got = torch.ops.tpfuse.engine_all_reduce_residual_rmsnorm(x, res, weight, 1e-6, "tp:0")
    comm.check()
    dist.barrier()
    runtime.close_all()
    return {"served": served, "seconds": seconds, "log": log, "chosen": chosen,
            "table_tokens": sorted(e.tokens for e in comm.table.entries) if comm.table is not None else [],
            "out": tuple(t.cpu() for t in got)}


def _calibrated(out) -> tuple[str, float] | None:
    """(the buckets one start measured, as its log lists them; seconds it spent), or None."""
    before = [m for m in out["log"] if m.startswith("tpfuse: calibrating vllm group tp:0 ")]
    after = [m for m in out["log"] if m.startswith("tpfuse: calibrated vllm group tp:0")]
    if not before and not after:
        return None
    assert len(before) == len(after) == 1, out["log"]
    spent = float(re.search(r" in ([0-9.]+) s, saved to ", after[0]).group(1))
    return re.search(r"bucket\(s\) \(([0-9, ]+)\)", before[0]).group(1), spent


def _starts(tmp_path, device, hidden, env=None):
    """Starts on one cache directory until one loads the table without measuring: each start
    before it measures, within the budget, exactly the buckets the table lacks (smallest first: all
    of them when the budget reaches them, the rest at the next start), and the last one measures
    nothing, leaving the file untouched. Every start's output is the reference's bits."""
    cache = tmp_path / "cache"
    xs = [small_integer_inputs(r, 24, hidden, torch.bfloat16) for r in range(2)]
    want = all_reduce_residual_rmsnorm_ref(xs, small_integer_inputs(100, 24, hidden, torch.bfloat16),
                                           small_integer_inputs(101, 1, hidden, torch.bfloat16)[0])
    starts, have = [], []
    for _ in range(len(BUCKETS) + 1):
        written = [p.stat().st_mtime_ns for p in sorted(cache.glob("dispatch-*.json"))]
        results = run_ranks(_start, 2, args=(str(cache), device, hidden), env=env, timeout_s=500)
        for out in results:
            assert out["served"], "\n".join(out["log"])  # a string: pytest shortens a list
            # small-integer sums are exact: every strategy gives the reference's bits
            assert torch.equal(out["out"][0], want[0]) and torch.equal(out["out"][1], want[1])
            assert out["table_tokens"] == results[0]["table_tokens"] and out["chosen"] == results[0]["chosen"]
        starts.append(results)
        measured = [_calibrated(out) for out in results]
        if measured[0] is None:  # loaded, not measured: nothing written
            assert measured == [None, None] and have == list(BUCKETS), (have, results[0]["log"])
            assert [p.stat().st_mtime_ns for p in sorted(cache.glob("dispatch-*.json"))] == written
            assert results[0]["chosen"] == starts[-2][0]["chosen"]  # the same measured choices
            return starts
        for listed, spent in measured:
            assert listed == ", ".join(str(b) for b in BUCKETS if b not in have), (have, listed)
            assert spent <= CALIBRATE_DEFAULT_S, (spent, results[0]["log"])  # within the budget
        grown = results[0]["table_tokens"]
        assert grown == list(BUCKETS)[:len(grown)] and len(grown) > len(have), (have, grown)  # smallest first
        have = grown
    raise AssertionError(f"no start loaded the table without measuring: {have}")


@pytest.mark.gloo
def test_first_start_calibrates_within_budget_and_the_second_loads_the_table_cpu(tmp_path):
    starts = _starts(tmp_path, "cpu", 64)
    assert len(starts) == 2  # CPU buckets are quick: the first start's budget reaches them all


@pytest.mark.gpu
def test_first_start_calibrates_within_budget_and_the_second_loads_the_table_shared_gpu(tmp_path):
    """The peer strategies compile one kernel variant per plan, every bucket's at the first bucket,
    concurrently: run on a cold kernel cache (a fresh TRITON_CACHE_DIR), the first start's budget
    still reaches every bucket and the second start loads the table."""
    starts = _starts(tmp_path, "cuda", 4096, env=GPU_ENV)
    print(f"starts until the table was complete: {len(starts) - 1}; the log of each first rank:")
    for results in starts:
        print("\n".join(results[0]["log"]))
    assert len(starts) == 2, "\n".join(line for results in starts for line in results[0]["log"])


def _one_rank_fails_rank(rank, world_size, cache):
    import os

    import torch.distributed as dist

    from tpfuse.integrations import runtime

    os.environ["TPFUSE_CACHE_DIR"] = cache
    group = runtime.EngineGroup("tp:0", dist.new_group([0, 1]), dist.new_group([0, 1], backend="gloo"), "cpu")
    served = runtime.prepare("vllm", group, hidden=64, dtype=torch.bfloat16, max_tokens=8, buckets=(1, 2, 4, 8))
    reason = runtime.state("tp:0").down
    runtime.close_all()
    return served, reason


@pytest.mark.gloo
def test_a_rank_failing_mid_calibration_stands_every_rank_down_naming_the_cause_first(tmp_path):
    """Rank 1 fails inside the measurement; rank 0, left in a collective with it, loses its peer.
    Every rank stands down with one reason, and the reason leads with rank 1's own error, not with
    the PeerLostError that follows from it."""
    env = {"TPFUSE_STRATEGIES": "raises_on_rank_one_later=support.raising_strategy:RaisesOnRankOneLater",
           "TPFUSE_TIMEOUT_S": "5"}
    results = run_ranks(_one_rank_fails_rank, 2, args=(str(tmp_path / "cache"),), env=env, timeout_s=200)
    assert results[0] == results[1]
    served, reason = results[0]
    assert not served
    assert reason.startswith("calibration failed on rank 1: RuntimeError: raises_on_rank_one_later: rank 1 failed "
                             "on the device"), reason
    assert "; rank 0: PeerLostError: " in reason, reason
    assert not list((tmp_path / "cache").glob("dispatch-*.json"))  # nothing measured is saved
