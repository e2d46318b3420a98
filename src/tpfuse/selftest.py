"""`tpfuse selftest`: every admitted strategy, on N local ranks, against the reference.

The cases and their checks are `tpfuse.correctness`'s, per strategy, op and dtype:
- exact: rank-tagged small-integer inputs, outputs bit for bit equal to the reference
  (all_reduce output, new_residual, normed), with and without a residual;
- random: standard-normal inputs at model hidden sizes, norm-wise relative error against the
  float64 reference within `reference.TOLERANCE[dtype]`;
outputs poisoned with NaN before the checked call. Every case also checks that all ranks
returned identical bits (the outputs' digest, compared in the parent), and times the op
(`tpfuse.timing.time_interleaved`: median over `repeats` samples, each the maximum over ranks).
"""

from __future__ import annotations

import statistics
import warnings
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from tpfuse.presets import PRESETS

if TYPE_CHECKING:  # tpfuse.correctness imports torch; `tpfuse selftest` checks its arguments without it
    from tpfuse.correctness import Case

# Hidden sizes of the model presets (glm5, deepseek-v3, qwen3-235b, llama3-70b), for random cases.
MODEL_HIDDEN = tuple(p.hidden for p in PRESETS.values())
DTYPES = ("bfloat16", "float16", "float32")
# The exact cases' shapes (tokens, hidden): small-integer inputs whose cross-rank sums are exact.
EXACT_SHAPES = ((7, 256), (3, 256))


@dataclass(frozen=True)
class CaseResult:
    strategy: str
    case: Case
    error: float  # exact: max abs difference; random: norm-wise relative error
    tolerance: float
    median_us: float
    passed: bool
    detail: str = ""
    digest: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("case"))
        return d


def largest_case(num_tokens: int) -> tuple[int, int]:
    """(tokens, hidden) of the largest case `default_cases(num_tokens=...)` holds, without torch."""
    return max((*EXACT_SHAPES, (num_tokens, max(MODEL_HIDDEN))), key=lambda shape: shape[0] * shape[1])


def default_cases(*, num_tokens: int = 4) -> list[Case]:
    from tpfuse.correctness import Case

    (tokens, hidden), (tokens_no_residual, _) = EXACT_SHAPES
    cases = []
    for dtype in DTYPES:
        cases.append(Case("exact", "all_reduce", tokens, hidden, dtype, has_residual=False))
        cases.append(Case("exact", "all_reduce_residual_rmsnorm", tokens, hidden, dtype))
        cases.append(Case("exact", "all_reduce_residual_rmsnorm", tokens_no_residual, hidden, dtype,
                          has_residual=False))
        for hidden in MODEL_HIDDEN:
            cases.append(Case("random", "all_reduce_residual_rmsnorm", num_tokens, hidden, dtype))
    return cases


def run_case(comm, strategy: str, case: Case, *, repeats: int) -> CaseResult:
    """Run one case on this rank (a collective: every rank calls it with the same case): the
    check (`tpfuse.correctness.run_case`), then `repeats` timed calls (`tpfuse.timing`)."""
    from tpfuse.correctness import case_inputs, op_call
    from tpfuse.correctness import run_case as check_case
    from tpfuse.timing import time_interleaved

    fn = op_call(comm, case.op)
    check = check_case(fn, case, rank=comm.rank, world_size=comm.world_size, device=comm.device)
    median_us = float("nan")
    if repeats > 0:
        x, residual, weight = case_inputs(case, comm.world_size).for_rank(comm.rank, comm.device)
        # No warm-up: the checked call just ran. Samples are maxima over ranks already.
        samples = time_interleaved({strategy: lambda: fn(x, residual, weight)}, group=comm.group, device=comm.device,
                                   rounds=repeats, warmup=0)[strategy]
        median_us = statistics.median(samples)
    return CaseResult(strategy, case, check.error, check.tolerance, median_us, check.passed,
                      detail="" if check.passed else check.reason, digest=check.digest)


def rank_main(rank: int, world_size: int, cases: list[Case], repeats: int, device: str | None, only: list[str] | None,
              show_progress: bool = False):
    """Body of one selftest rank: returns (admission reasons, results) as plain data; rank 0 shows a
    progress bar on a terminal when `show_progress`. Strategy-choice warnings are not shown: the
    selftest names every strategy itself (none is the user's override), and checks correctness, not
    which strategy the measurements prefer."""
    from tpfuse.dispatch.choice import DispatchWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DispatchWarning)
        return _rank_main(rank, cases, repeats, device, only, show_progress)


def _rank_main(rank, cases, repeats, device, only, show_progress):
    from tpfuse import Communicator
    from tpfuse.rank_setup import progress_bar
    from tpfuse.spec import Op, Problem
    from tpfuse.strategies import admission, strategy_names

    probe_comm = Communicator(device=device)
    facts, caps = probe_comm.facts, probe_comm.caps
    probe_comm.close()
    results: list[CaseResult] = []
    skipped: dict[str, str] = {}
    plan: list[tuple[str, list[Case]]] = []
    for name in only or strategy_names():
        admitted_cases = []
        for case in cases:
            problem = Problem(Op(case.op), case.num_tokens, case.hidden, case.dtype, facts, case.has_residual)
            verdict = admission(problem, caps, [name])[name]
            if verdict.ok:
                admitted_cases.append(case)
            else:
                skipped.setdefault(name, verdict.reason)
        if admitted_cases:
            plan.append((name, admitted_cases))
    total = sum(len(c) for _, c in plan)
    with progress_bar(total, "selftest", show_progress and rank == 0) as advance:
        for name, admitted_cases in plan:
            with Communicator(strategy=name, device=device) as comm:
                for case in admitted_cases:
                    try:
                        results.append(run_case(comm, name, case, repeats=repeats))
                    except Exception as exc:  # a failing strategy is a FAIL row, not a crashed selftest
                        results.append(CaseResult(name, case, float("inf"), 0.0, float("nan"), False,
                                                  detail=f"{type(exc).__name__}: {exc}"))
                    advance(f"{name} {case.kind} {case.num_tokens}x{case.hidden} {case.dtype}")
    return skipped, results


def merge_ranks(per_rank: list[tuple[dict, list[CaseResult]]]) -> tuple[dict, list[CaseResult]]:
    """Rank 0's rows, failed where any rank failed or ranks' digests differ; latency = max over ranks."""
    skipped, rows = per_rank[0]
    merged = []
    for i, row in enumerate(rows):
        peers = [rank_rows[i] for _, rank_rows in per_rank]
        same_bits = len({p.digest for p in peers}) == 1
        passed = all(p.passed for p in peers) and same_bits
        detail = row.detail or ("" if same_bits else "ranks returned different bits")
        failing = [r for r, p in enumerate(peers) if not p.passed]
        if failing and not detail:
            detail = f"failed on rank(s) {failing}"
        merged.append(
            CaseResult(row.strategy, row.case, max(p.error for p in peers), row.tolerance,
                       max(p.median_us for p in peers), passed, detail, row.digest)
        )
    return skipped, merged
