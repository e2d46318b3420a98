"""The decision rules as pure functions: the do-no-harm guard (tune and lookup), explicit-override
warnings, the default choice's reasons, and verify's KEEP / REVERT rule with its noise band."""

import math
import random

import pytest

from tpfuse.dispatch.choice import choose, default_choice, guarded
from tpfuse.dispatch.table import DispatchTable, Entry
from tpfuse.spec import GroupFacts, Op, Problem, Verdict
from tpfuse.tune.tuner import decide
from tpfuse.tune.verify import judge

FUSED = {"oneshot", "twoshot"}


def is_fused(name):
    return name in FUSED


def _t(median):
    return {"median": median, "p20": median, "p80": median, "n": 9}


def _table(choice, times, rejected=None, margin=0.03, tokens=8):
    entry = Entry("all_reduce_residual_rmsnorm", "bfloat16", 64, tokens, choice, "measured", "reference",
                  {n: _t(t) for n, t in times.items()}, {}, rejected or {})
    return DispatchTable({}, {}, (entry,), {"margin": margin})


def _problem(tokens=5):
    facts = GroupFacts(world_size=2, backend="gloo", device_type="cpu")
    return Problem(Op.ALL_REDUCE_RESIDUAL_RMSNORM, tokens, 64, "bfloat16", facts)


ALL_OK = {n: Verdict.yes() for n in ("nccl_epilogue", "reference", "ring", "oneshot", "twoshot")}


def test_decide_chooses_fused_only_past_the_margin():
    assert decide({"reference": 100.0, "oneshot": 96.0}, 0.03, is_fused)[0] == "oneshot"  # 4% faster
    assert decide({"reference": 100.0, "oneshot": 98.0}, 0.03, is_fused)[0] == "reference"  # 2%: not enough
    assert decide({"reference": 100.0, "oneshot": 120.0}, 0.03, is_fused)[0] == "reference"
    # Among unfused strategies the fastest wins without a margin; the guard compares against it.
    choice, best_unfused, _ = decide({"reference": 100.0, "ring": 90.0, "oneshot": 88.0}, 0.03, is_fused)
    assert (choice, best_unfused) == ("ring", "ring")
    assert decide({"reference": 100.0, "ring": 90.0, "oneshot": 80.0}, 0.03, is_fused)[:2] == ("oneshot", "ring")


def test_lookup_guard_refuses_a_fused_choice_its_own_times_do_not_support():
    table = _table("oneshot", {"reference": 100.0, "oneshot": 99.0})  # e.g. a hand-edited table
    name, reason = guarded(table.entries[0], table.margin, is_fused)
    assert name == "reference" and "guard" in reason
    choice = choose(_problem(), ALL_OK, table=table, is_fused=is_fused)
    assert (choice.name, choice.source) == ("reference", "table")
    good = _table("oneshot", {"reference": 100.0, "oneshot": 90.0})
    assert choose(_problem(), ALL_OK, table=good, is_fused=is_fused).name == "oneshot"


def test_lookup_falls_back_to_the_default_when_the_choice_is_not_admitted_or_not_tuned():
    table = _table("oneshot", {"reference": 100.0, "oneshot": 50.0})
    verdicts = {**ALL_OK, "oneshot": Verdict.no("needs peer access"), "nccl_epilogue": Verdict.no("needs NCCL")}
    choice = choose(_problem(), verdicts, table=table, is_fused=is_fused)
    assert (choice.name, choice.source) == ("reference", "default") and "needs peer access" in choice.reason
    choice = choose(_problem(tokens=9), ALL_OK, table=table, is_fused=is_fused)  # beyond the tuned buckets
    assert choice.source == "default" and "no bucket" in choice.reason
    assert choose(_problem(), verdicts, table=None).source == "default"


def test_explicit_override_is_honoured_with_a_warning_when_measurements_contradict_it():
    table = _table("reference", {"reference": 100.0, "ring": 150.0, "oneshot": 101.0},
                   rejected={"twoshot": "failed correctness: rank 1: differs"})
    slow = choose(_problem(), ALL_OK, requested="ring", table=table, is_fused=is_fused)
    assert (slow.name, slow.source) == ("ring", "explicit") and "1.50x" in slow.warning
    broken = choose(_problem(), ALL_OK, requested="twoshot", table=table, is_fused=is_fused, requested_by="TPFUSE_STRATEGY")
    assert broken.name == "twoshot" and "failed the correctness check" in broken.warning and "TPFUSE_STRATEGY" in broken.reason
    close = choose(_problem(), ALL_OK, requested="oneshot", table=table, is_fused=is_fused)  # within the margin
    assert close.warning == ""
    with pytest.raises(ValueError, match="cannot run .* needs NCCL"):
        choose(_problem(), {**ALL_OK, "nccl_epilogue": Verdict.no("needs NCCL")}, requested="nccl_epilogue")


def _noisy(rng, n, scale, spread):
    return [scale * math.exp(rng.gauss(0, spread)) for _ in range(n)]


def test_judge_keeps_equal_reverts_slower_and_widens_with_noise():
    rng = random.Random(4)
    base, again = _noisy(rng, 30, 100, 0.02), _noisy(rng, 30, 100, 0.02)
    assert judge(_noisy(rng, 30, 100, 0.02), base, again, 0.03)[0] == "KEEP"
    assert judge(_noisy(rng, 30, 80, 0.02), base, again, 0.03)[4].startswith("faster")
    verdict, ratio, threshold, _, _ = judge(_noisy(rng, 30, 130, 0.02), base, again, 0.03)
    assert verdict == "REVERT" and ratio > threshold
    # The same 10% slowdown is REVERT on a quiet machine and KEEP when the machine is too noisy to tell.
    quiet = judge([110.0 + 0.1 * i for i in range(30)], [100.0] * 30, [100.0] * 30, 0.03)
    loud_b, loud_b2 = _noisy(rng, 30, 100, 0.5), _noisy(rng, 30, 100, 0.5)
    loud = judge([1.1 * b * math.exp(rng.gauss(0, 0.5)) for b in loud_b], loud_b, loud_b2, 0.03)
    assert quiet[0] == "REVERT" and loud[0] == "KEEP" and loud[2] > quiet[2]


def test_undecided_samples_ask_for_more_rounds_and_a_regression_must_be_shown():
    from tpfuse.tune.verify import settled

    rng = random.Random(7)
    base, again = [100.0] * 8, [100.0] * 8
    # 10% slower with a spread as wide as the effect: too few rounds to tell either way.
    a = [110.0 * math.exp(rng.gauss(0, 0.3)) for _ in range(8)]
    assert not settled(a, base, again, 0.03)
    verdict, _, _, _, reason = judge(a, base, again, 0.03)
    assert verdict == "KEEP" and reason.startswith("not shown slower")
    assert settled([100.0 + 0.01 * i for i in range(8)], base, again, 0.03)  # clearly equal
    assert settled([150.0 + 0.01 * i for i in range(8)], base, again, 0.03)  # clearly slower


def test_default_choice_explains_every_rejection():
    with pytest.raises(ValueError, match="a: needs CUDA; b: too big"):
        default_choice({"a": Verdict.no("needs CUDA"), "b": Verdict.no("too big")})
