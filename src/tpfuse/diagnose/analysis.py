"""Pure functions from a Recording to per-GPU summaries and findings. No NVML, no I/O.

The signature the design story needs found: GPUs that run kernels almost all the time yet draw a
small part of their power limit (8 GPUs at about 250 W of 600 W while serving). NVML counts a GPU as
"utilised" whenever any kernel is resident, so a collective kernel that spins waiting for its peers,
or a stream of tiny kernels separated by launch gaps, reads as high utilisation with low power.
A GPU doing dense math near its limit reads as high utilisation with high power.

Thresholds are module constants; the comment on each says where its value came from. They are
defaults chosen against the story and against readings of one H200 (benchmarks/device/diagnose_workload.py,
rows in benchmarks/results/diagnose.jsonl), not tuned on a fleet; `thresholds()` reports them
with every analysis so a reader can judge a finding.
"""

from __future__ import annotations

import statistics

from tpfuse.diagnose.samples import Finding, GpuSummary, Recording, Sample

# A GPU with no work reads 0% utilisation; the driver's own housekeeping and a monitoring context
# can register a few percent. 5% separates "something ran" from "nothing ran"; it is the cut the
# issue specifies, not a measured boundary.
IDLE_UTIL_PCT = 5.0

# "Kernels resident most of the time". A collective spinning on a flag keeps a kernel resident for
# the whole period (100%); 70 leaves room for the launch gaps between back-to-back kernels and for
# NVML windows (1/6 s to 1 s) that straddle a phase edge.
WAIT_UTIL_PCT = 70.0

# "Low power". GPUs waiting on PCIe allreduces have been reported at about 250 W of 600 W, 0.42 of the limit; a GPU
# running dense bf16 GEMMs draws most of its limit, and one spinning in a single-block kernel little
# more than idle (both read on an H200: benchmarks/results/diagnose.jsonl). 0.45 sits just above the
# story's fraction and far below dense math.
WAIT_POWER_FRACTION = 0.45

# The waiting signature must describe most of the active time, not a phase such as start-up or a
# checkpoint save: at least half of the active samples.
WAIT_MIN_SHARE = 0.5

# Fewer active samples than this say nothing: NVML's power is a 1 s average on Ampere and newer,
# so the pattern needs at least a second of readings (10 at the default 100 ms interval).
MIN_ACTIVE_SAMPLES = 10

# Ranks of one tensor-parallel group run the same kernels in lock step on identical boards, so their
# mean power should agree to within the sensor's accuracy (NVML documents +/-5% of draw on older
# boards). A spread of 0.15 of the limit is three times that; 20 utilisation points means some
# ranks ran kernels that others did not (uneven expert load, extra work on rank 0).
UNEVEN_POWER_SPREAD = 0.15
UNEVEN_UTIL_SPREAD_PCT = 20.0


def thresholds() -> dict:
    """The constants every finding was judged by (reported with each analysis)."""
    return {
        "idle_util_pct": IDLE_UTIL_PCT,
        "wait_util_pct": WAIT_UTIL_PCT,
        "wait_power_fraction": WAIT_POWER_FRACTION,
        "wait_min_share": WAIT_MIN_SHARE,
        "min_active_samples": MIN_ACTIVE_SAMPLES,
        "uneven_power_spread": UNEVEN_POWER_SPREAD,
        "uneven_util_spread_pct": UNEVEN_UTIL_SPREAD_PCT,
    }


def quantile(values: list[float], q: float) -> float | None:
    """Linear-interpolated quantile (0 <= q <= 1) of `values`; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _known(samples: list[Sample], name: str) -> list:
    return [getattr(s, name) for s in samples if getattr(s, name) is not None]


def is_active(s: Sample) -> bool:
    return s.util_pct is not None and s.util_pct >= IDLE_UTIL_PCT


def is_waiting(s: Sample) -> bool:
    """High utilisation with low power: the story's signature, for one sample."""
    frac = s.power_fraction
    return s.util_pct is not None and frac is not None and s.util_pct >= WAIT_UTIL_PCT and frac <= WAIT_POWER_FRACTION


def _energy_j(samples: list[Sample]) -> float | None:
    pts = [(s.t_s, s.power_w) for s in samples if s.power_w is not None]
    if len(pts) < 2:
        return None
    return sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(pts, pts[1:]))


def summarise_gpu(rec: Recording, gpu: int) -> GpuSummary:
    meta = next((g for g in rec.gpus if g.index == gpu), None)
    samples = sorted(rec.samples_of(gpu), key=lambda s: s.t_s)
    active = [s for s in samples if is_active(s)]
    util = _known(samples, "util_pct")
    power = _known(samples, "power_w")
    limits = _known(samples, "power_limit_w")
    fracs = [s.power_fraction for s in samples if s.power_fraction is not None]
    fracs_active = [s.power_fraction for s in active if s.power_fraction is not None]
    judged = [s for s in active if s.power_fraction is not None]
    mem_used = _known(samples, "mem_used_bytes")
    target = _known(samples, "target_mem_bytes")
    return GpuSummary(
        gpu=gpu,
        name=meta.name if meta else f"GPU {gpu}",
        num_samples=len(samples),
        active_share=len(active) / len(samples) if samples else 0.0,
        util_mean_pct=_mean(util),
        util_p50_pct=quantile(util, 0.5),
        util_p95_pct=quantile(util, 0.95),
        mem_util_mean_pct=_mean(_known(samples, "mem_util_pct")),
        power_mean_w=_mean(power),
        power_p50_w=quantile(power, 0.5),
        power_p95_w=quantile(power, 0.95),
        # The enforced limit can change during a run (an administrator, a power-capping daemon);
        # the summary reports the median, each sample's fraction uses its own limit.
        power_limit_w=quantile(limits, 0.5),
        power_fraction_mean=_mean(fracs),
        power_fraction_active=_mean(fracs_active),
        waiting_share=(sum(map(is_waiting, judged)) / len(judged)) if judged else None,
        energy_j=_energy_j(samples),
        sm_clock_mean_mhz=_mean(_known(samples, "sm_clock_mhz")),
        sm_clock_max_mhz=meta.sm_clock_max_mhz if meta else None,
        mem_clock_mean_mhz=_mean(_known(samples, "mem_clock_mhz")),
        mem_clock_max_mhz=meta.mem_clock_max_mhz if meta else None,
        mem_used_max_bytes=max(mem_used) if mem_used else None,
        mem_total_bytes=meta.mem_total_bytes if meta else None,
        target_mem_max_bytes=max(target) if target else None,
    )


def summarise(rec: Recording) -> tuple[GpuSummary, ...]:
    """One summary per GPU of the recording, in GPU index order (GPUs with samples but no meta too)."""
    indices = sorted({g.index for g in rec.gpus} | {s.gpu for s in rec.samples})
    return tuple(summarise_gpu(rec, i) for i in indices)


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def _gpu_findings(s: GpuSummary, any_other_active: bool, num_active_samples: int) -> list[Finding]:
    if s.num_samples == 0:
        return [Finding("no_samples", "warn", (s.gpu,),
                        f"GPU {s.gpu}: no samples were read; see the recording's notes")]
    if s.util_mean_pct is None:
        return [Finding("no_samples", "warn", (s.gpu,), f"GPU {s.gpu}: NVML reported no utilisation; cannot judge it")]
    if s.util_mean_pct < IDLE_UTIL_PCT:
        evidence = {"util_mean_pct": s.util_mean_pct, "power_fraction_mean": s.power_fraction_mean}
        if any_other_active:
            return [Finding("idle", "warn", (s.gpu,),
                            f"GPU {s.gpu} was idle (mean utilisation {s.util_mean_pct:.1f}%) while other GPUs worked: "
                            "the workload did not use it (check CUDA_VISIBLE_DEVICES and the world size)", evidence)]
        return [Finding("idle", "info", (s.gpu,), f"GPU {s.gpu} was idle (mean utilisation {s.util_mean_pct:.1f}%)",
                        evidence)]
    if num_active_samples < MIN_ACTIVE_SAMPLES or s.waiting_share is None:
        why = "power was unreadable" if s.waiting_share is None else f"only {num_active_samples} active samples"
        return [Finding("unjudged", "info", (s.gpu,),
                        f"GPU {s.gpu}: too little to judge ({why}; need {MIN_ACTIVE_SAMPLES})",
                        {"active_samples": num_active_samples})]
    evidence = {"waiting_share": s.waiting_share, "power_fraction_active": s.power_fraction_active,
                "util_mean_pct": s.util_mean_pct, "power_limit_w": s.power_limit_w}
    if s.waiting_share >= WAIT_MIN_SHARE:
        return [Finding("waiting", "warn", (s.gpu,),
                        f"GPU {s.gpu}: kernels resident but power low in {_pct(s.waiting_share)} of active samples "
                        f"(utilisation >= {WAIT_UTIL_PCT:.0f}% at <= {_pct(WAIT_POWER_FRACTION)} of the "
                        f"{s.power_limit_w or 0:.0f} W limit; mean {_pct(s.power_fraction_active)} while active): "
                        "kernels are waiting on communication or on launches; time the collectives "
                        "(`tpfuse verify`) and look for serialized allreduces", evidence)]
    drawing = s.power_fraction_active is not None and s.power_fraction_active > WAIT_POWER_FRACTION
    if s.util_p50_pct is not None and s.util_p50_pct >= WAIT_UTIL_PCT and drawing:
        return [Finding("busy", "ok", (s.gpu,),
                        f"GPU {s.gpu}: busy and drawing power (median utilisation {s.util_p50_pct:.0f}%, "
                        f"{_pct(s.power_fraction_active)} of the limit while active)", evidence)]
    return [Finding("gaps", "info", (s.gpu,),
                    f"GPU {s.gpu}: active {_pct(s.active_share)} of the time, median utilisation "
                    f"{s.util_p50_pct:.0f}% at {_pct(s.power_fraction_active)} of the limit while active: "
                    "kernels leave gaps (host-bound or launch-bound work)", evidence)]


def _uneven(summaries: list[GpuSummary]) -> list[Finding]:
    out = []
    with_power = [s for s in summaries if s.power_fraction_mean is not None]
    if len(with_power) >= 2:
        lo = min(with_power, key=lambda s: s.power_fraction_mean)
        hi = max(with_power, key=lambda s: s.power_fraction_mean)
        spread = hi.power_fraction_mean - lo.power_fraction_mean
        if spread > UNEVEN_POWER_SPREAD:
            out.append(Finding("uneven", "warn", (lo.gpu, hi.gpu),
                               f"uneven ranks: mean power spans {_pct(lo.power_fraction_mean)} (GPU {lo.gpu}) to "
                               f"{_pct(hi.power_fraction_mean)} (GPU {hi.gpu}) of the limit; ranks that should work in "
                               "lock step do not (uneven load, or extra work on some ranks)",
                               {"metric": "power_fraction_mean", "spread": spread}))
    lo = min(summaries, key=lambda s: s.util_mean_pct)
    hi = max(summaries, key=lambda s: s.util_mean_pct)
    spread = hi.util_mean_pct - lo.util_mean_pct
    if spread > UNEVEN_UTIL_SPREAD_PCT:
        out.append(Finding("uneven", "warn", (lo.gpu, hi.gpu),
                           f"uneven ranks: mean utilisation spans {lo.util_mean_pct:.0f}% (GPU {lo.gpu}) to "
                           f"{hi.util_mean_pct:.0f}% (GPU {hi.gpu}); some GPUs run kernels the others do not",
                           {"metric": "util_mean_pct", "spread": spread}))
    return out


def find(rec: Recording, summaries: tuple[GpuSummary, ...] | None = None) -> tuple[Finding, ...]:
    """Findings for the recording: per GPU (no_samples / idle / unjudged / waiting / busy / gaps), then
    "uneven" across the GPUs that were not idle (at least two needed)."""
    summaries = summarise(rec) if summaries is None else summaries
    active = [s for s in summaries if s.util_mean_pct is not None and s.util_mean_pct >= IDLE_UTIL_PCT]
    findings: list[Finding] = []
    for s in summaries:
        num_active = sum(1 for x in rec.samples_of(s.gpu) if is_active(x))
        others_active = any(a.gpu != s.gpu for a in active)
        findings += _gpu_findings(s, others_active, num_active)
    if len(active) >= 2:
        findings += _uneven(active)
    return tuple(findings)
