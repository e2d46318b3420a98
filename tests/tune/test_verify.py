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


def test_a_revert_clears_the_bound_by_two_notches():
    from tpfuse.tune.verify import _NOTCH

    # d has median log(1.2) and an IQR of 0.1 over 25 rounds: one notch is 1.58 * 0.1 / 5.
    n, iqr = 25, 0.1
    half = _NOTCH * iqr / math.sqrt(n)
    d = [math.log(1.2) + iqr * (i / (n - 1) - 0.5) * 2 for i in range(n)]  # evenly spread: IQR = iqr
    base = [100.0] * n
    a = [100.0 * math.exp(x) for x in d]

    def verdict(margin):
        return judge(a, base, base, margin)

    # The bound just below the median less two notches: REVERT, with the threshold at bound + 2h.
    margin = math.exp(math.log(1.2) - 2 * half - 0.005) - 1
    v, ratio, threshold, _, _ = verdict(margin)
    assert v == "REVERT" and threshold == pytest.approx(math.exp(math.log(1 + margin) + 2 * half))
    # Between one and two notches above the bound: shown slower at one notch, not at two: KEEP.
    margin = math.exp(math.log(1.2) - 1.5 * half) - 1
    v, _, _, _, reason = verdict(margin)
    assert v == "KEEP" and reason.startswith("not shown slower")


def _instances_verify_times(rank, world_size):
    from tpfuse.tune.candidates import CandidatePool
    from tpfuse.tune.verify import verify_in_group

    asked = []
    get = CandidatePool.get

    def recording(self, name, **kw):
        instance = get(self, name, **kw)
        asked.append((name, kw.get("twin", False), id(instance)))
        return instance

    CandidatePool.get = recording
    report = verify_in_group("reference_copy", baseline="reference", hiddens=(H,), buckets=(2,), rounds=3)
    return report.verdict, asked


def test_the_a_vs_a_control_is_a_second_instance_of_the_baseline():
    verdict, asked = run_ranks(_instances_verify_times, 1, env=ENV, timeout_s=120)[0]
    assert verdict in ("KEEP", "REVERT")
    baseline = {i for name, twin, i in asked if name == "reference" and not twin}
    control = {i for name, twin, i in asked if name == "reference" and twin}
    candidate = {i for name, _, i in asked if name == "reference_copy"}
    # three instances: the candidate, the baseline and its twin, each one for the whole run
    assert len(baseline) == len(control) == len(candidate) == 1 and len(baseline | control | candidate) == 3


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
