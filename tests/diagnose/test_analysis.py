"""Analysis on synthetic recordings: each finding present and absent, and the summary statistics
against an independent numpy computation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tpfuse.diagnose import analysis
from tpfuse.diagnose.samples import Recording, Sample

from .synth import BUSY, GAPS, IDLE, LIMIT_W, WAITING, make_recording


def kinds(findings, gpu=None):
    return [f.kind for f in findings if gpu is None or gpu in f.gpus]


def test_summary_matches_numpy_reference():
    rec = make_recording({0: [(BUSY, 40), (WAITING, 60), (IDLE, 20)]}, seed=1)
    (s,) = analysis.summarise(rec)
    xs = rec.samples_of(0)
    power = np.array([x.power_w for x in xs])
    util = np.array([x.util_pct for x in xs])
    t = np.array([x.t_s for x in xs])
    active = util >= analysis.IDLE_UTIL_PCT
    frac = power / LIMIT_W
    waiting = (util >= analysis.WAIT_UTIL_PCT) & (frac <= analysis.WAIT_POWER_FRACTION)
    assert s.num_samples == 120
    assert s.active_share == pytest.approx(active.mean())
    assert s.util_mean_pct == pytest.approx(util.mean())
    assert s.util_p95_pct == pytest.approx(np.percentile(util, 95))
    assert s.power_mean_w == pytest.approx(power.mean())
    assert s.power_p50_w == pytest.approx(np.percentile(power, 50))
    assert s.power_p95_w == pytest.approx(np.percentile(power, 95))
    assert s.power_fraction_mean == pytest.approx(frac.mean())
    assert s.power_fraction_active == pytest.approx(frac[active].mean())
    assert s.waiting_share == pytest.approx(waiting[active].mean())
    assert s.energy_j == pytest.approx(np.trapezoid(power, t))
    assert s.sm_clock_mean_mhz == pytest.approx(np.mean([x.sm_clock_mhz for x in xs]))
    assert s.mem_used_max_bytes == max(x.mem_used_bytes for x in xs)
    assert (s.power_limit_w, s.sm_clock_max_mhz, s.name) == (LIMIT_W, 1980, "NVIDIA H200")


def test_waiting_signature_present():
    rec = make_recording({0: [(WAITING, 100)]}, seed=2)
    (s,) = analysis.summarise(rec)
    findings = analysis.find(rec)
    assert kinds(findings) == ["waiting"]
    (f,) = findings
    assert f.severity == "warn" and f.gpus == (0,)
    assert s.waiting_share == 1.0
    assert f.evidence["waiting_share"] == 1.0
    assert "waiting on communication" in f.message and "700 W" in f.message


def test_waiting_signature_absent_on_busy_gpu():
    rec = make_recording({0: [(BUSY, 100)]}, seed=3)
    (s,) = analysis.summarise(rec)
    findings = analysis.find(rec)
    assert kinds(findings) == ["busy"]
    assert findings[0].severity == "ok"
    assert s.waiting_share == 0.0
    assert s.power_fraction_active > analysis.WAIT_POWER_FRACTION


@pytest.mark.parametrize("num_waiting, expect_waiting", [(60, True), (40, False)])
def test_waiting_needs_most_of_the_active_time(num_waiting, expect_waiting):
    # Idle samples do not dilute the share: it is over active samples only.
    rec = make_recording({0: [(IDLE, 200), (WAITING, num_waiting), (BUSY, 100 - num_waiting)]}, seed=4)
    (s,) = analysis.summarise(rec)
    assert s.waiting_share == pytest.approx(num_waiting / 100)
    assert ("waiting" in kinds(analysis.find(rec))) is expect_waiting


def test_power_at_the_story_fraction_is_waiting_and_just_above_is_not():
    # The story: 250 W of 600 W (0.42) with kernels resident.
    def rec_at(power_w):
        s = [Sample(t_s=0.1 * k, gpu=0, power_w=power_w + 0.01 * (k % 3), power_limit_w=600.0, util_pct=97.0,
                    mem_util_pct=10.0, sm_clock_mhz=1800.0, mem_clock_mhz=3201.0, mem_used_bytes=1) for k in range(30)]
        return Recording(gpus=(), samples=tuple(s), interval_s=0.1, mode="duration")

    assert kinds(analysis.find(rec_at(250.0))) == ["waiting"]
    assert kinds(analysis.find(rec_at(600.0 * analysis.WAIT_POWER_FRACTION + 1.0))) == ["busy"]


def test_idle_gpu_beside_a_busy_one_is_a_warning():
    rec = make_recording({0: [(BUSY, 50)], 1: [(IDLE, 50)]}, seed=5)
    findings = analysis.find(rec)
    idle = [f for f in findings if f.kind == "idle"]
    assert [(f.gpus, f.severity) for f in idle] == [((1,), "warn")]
    assert kinds(findings, gpu=0) == ["busy"]
    # one active GPU: no cross-GPU comparison
    assert "uneven" not in kinds(findings)


def test_all_idle_is_information_not_a_warning():
    rec = make_recording({0: [(IDLE, 30)], 1: [(IDLE, 30)]}, seed=6)
    findings = analysis.find(rec)
    assert [(f.kind, f.severity) for f in findings] == [("idle", "info"), ("idle", "info")]


def test_uneven_power_across_ranks():
    low = ((92.0, 100.0), (330.0, 360.0))  # 0.47-0.51 of the limit: not waiting, but far below rank 0
    rec = make_recording({0: [(BUSY, 50)], 1: [(BUSY, 50)], 2: [(low, 50)]}, seed=7)
    findings = analysis.find(rec)
    uneven = [f for f in findings if f.kind == "uneven"]
    assert len(uneven) == 1 and uneven[0].evidence["metric"] == "power_fraction_mean"
    assert 2 in uneven[0].gpus
    assert uneven[0].evidence["spread"] > analysis.UNEVEN_POWER_SPREAD


def test_uneven_utilisation_across_ranks():
    rec = make_recording({0: [(BUSY, 50)], 1: [(GAPS, 50)]}, seed=8)
    uneven = [f for f in analysis.find(rec) if f.kind == "uneven"]
    assert [f.evidence["metric"] for f in uneven] == ["power_fraction_mean", "util_mean_pct"]
    assert uneven[1].gpus == (1, 0)


def test_even_ranks_are_not_uneven():
    rec = make_recording({g: [(BUSY, 50)] for g in range(8)}, seed=9)
    findings = analysis.find(rec)
    assert kinds(findings) == ["busy"] * 8


def test_gaps_when_kernels_leave_the_gpu_empty():
    rec = make_recording({0: [(GAPS, 50)]}, seed=10)
    (f,) = analysis.find(rec)
    assert (f.kind, f.severity) == ("gaps", "info")


def test_too_few_active_samples_are_not_judged():
    rec = make_recording({0: [(IDLE, 50), (WAITING, analysis.MIN_ACTIVE_SAMPLES - 1)]}, seed=11)
    (f,) = analysis.find(rec)
    assert (f.kind, f.severity) == ("unjudged", "info") and "too little to judge" in f.message


def test_unreadable_power_is_not_judged_and_does_not_crash():
    rec = make_recording({0: [(WAITING, 30)]}, seed=12, power_none=True)
    (s,) = analysis.summarise(rec)
    assert s.power_mean_w is None and s.waiting_share is None and s.energy_j is None
    (f,) = analysis.find(rec)
    assert f.kind == "unjudged" and "power was unreadable" in f.message


def test_a_gpu_without_samples_is_reported():
    rec = make_recording({0: [(BUSY, 20)], 1: []}, seed=13)
    assert kinds(analysis.find(rec), gpu=1) == ["no_samples"]


def test_quantile_is_linear_interpolation():
    xs = [float(x) for x in np.random.default_rng(0).uniform(0, 100, 37)]
    for q in (0.0, 0.2, 0.5, 0.95, 1.0):
        assert analysis.quantile(xs, q) == pytest.approx(np.percentile(xs, 100 * q))
    assert analysis.quantile([], 0.5) is None
    assert math.isclose(analysis.quantile([3.0], 0.95), 3.0)
