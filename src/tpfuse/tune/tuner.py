"""`tune_in_group`: measure every admitted strategy on this group and build a dispatch table.

Collective: every rank of `group` calls it with the same `TuneSpec`. It works inside an existing
process group, so an engine can tune in place; `tpfuse tune` spawns local ranks and calls it.

Per (op, hidden, token bucket):
1. admission (`tpfuse.strategies.admission`) on the group's agreed facts;
2. verify before timing (`correctness.check_candidate`): a candidate that fails on any rank is
   rejected on every rank and never timed;
3. first pass: every passing candidate, `rounds` interleaved samples (`timing.time_interleaved`,
   max over ranks), medians;
4. confirmation: the leaders (the fastest overall, the fastest unfused and the fastest fused) are
   re-timed together for `confirm_rounds` more samples, and only those medians decide, so a lucky
   first-pass sample cannot win on its own;
5. choice with the do-no-harm guard: the fastest unfused strategy, unless the fastest fused one
   beats it by `margin` (default 3%).
All decisions use times already reduced across ranks, and rank 0's table is broadcast at the end,
so every rank returns the identical table (same digest).

Candidates are created and prepared when the first bucket of an (op, hidden) admits them, for
every bucket of the step at once (`CandidatePool.get(buckets=...)`: the peer strategies compile
all those kernel variants together, concurrently), so later buckets only measure.

With `TuneSpec.budget_s` (an engine's start-up calibration), buckets are measured smallest first
until the budget is spent: before each bucket after the first, rank 0's clock decides (the
decision is broadcast) whether the time spent plus twice the last bucket's measuring time (its
candidates' creation and preparation left out: a later bucket has none) stays within the budget;
the table then holds only the buckets measured. `handshake_group` carries the object
collectives (an engine's gloo group) while the data and timing run on `group`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpfuse.correctness import check_candidate
from tpfuse.dispatch.choice import is_fused
from tpfuse.dispatch.table import DEFAULT_MARGIN, DispatchTable, Entry, fingerprint, now_iso, parse, versions_of
from tpfuse.spec import Op, Problem
from tpfuse.timing import summary, time_interleaved
from tpfuse.tune.candidates import CandidatePool, admitted, timed_call

ALL_OPS = (Op.ALL_REDUCE_RESIDUAL_RMSNORM.value, Op.ALL_REDUCE.value)


@dataclass(frozen=True)
class TuneSpec:
    """What to tune. `rounds`/`confirm_rounds`: samples per candidate in the two passes."""

    hiddens: tuple[int, ...]
    buckets: tuple[int, ...]
    dtype: str = "bfloat16"
    ops: tuple[str, ...] = ALL_OPS
    strategies: tuple[str, ...] | None = None
    margin: float = DEFAULT_MARGIN
    rounds: int = 20
    confirm_rounds: int = 40
    warmup: int = 3
    budget_s: float | None = None  # stop before a bucket that would end past this many seconds

    def __post_init__(self) -> None:
        if not self.hiddens or any(h < 1 for h in self.hiddens):
            raise ValueError(f"TuneSpec: hiddens must be positive sizes, got {self.hiddens}")
        if not self.buckets or any(t < 1 for t in self.buckets):
            raise ValueError(f"TuneSpec: buckets must be positive token counts, got {self.buckets}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"TuneSpec: margin is a fraction in [0, 1), e.g. 0.03; got {self.margin}")
        for op in self.ops:
            Op(op)
        if self.budget_s is not None and not self.budget_s > 0:
            raise ValueError(f"TuneSpec: budget_s is a number of seconds > 0 (or None for no budget), "
                             f"got {self.budget_s}")

    @property
    def num_steps(self) -> int:
        return len(self.ops) * len(self.hiddens) * len(self.buckets)


def decide(medians: dict[str, float], margin: float, fused: Callable[[str], bool]) -> tuple[str, str | None, str]:
    """(choice, best unfused, reason) from deciding medians, with the do-no-harm guard."""
    unfused = {n: t for n, t in medians.items() if not fused(n)}
    fused_ = {n: t for n, t in medians.items() if fused(n)}
    best_u = min(unfused, key=unfused.get) if unfused else None
    best_f = min(fused_, key=fused_.get) if fused_ else None
    if best_u is None:
        return best_f, None, "fastest candidate; no unfused strategy passed to compare against"
    if best_f is None:
        return best_u, best_u, f"fastest unfused ({unfused[best_u]:.1f} us); no fused candidate"
    gain = 1 - fused_[best_f] / unfused[best_u]
    if gain >= margin:
        return best_f, best_u, f"fused {best_f} beats unfused {best_u} by {gain:.1%} (margin {margin:.0%})"
    return best_u, best_u, (f"kept unfused {best_u}: fused {best_f} is {gain:+.1%} faster, "
                            f"less than the {margin:.0%} margin")


def _leaders(medians: dict[str, float], fused: Callable[[str], bool]) -> list[str]:
    order = sorted(medians, key=medians.get)
    picks = [order[0]]
    for want_fused in (False, True):
        best = next((n for n in order if fused(n) == want_fused), None)
        if best is not None and best not in picks:
            picks.append(best)
    return picks


def tune_in_group(spec: TuneSpec, *, group=None, device=None, progress: Callable[[str], None] | None = None,
                  options: dict | None = None, handshake_group=None) -> DispatchTable:
    """Collective: measure and choose per bucket (module doc); every rank returns the same table.

    `device`: where tensors live (default: CUDA for NCCL groups, else CPU; "cuda" over gloo for
    ranks sharing a GPU). `progress(description)` is called once per finished bucket.
    `handshake_group` (default `group`): where the object collectives run.
    """
    pool = CandidatePool.for_group(group, device=device, options=options, handshake_group=handshake_group)
    group, rank, world_size = pool.group, pool.rank, pool.world_size
    facts, caps, dev = pool.facts, pool.caps, pool.device
    handshake = handshake_group if handshake_group is not None else group
    dtype = getattr(torch, spec.dtype)
    max_tokens = max(spec.buckets)
    buckets = tuple(sorted(spec.buckets))
    steps = [(Op(op_name), hidden, num_tokens) for op_name in spec.ops for hidden in spec.hiddens
             for num_tokens in buckets]
    entries = []
    started, last_s = time.perf_counter(), 0.0
    try:
        for op, hidden, num_tokens in steps:
            # The next bucket holds up to twice the tokens of the last (engines capture 1, 2, 4, 8,
            # ...), so it is predicted to measure for up to twice as long.
            if entries and spec.budget_s is not None and _budget_spent(started, 2 * last_s, spec.budget_s, handshake):
                break
            began, setup_before = time.perf_counter(), pool.setup_s
            entries.append(_tune_bucket(spec, pool, op, hidden, num_tokens, buckets, dtype, max_tokens, facts, caps,
                                        group, rank, world_size, dev, handshake))
            last_s = time.perf_counter() - began - (pool.setup_s - setup_before)
            if progress is not None:
                progress(f"{op.value} {num_tokens}x{hidden}: {entries[-1].choice}")
    finally:
        pool.close()
    settings = {"margin": spec.margin, "rounds": spec.rounds, "confirm_rounds": spec.confirm_rounds}
    table = DispatchTable(versions_of(caps), fingerprint(facts, caps), tuple(entries), settings, now_iso())
    # Rank 0's table on every rank: same timestamp and bits, hence the same digest everywhere.
    box = [table.to_json() if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(handshake, 0), group=handshake)
    return parse(box[0])


def _budget_spent(started: float, next_s: float, budget_s: float, group) -> bool:
    """Collective: rank 0's answer to "would one more bucket of `next_s` seconds end past the budget?"."""
    box = [time.perf_counter() - started + next_s > budget_s]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return bool(box[0])


def _tune_bucket(spec, pool, op, hidden, num_tokens, buckets, dtype, max_tokens, facts, caps, group, rank, world_size,
                 dev, handshake) -> Entry:
    problem = Problem(op, num_tokens, hidden, spec.dtype, facts, has_residual=op == Op.ALL_REDUCE_RESIDUAL_RMSNORM)
    names, verdicts = admitted(problem, caps, list(spec.strategies) if spec.strategies else None)
    rejected = {n: f"not admitted: {v.reason}" for n, v in verdicts.items() if not v.ok}
    passing = []
    for name in names:
        try:
            instance = pool.get(name, hidden=hidden, dtype=dtype, max_tokens=max_tokens, buckets=buckets, op=op)
            local = ""
        except Exception as exc:  # reported, then agreed: a candidate missing on one rank is out everywhere
            instance, local = None, f"{type(exc).__name__}: {exc}"
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, local, group=handshake)
        if any(everyone):
            rejected[name] = "could not be created: " + "; ".join(f"rank {r}: {m}" for r, m in enumerate(everyone) if m)
            continue
        verdict = check_candidate(instance, op, num_tokens=num_tokens, hidden=hidden, dtype=dtype, group=group,
                                  rank=rank, world_size=world_size, device=dev)
        if verdict.ok:
            passing.append(name)
        else:
            rejected[name] = f"failed correctness: {verdict.reason}"
    if not passing:
        raise RuntimeError(
            f"tune: no strategy passed for {op.value} {num_tokens}x{hidden} {spec.dtype} "
            f"({'; '.join(f'{n}: {r}' for n, r in rejected.items())}); check the reasons above"
        )

    def calls(selected):
        return {n: timed_call(pool.get(n, hidden=hidden, dtype=dtype, max_tokens=max_tokens, buckets=buckets, op=op),
                              op, rank=rank, num_tokens=num_tokens, hidden=hidden, dtype=dtype, device=dev)
                for n in selected}

    first = time_interleaved(calls(passing), group=group, device=dev, rounds=spec.rounds, warmup=spec.warmup)
    times = {n: summary(s) for n, s in first.items()}
    confirmed = {}
    if len(passing) > 1 and spec.confirm_rounds > 0:
        leaders = _leaders({n: t["median"] for n, t in times.items()}, is_fused)
        if len(leaders) > 1:
            again = time_interleaved(calls(leaders), group=group, device=dev, rounds=spec.confirm_rounds, warmup=1)
            confirmed = {n: summary(s) for n, s in again.items()}
    deciding = {n: t["median"] for n, t in (confirmed or times).items()}
    choice, best_unfused, reason = decide(deciding, spec.margin, is_fused)
    return Entry(op.value, spec.dtype, hidden, num_tokens, choice, reason, best_unfused, times, confirmed, rejected,
                 guarded=any(is_fused(n) for n in deciding))
