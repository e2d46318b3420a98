"""The tuner: `decide`'s margin rule as a pure function, and a tune for real on 2 gloo ranks over
CPU strategies, with the Communicator's use of the table it saves.

Spawned ranks find the test-only strategies through TPFUSE_STRATEGIES (tests/support/tune_test_strategies.py,
imported from the tests directory, on the path spawned processes inherit).
"""

import os
import warnings

import pytest
import torch

from support.tune_test_strategies import PLUGINS, SETUP_S, SLOW_SETUP_PLUGIN
from tpfuse.reference import all_reduce_residual_rmsnorm_ref, random_inputs
from tpfuse.spawn import run_ranks
from tpfuse.tune.tuner import decide

H = 64
BUCKETS = (1, 2, 4, 8)
ENV = {"TPFUSE_STRATEGIES": PLUGINS, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}


def _weight():
    return (1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16)


def _table_life_rank(rank, world_size, cache_root):
    from tpfuse import Communicator
    from tpfuse.dispatch.choice import DispatchWarning
    from tpfuse.dispatch.table import save, table_path
    from tpfuse.spec import Op
    from tpfuse.tune.tuner import TuneSpec, tune_in_group

    # One cache directory per rank, as on separate hosts, so ranks can hold different files.
    os.environ["TPFUSE_CACHE_DIR"] = os.path.join(cache_root, f"rank{rank}")
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Communicator() as comm:
            out["no_table"] = (comm.table, comm.strategy_for(Op.ALL_REDUCE_RESIDUAL_RMSNORM, 3, H, torch.bfloat16))
            comm.strategy_for(Op.ALL_REDUCE, 3, H, torch.bfloat16)
    out["no_table_warnings"] = [str(w.message) for w in caught if issubclass(w.category, DispatchWarning)]
    spec = TuneSpec(hiddens=(H,), buckets=BUCKETS, ops=("all_reduce_residual_rmsnorm",),
                    strategies=("reference", "ring", "slow_fused", "wrong_on_rank_one"),
                    rounds=20, confirm_rounds=20, warmup=2)
    table = tune_in_group(spec)
    path = save(table, table_path(table.fingerprint))
    out["table"] = table.to_json()

    x = random_inputs(rank, 5, H, torch.bfloat16)
    res = random_inputs(77, 5, H, torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Communicator() as comm:
            out["loaded_digest"] = comm.table.digest if comm.table is not None else None
            out["choice"] = comm.strategy_for(Op.ALL_REDUCE_RESIDUAL_RMSNORM, 5, H, torch.bfloat16)
            out["untuned"] = comm.strategy_for(Op.ALL_REDUCE_RESIDUAL_RMSNORM, 5, 2 * H, torch.bfloat16)
            out["result"] = comm.all_reduce_residual_rmsnorm(x, res, _weight())
        with Communicator(strategy="slow_fused") as comm:
            comm.all_reduce_residual_rmsnorm(x, res, _weight())
    out["override_warnings"] = [str(w.message) for w in caught if issubclass(w.category, DispatchWarning)]

    # Disagreeing digests: rank 1 holds a valid table with one choice changed. Every rank must fall back.
    if rank == 1:
        from dataclasses import replace

        first = table.entries[0]
        other = "reference" if first.choice == "ring" else "ring"  # a choice that really differs from the tuned one
        changed = replace(table, entries=(replace(first, choice=other),) + table.entries[1:])
        assert changed.digest != table.digest
        save(changed, path)
    with Communicator() as comm:
        out["disagree"] = (comm.table is None, comm.table_note,
                           comm.strategy_for(Op.ALL_REDUCE_RESIDUAL_RMSNORM, 1, H, torch.bfloat16).source)

    # A corrupt table is ignored with a warning, never a crash, and calls still work.
    path.write_text(path.read_text()[:100])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Communicator() as comm:
            out["corrupt"] = (comm.table is None, comm.table_note)
            out["corrupt_result"] = comm.all_reduce_residual_rmsnorm(x, res, _weight())
    out["corrupt_warnings"] = [str(w.message) for w in caught if issubclass(w.category, DispatchWarning)]
    return out


@pytest.mark.gloo
def test_tune_builds_one_table_that_every_rank_uses_or_every_rank_ignores(tmp_path):
    from tpfuse.dispatch.table import parse

    results = run_ranks(_table_life_rank, 2, args=(str(tmp_path),), env=ENV, timeout_s=240)
    tables = [parse(r["table"]) for r in results]
    assert tables[0].digest == tables[1].digest
    for entry in tables[0].entries:
        # Verify before time: the candidate wrong on rank 1 only is rejected (for every rank) and never timed.
        assert "rank 1" in entry.rejected["wrong_on_rank_one"] and "rank 0" not in entry.rejected["wrong_on_rank_one"]
        assert "wrong_on_rank_one" not in entry.times_us
        assert set(entry.times_us) == {"reference", "ring", "slow_fused"}
        # The do-no-harm guard: the fused candidate is several times slower, so it is never chosen.
        assert entry.choice in ("reference", "ring") and entry.best_unfused == entry.choice
        assert entry.median("slow_fused") > entry.median(entry.choice)

    xs = [random_inputs(r, 5, H, torch.bfloat16) for r in range(2)]
    ref = all_reduce_residual_rmsnorm_ref(xs, random_inputs(77, 5, H, torch.bfloat16), _weight())
    for r in results:
        table, choice = r["no_table"]
        assert table is None and (choice.name, choice.source) == ("reference", "default")
        assert len(r["no_table_warnings"]) == 1  # once, however many calls
        assert ("no dispatch table at" in r["no_table_warnings"][0]
                and "tpfuse tune --world-size 2" in r["no_table_warnings"][0])
        assert r["loaded_digest"] == tables[0].digest
        expected = tables[0].lookup("all_reduce_residual_rmsnorm", "bfloat16", H, 5)
        assert expected.tokens == 8
        assert (r["choice"].name, r["choice"].source) == (expected.choice, "table")
        assert r["untuned"].source == "default"
        for got, want in zip(r["result"], ref):
            assert (got.double() - want.double()).norm() / want.double().norm() < 8e-3
        assert any("slow_fused" in w and "remove the override" in w for w in r["override_warnings"])

        gone, note, source = r["disagree"]
        assert gone and "ranks hold different dispatch tables" in note and source == "default"

        gone, note = r["corrupt"]
        assert gone and "corrupt" in note
        assert any("corrupt" in w and "tpfuse tune" in w for w in r["corrupt_warnings"])
        for got, want in zip(r["corrupt_result"], ref):
            assert (got.double() - want.double()).norm() / want.double().norm() < 8e-3


# ---- the margin rule -----------------------------------------------------------------------------

FUSED = {"oneshot", "twoshot"}


def is_fused(name):
    return name in FUSED


def _budget_rank(rank, world_size):
    from support.tune_test_strategies import SlowSetup
    from tpfuse.tune.tuner import TuneSpec, tune_in_group

    spec = TuneSpec(hiddens=(H,), buckets=BUCKETS, ops=("all_reduce_residual_rmsnorm",),
                    strategies=("reference", "slow_setup"), rounds=3, confirm_rounds=3, warmup=1,
                    budget_s=2 * SETUP_S)
    table = tune_in_group(spec)
    return [e.tokens for e in table.entries], SlowSetup.prepared


@pytest.mark.gloo
def test_a_budget_is_spent_on_measuring_after_one_preparation_of_every_bucket():
    """A candidate whose preparation takes most of the budget (a cold compile) prepares every
    bucket at once, at the first, and the budget's prediction of the next bucket leaves that set-up
    out: every bucket is measured (a prediction of twice the first bucket, set-up included, would
    stop after it)."""
    env = {**ENV, "TPFUSE_STRATEGIES": f"{PLUGINS},{SLOW_SETUP_PLUGIN}"}
    for tokens, prepared in run_ranks(_budget_rank, 2, env=env, timeout_s=120):
        assert tokens == list(BUCKETS), tokens
        assert prepared == [BUCKETS], prepared  # one preparation, for every bucket


def test_decide_chooses_fused_only_past_the_margin():
    assert decide({"reference": 100.0, "oneshot": 96.0}, 0.03, is_fused)[0] == "oneshot"  # 4% faster
    assert decide({"reference": 100.0, "oneshot": 98.0}, 0.03, is_fused)[0] == "reference"  # 2%: not enough
    assert decide({"reference": 100.0, "oneshot": 120.0}, 0.03, is_fused)[0] == "reference"
    # Among unfused strategies the fastest wins without a margin; the guard compares against it.
    choice, best_unfused, _ = decide({"reference": 100.0, "ring": 90.0, "oneshot": 88.0}, 0.03, is_fused)
    assert (choice, best_unfused) == ("ring", "ring")
    assert decide({"reference": 100.0, "ring": 90.0, "oneshot": 80.0}, 0.03, is_fused)[:2] == ("oneshot", "ring")
