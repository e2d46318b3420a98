"""`fusegate selftest`: every admitted strategy, on N local ranks, against the reference.

Two kinds of case, per strategy, op and dtype:
- exact: rank-tagged small-integer inputs (`reference.small_integer_inputs`), whose fp32 sums are
  exact; outputs must equal the reference bit for bit (all_reduce output, new_residual, normed);
- random: standard-normal inputs at model hidden sizes; the norm-wise relative error against the
  float64 reference must stay under `reference.TOLERANCE[dtype]`.
Every case also checks that all ranks returned identical bits (a digest per output, compared in
the parent), and times the op (median over `repeats` calls, the maximum over ranks).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from dataclasses import asdict, dataclass

# Hidden sizes of the model presets (glm5, deepseek-v3, qwen3-235b, llama3-70b), for random cases.
MODEL_HIDDEN = (6144, 7168, 4096, 8192)
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Case:
    kind: str  # "exact" | "random"
    op: str  # "all_reduce" | "all_reduce_residual_rmsnorm"
    num_tokens: int
    hidden: int
    dtype: str
    has_residual: bool = True


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


def default_cases(*, num_tokens: int = 4) -> list[Case]:
    cases = []
    for dtype in DTYPES:
        cases.append(Case("exact", "all_reduce", 7, 256, dtype, has_residual=False))
        cases.append(Case("exact", "all_reduce_residual_rmsnorm", 7, 256, dtype))
        cases.append(Case("exact", "all_reduce_residual_rmsnorm", 3, 256, dtype, has_residual=False))
        for hidden in MODEL_HIDDEN:
            cases.append(Case("random", "all_reduce_residual_rmsnorm", num_tokens, hidden, dtype))
    return cases


def _digest(tensors) -> str:
    import torch

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _inputs(case: Case, rank: int, world_size: int, device):
    import torch

    from fusegate.reference import random_inputs, small_integer_inputs

    dtype = getattr(torch, case.dtype)
    make = small_integer_inputs if case.kind == "exact" else random_inputs
    xs = [make(r, case.num_tokens, case.hidden, dtype, seed=1) for r in range(world_size)]
    residual = make(1000, case.num_tokens, case.hidden, dtype, seed=2) if case.has_residual else None
    # Weights: exact cases use small integers too (so normed is a product of exact factors
    # and one correctly rounded 1/sqrt); random cases use values near 1, like trained RMSNorm weights.
    gen = torch.Generator().manual_seed(3)
    if case.kind == "exact":
        weight = torch.randint(1, 4, (case.hidden,), generator=gen).to(dtype)
    else:
        weight = (1 + 0.1 * torch.randn(case.hidden, generator=gen)).to(dtype)
    return xs, residual, weight


def run_case(comm, strategy: str, case: Case, *, repeats: int) -> CaseResult:
    """Run one case on this rank (a collective: every rank calls it with the same case)."""
    import torch
    import torch.distributed as dist

    from fusegate.reference import TOLERANCE, all_reduce_ref, all_reduce_residual_rmsnorm_ref, relative_error

    device = comm.device
    xs, residual, weight = _inputs(case, comm.rank, comm.world_size, device)
    x = xs[comm.rank].to(device)
    res = residual.to(device) if residual is not None else None
    w = weight.to(device)

    def call():
        if case.op == "all_reduce":
            return (comm.all_reduce(x),)
        return comm.all_reduce_residual_rmsnorm(x, res, w)

    outputs = tuple(t.cpu() for t in call())
    if case.kind == "exact":
        refs = (all_reduce_ref(xs),) if case.op == "all_reduce" else all_reduce_residual_rmsnorm_ref(xs, residual, weight)
        error = max((o.double() - r.double()).abs().max().item() if o.numel() else 0.0 for o, r in zip(outputs, refs))
        if any(not torch.isfinite(o).all() for o in outputs):
            error = float("inf")
        tolerance = 0.0
        passed = all(torch.equal(o, r) for o, r in zip(outputs, refs))
    else:
        acc = torch.float64
        xs64 = [t.double() for t in xs]
        res64 = residual.double() if residual is not None else None
        if case.op == "all_reduce":
            refs = (all_reduce_ref(xs64, acc_dtype=acc),)
        else:
            refs = all_reduce_residual_rmsnorm_ref(xs64, res64, weight.double(), acc_dtype=acc)
        error = max(relative_error(o, r) for o, r in zip(outputs, refs))
        tolerance = TOLERANCE[getattr(torch, case.dtype)]
        passed = error <= tolerance

    times = []
    for _ in range(repeats):
        dist.barrier(group=comm.group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    median_us = statistics.median(times) if times else float("nan")
    return CaseResult(strategy, case, error, tolerance, median_us, passed, digest=_digest(outputs))


def rank_main(rank: int, world_size: int, cases: list[Case], repeats: int, device: str | None, only: list[str] | None,
              show_progress: bool = False):
    """Body of one selftest rank: returns (admission reasons, results) as plain data; rank 0 shows a
    progress bar on a terminal when `show_progress`."""
    from fusegate import Communicator
    from fusegate.strategies import admission, strategy_names
    from fusegate.spec import Op, Problem
    from fusegate.spawned import progress_bar

    probe_comm = Communicator(device=device)
    info, caps = probe_comm.info, probe_comm.caps
    probe_comm.close()
    results: list[CaseResult] = []
    skipped: dict[str, str] = {}
    plan: list[tuple[str, list[Case]]] = []
    for name in only or strategy_names():
        admitted_cases = []
        for case in cases:
            problem = Problem(Op(case.op), case.num_tokens, case.hidden, case.dtype, info, case.has_residual)
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
