"""verify, the speed A/B: `judge`'s KEEP / REVERT rule with its noise band and `settled` as pure
functions, and verify_in_group for real on 2 gloo ranks over CPU strategies (a slower strategy is
REVERT, an equal one KEEP, a wrong one REVERT for failing correctness; the default baseline is the
fastest correct unfused strategy).

Spawned ranks find the test-only strategies through TPFUSE_STRATEGIES (tests/support/tune_test_strategies.py,
imported from the tests directory, on the path spawned processes inherit).
"""

import math
import os
import random

import pytest

from support.tune_test_strategies import PLUGINS
from tpfuse.spawn import run_ranks
from tpfuse.tune.verify import judge

H = 64
ENV = {"TPFUSE_STRATEGIES": PLUGINS, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}


def _verify_rank(rank, world_size):
    from tpfuse.tune.verify import verify_in_group

    slower = verify_in_group("slow_broadcast", baseline="reference", hiddens=(H,), buckets=(1, 8), rounds=20)
    # Default baseline: the fastest correct unfused strategy (never the one that is wrong on rank 1).
    default = verify_in_group("slow_broadcast", hiddens=(H,), buckets=(2,), rounds=3)
    equal = verify_in_group("reference_copy", baseline="reference", hiddens=(H,), buckets=(1, 8), rounds=40)
    wrong = verify_in_group("wrong_on_rank_one", baseline="reference", hiddens=(H,), buckets=(2,), rounds=4)
    return slower.to_dict(), equal.to_dict(), wrong.to_dict(), default.baseline


@pytest.mark.gloo
def test_verify_reverts_a_slower_strategy_and_keeps_an_equal_one():
    slower, equal, wrong, default_baseline = run_ranks(_verify_rank, 2, env=ENV, timeout_s=240)[0]
    assert default_baseline in ("reference", "ring", "reference_copy")
    assert slower["verdict"] == "REVERT", slower
    assert all(b["verdict"] == "REVERT" and b["ratio"] > b["threshold"] > 1.03 for b in slower["buckets"]), slower
    assert equal["verdict"] == "KEEP", equal
    assert all(b["threshold"] > 1.03 for b in equal["buckets"])
    assert wrong["verdict"] == "REVERT" and "failed correctness" in wrong["buckets"][0]["reason"]


# ---- the KEEP / REVERT rule ----------------------------------------------------------------------

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
