"""`verify_in_group`: an A/B of one strategy against a baseline, per bucket, with KEEP / REVERT.

Collective: every rank of `group` calls it with the same arguments.

Per (hidden, token bucket): correctness first (`correctness.check_candidate`, for the candidate
and the baseline); a candidate that fails anywhere is REVERT for that bucket. Then `rounds`
interleaved rounds of three timed calls, order rotated per round: the candidate A, the baseline B
and the baseline's twin B' (a second instance of the baseline strategy). B' against B measures
the noise of the machine itself, and because B' is a separate instance called once per round,
exactly as A is, it also carries whatever A gains or loses by being another instance than B
(benchmarks/bench_verify_control.py, 2 CPU ranks, 1,000 rounds, all calls the same code: with B'
the same instance as B, A measured 1.087x B at 1 token where B' measured 0.975x; with a second
instance, 1.020x and 1.025x; at 8 tokens 1.007x / 0.963x and 1.015x / 0.967x).

Verdict rule. Per round i the paired log-ratios d_i = log(A_i / B_i) and e_i = log(B'_i / B_i)
(all times per-call maxima over ranks); pairing within a round cancels slow drift of the machine.
    m      = median(d)                                   # reported as ratio = exp(m)
    h      = 1.58 * IQR(d) / sqrt(rounds)                # half-width of the median's notch (McGill,
                                                         # Tukey, Larsen 1978: ~95%, rank-based)
    offset = |median(e)|                                 # how far "equal" drifts apart here (A-vs-A)
    bound  = log(1 + margin) + offset
    REVERT when m - 2h > bound: slower than the baseline by more than the margin plus the A-vs-A
    offset, beyond twice the notch; the reported threshold is exp(bound + 2h). Twice, because the
    samples are judged again after every extension (below), and each look is one more chance of a
    false REVERT: at 2h one look errs about 3 times in 10,000 for a normal spread (2h is 3.4
    standard errors of the median), so the up to four looks stay near 0.1%.
    Otherwise KEEP: "faster" when m + h < -bound, "equal within noise" when m + h <= bound.
    Undecided (m - 2h <= bound < m + h): more rounds, up to `max_rounds`; still undecided then, KEEP
    "not shown slower" (a regression has to be shown, and the reason says the run was too noisy).
So a strategy equal to its baseline is KEEP even on a loaded machine (its interval widens with the
measured spread), and a clearly slower one is REVERT. Overall: REVERT if any bucket is REVERT.

The baseline defaults to the best unfused path: every admitted unfused strategy (other than the
candidate) that passes the correctness check gets a short interleaved pass on the largest bucket,
and the fastest becomes the baseline for all buckets.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from tpfuse.correctness import check_candidate
from tpfuse.dispatch.choice import is_fused
from tpfuse.dispatch.table import DEFAULT_MARGIN
from tpfuse.spec import Op, Problem
from tpfuse.timing import summary, time_interleaved
from tpfuse.tune.candidates import CandidatePool, admitted, timed_call

# 1.58 * IQR / sqrt(n): half-width of the notch around a median (McGill, Tukey, Larsen 1978),
# a rank-based ~95% interval that needs no normality assumption.
_NOTCH = 1.58
# A REVERT must clear the bound by this many notches (the repeated looks; rule in the module doc).
_REVERT_NOTCHES = 2.0


@dataclass(frozen=True)
class BucketVerdict:
    op: str
    hidden: int
    tokens: int
    verdict: str  # "KEEP" | "REVERT"
    ratio: float  # median over rounds of candidate / baseline; nan when not timed
    threshold: float  # ratio above which the bucket is REVERT
    noise: float  # measured noise band (log units)
    candidate_us: float
    baseline_us: float
    reason: str
    candidate_stats: dict = field(default_factory=dict)  # {"median", "p20", "p80", "n"} in us
    baseline_stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class VerifyReport:
    strategy: str
    baseline: str
    margin: float
    buckets: tuple[BucketVerdict, ...]

    @property
    def verdict(self) -> str:
        return "REVERT" if any(b.verdict == "REVERT" for b in self.buckets) else "KEEP"

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "baseline": self.baseline, "margin": self.margin,
                "verdict": self.verdict, "buckets": [asdict(b) for b in self.buckets]}


def judge(a: list[float], b: list[float], b2: list[float], margin: float) -> tuple[str, float, float, float, str]:
    """(verdict, ratio, threshold ratio, noise, reason) from paired per-round samples (rule in module doc)."""
    d = [math.log(x / y) for x, y in zip(a, b)]
    e = [math.log(x / y) for x, y in zip(b2, b)]
    m = statistics.median(d)
    q = statistics.quantiles(d, n=4, method="inclusive") if len(d) > 1 else [m, m, m]
    half = _NOTCH * (q[2] - q[0]) / math.sqrt(len(d))
    offset = abs(statistics.median(e))
    bound = math.log(1 + margin) + offset
    wide = _REVERT_NOTCHES * half
    ratio, threshold, noise = math.exp(m), math.exp(bound + wide), offset + wide
    n = len(d)
    if m - wide > bound:
        return "REVERT", ratio, threshold, noise, (f"slower: {ratio:.3f}x the baseline, above {threshold:.3f}x "
                                                   f"(margin {margin:.0%} + noise; {n} rounds)")
    if m + half < -bound:
        return "KEEP", ratio, threshold, noise, f"faster: {ratio:.3f}x the baseline ({n} rounds)"
    if m + half <= bound:
        return "KEEP", ratio, threshold, noise, (f"equal within noise: {ratio:.3f}x, "
                                                 f"REVERT above {threshold:.3f}x ({n} rounds)")
    return "KEEP", ratio, threshold, noise, (f"not shown slower: {ratio:.3f}x, "
                                             f"interval up to {math.exp(m + half):.3f}x "
                                             f"crosses the {math.exp(bound):.3f}x bound after {n} rounds "
                                             "(too noisy to tell)")


def settled(a: list[float], b: list[float], b2: list[float], margin: float) -> bool:
    """True once the samples decide: confidently slower than the bound, or confidently not."""
    reason = judge(a, b, b2, margin)[4]
    return not reason.startswith("not shown slower")


def verify_in_group(strategy: str, *, hiddens: tuple[int, ...], buckets: tuple[int, ...], baseline: str | None = None,
                    dtype: str = "bfloat16", op: str = Op.ALL_REDUCE_RESIDUAL_RMSNORM.value,
                    margin: float = DEFAULT_MARGIN, rounds: int = 30, max_rounds: int | None = None, warmup: int = 3,
                    group=None, device=None, progress: Callable[[str], None] | None = None,
                    options: dict | None = None) -> VerifyReport:
    """Collective: KEEP / REVERT of `strategy` against `baseline` per bucket (module doc).

    `rounds` per bucket first; a bucket the samples do not decide gets more rounds, up to
    `max_rounds` (default 4 x rounds)."""
    if rounds < 2:
        raise ValueError(f"verify: rounds must be >= 2 to measure noise, got {rounds}")
    max_rounds = max(rounds, max_rounds if max_rounds is not None else 4 * rounds)
    pool = CandidatePool.for_group(group, device=device, options=options)
    group, rank, world_size = pool.group, pool.rank, pool.world_size
    facts, caps, dev = pool.facts, pool.caps, pool.device
    torch_dtype = getattr(torch, dtype)
    the_op = Op(op)
    max_tokens = max(buckets)

    def call(name, hidden, num_tokens, twin=False):
        instance = pool.get(name, hidden=hidden, dtype=torch_dtype, max_tokens=max_tokens, twin=twin)
        return timed_call(instance, the_op, rank=rank, num_tokens=num_tokens, hidden=hidden, dtype=torch_dtype,
                          device=dev)

    try:
        if baseline is None:
            baseline = _best_unfused(strategy, the_op, hiddens[0], max_tokens, dtype, facts, caps, pool, call, group,
                                     rank, world_size, dev, rounds)
        results = []
        for hidden in hiddens:
            for num_tokens in sorted(buckets):
                results.append(_verify_bucket(strategy, baseline, the_op, hidden, num_tokens, dtype, torch_dtype, facts,
                                              caps, pool, call, group, rank, world_size, dev, margin, rounds,
                                              max_rounds, warmup, max_tokens))
                if progress is not None:
                    progress(f"{num_tokens}x{hidden}: {results[-1].verdict}")
    finally:
        pool.close()
    return VerifyReport(strategy, baseline, margin, tuple(results))


def _best_unfused(strategy, op, hidden, num_tokens, dtype, facts, caps, pool, call, group, rank, world_size, dev,
                  rounds) -> str:
    """The fastest admitted unfused strategy that also passes the correctness check (a wrong
    baseline would make any candidate look good)."""
    names, _ = admitted(Problem(op, num_tokens, hidden, dtype, facts), caps)
    options = []
    for name in (n for n in names if not is_fused(n) and n != strategy):
        instance = pool.get(name, hidden=hidden, dtype=getattr(torch, dtype), max_tokens=num_tokens)
        if check_candidate(instance, op, num_tokens=num_tokens, hidden=hidden, dtype=getattr(torch, dtype), group=group,
                           rank=rank, world_size=world_size, device=dev).ok:
            options.append(name)
    if not options:
        raise ValueError(f"verify: no correct unfused strategy other than {strategy!r} is admitted here to serve as "
                         "the baseline; pass --baseline")
    if len(options) == 1:
        return options[0]
    samples = time_interleaved({n: call(n, hidden, num_tokens) for n in options}, group=group, device=dev,
                               rounds=max(5, rounds // 2))
    return min(options, key=lambda n: statistics.median(samples[n]))


def _verify_bucket(strategy, baseline, op, hidden, num_tokens, dtype, torch_dtype, facts, caps, pool, call, group, rank,
                   world_size, dev, margin, rounds, max_rounds, warmup, max_tokens) -> BucketVerdict:
    problem = Problem(op, num_tokens, hidden, dtype, facts)
    _, verdicts = admitted(problem, caps, list(dict.fromkeys([strategy, baseline])))
    for name in (strategy, baseline):
        if not verdicts[name].ok:
            return BucketVerdict(op.value, hidden, num_tokens, "REVERT", math.nan, math.nan, math.nan, math.nan,
                                 math.nan, f"{name} is not admitted: {verdicts[name].reason}")
    for name in dict.fromkeys([strategy, baseline]):
        instance = pool.get(name, hidden=hidden, dtype=torch_dtype, max_tokens=max_tokens)
        verdict = check_candidate(instance, op, num_tokens=num_tokens, hidden=hidden, dtype=torch_dtype, group=group,
                                  rank=rank, world_size=world_size, device=dev)
        if not verdict.ok:
            return BucketVerdict(op.value, hidden, num_tokens, "REVERT", math.nan, math.nan, math.nan, math.nan,
                                 math.nan, f"{name} failed correctness: {verdict.reason}")
    fa, fb, fb2 = call(strategy, hidden, num_tokens), call(baseline, hidden, num_tokens), call(baseline, hidden,
                                                                                           num_tokens, twin=True)
    samples = time_interleaved({"A": fa, "B": fb, "B2": fb2}, group=group, device=dev, rounds=rounds, warmup=warmup)
    # Undecided (the interval straddles the bound): more rounds, up to max_rounds. The samples are
    # maxima over ranks, identical everywhere, so every rank extends the same number of times.
    while len(samples["A"]) < max_rounds and not settled(samples["A"], samples["B"], samples["B2"], margin):
        more = time_interleaved({"A": fa, "B": fb, "B2": fb2}, group=group, device=dev,
                                rounds=min(rounds, max_rounds - len(samples["A"])), warmup=0)
        samples = {k: samples[k] + more[k] for k in samples}
    verdict, ratio, threshold, noise, reason = judge(samples["A"], samples["B"], samples["B2"], margin)
    return BucketVerdict(op.value, hidden, num_tokens, verdict, ratio, threshold, noise,
                         statistics.median(samples["A"]), statistics.median(samples["B"]), reason,
                         summary(samples["A"]), summary(samples["B"]))
