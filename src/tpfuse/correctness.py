"""Is a strategy's answer right? The one set of cases, inputs, poisoning, digest and checks.

`selftest`, `tune`, `verify` and the allreduce sweep all verify through this module, against
`tpfuse.reference` and its tolerance table:
- exact cases: rank-tagged small-integer inputs (`reference.small_integer_inputs`), small-integer
  residual and weight. Their sums are exact in fp32 and in every 16-bit dtype up to 64 ranks, in
  any summation order, so the all_reduce output and new_residual must equal the reference bit for
  bit even for strategies that reduce in the input dtype; normed must equal it too (one correctly
  rounded 1/sqrt of an exact sum of squares). Providers that are not tpfuse strategies may be
  held to the tolerance on these inputs instead (`tolerance_fallback`, the sweep's third parties);
- random cases: standard-normal inputs (weights near 1, like trained RMSNorm weights); the
  norm-wise relative error against the float64 reference must stay within
  `reference.TOLERANCE[dtype]`;
- outputs are poisoned first: the strategies return fresh tensors, so before each call the
  allocator's free blocks of the output size are filled with NaN (allocate, fill, free); an
  output element the strategy never writes then reads as NaN and fails the check. Outputs of the
  wrong shape or dtype, or that alias the input (the ops are out of place), fail too;
- `digest` of the outputs, so callers can require that every rank returned the same bits.

Inputs are deterministic in (case, rank), so any process can rebuild every rank's input and
compute the whole collective's reference locally. `run_case` is collective only as far as the
call it checks is; `check_candidate` is collective (every rank calls it for the same candidate
and shape, in the same order) and reduces the verdict across ranks: one rank's failure (or
exception) rejects the candidate on every rank, with the failing ranks and their reasons.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpfuse.reference import (
    TOLERANCE,
    all_reduce_ref,
    all_reduce_residual_rmsnorm_ref,
    random_inputs,
    relative_error,
    small_integer_inputs,
)
from tpfuse.spec import Op, Verdict
from tpfuse.strategies.host_wait import PeerLostError

# How many output-sized blocks to poison before a call: outputs of the fused op are two tensors,
# plus slack for temporaries the strategy frees before allocating its outputs.
_POISON_BLOCKS = 4
EPS = 1e-6  # the RMSNorm epsilon every case uses (the API's default)


@dataclass(frozen=True)
class Case:
    """One correctness case: which inputs ("exact" small integers or "random"), op and shape."""

    kind: str  # "exact" | "random"
    op: str  # an Op value: "all_reduce" | "all_reduce_residual_rmsnorm"
    num_tokens: int
    hidden: int
    dtype: str  # a torch dtype name: "bfloat16", ...
    has_residual: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("exact", "random"):
            raise ValueError(f"Case: kind must be 'exact' or 'random', got {self.kind!r}")
        Op(self.op)

    @property
    def output_names(self) -> tuple[str, ...]:
        return ("all_reduce",) if self.op == Op.ALL_REDUCE.value else ("normed", "new_residual")


@dataclass(frozen=True)
class CaseInputs:
    """Every rank's input of one case (CPU tensors): xs[rank], the residual (None without) and the weight."""

    xs: tuple[torch.Tensor, ...]
    residual: torch.Tensor | None
    weight: torch.Tensor

    def for_rank(self, rank: int, device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(x, residual, weight) of `rank`, on `device`."""
        residual = self.residual.to(device) if self.residual is not None else None
        return self.xs[rank].to(device), residual, self.weight.to(device)


@dataclass(frozen=True)
class Check:
    """The outcome of one case on one rank. `error`: exact cases the max abs difference (inf
    when an output is not finite), random cases the largest norm-wise relative error; `reason`
    says what failed, or what was shown."""

    passed: bool
    error: float
    tolerance: float
    reason: str
    digest: str = ""


def case_inputs(case: Case, world_size: int) -> CaseInputs:
    """The deterministic inputs of `case` for every rank (module doc)."""
    dtype = getattr(torch, case.dtype)
    make = small_integer_inputs if case.kind == "exact" else random_inputs
    xs = tuple(make(r, case.num_tokens, case.hidden, dtype, seed=11) for r in range(world_size))
    # Rank-independent residual and weight: the "rank" argument is only a seed offset here.
    residual = make(world_size + 1000, case.num_tokens, case.hidden, dtype, seed=12) if case.has_residual else None
    gen = torch.Generator().manual_seed(13)
    if case.kind == "exact":
        weight = torch.randint(1, 4, (case.hidden,), generator=gen).to(dtype)
    else:
        weight = (1 + 0.1 * torch.randn(case.hidden, generator=gen)).to(dtype)
    return CaseInputs(xs, residual, weight)


def reference_outputs(case: Case, inputs: CaseInputs, *, float64: bool = False) -> tuple[torch.Tensor, ...]:
    """The reference's outputs for `case` (in the case's dtype, or in float64 from float64 inputs)."""
    xs, residual, weight = list(inputs.xs), inputs.residual, inputs.weight
    acc = None
    if float64:
        xs, acc = [t.double() for t in xs], torch.float64
        residual, weight = (residual.double() if residual is not None else None), weight.double()
    if case.op == Op.ALL_REDUCE.value:
        return (all_reduce_ref(xs, acc_dtype=acc),)
    return tuple(all_reduce_residual_rmsnorm_ref(xs, residual, weight, EPS, acc_dtype=acc))


def poison_allocator(shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
    """Fill free allocator blocks of this size with NaN, so unwritten outputs show up as NaN."""
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(_POISON_BLOCKS)]
    del blocks


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """The outputs' bits, hashed (equal digests: equal bits, dtypes and element counts)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def check_outputs(case: Case, inputs: CaseInputs, outputs: Sequence[torch.Tensor], *, x: torch.Tensor | None = None,
                  tolerance_fallback: bool = False) -> Check:
    """Check one rank's `outputs` of `case` against the reference (module doc). `x`, when given, is
    the input the call got: an output that aliases it fails. `tolerance_fallback`: an exact case
    that is not bit-exact may still pass within the tolerance of the float64 reference."""
    dtype = getattr(torch, case.dtype)
    names = case.output_names
    if len(outputs) != len(names):
        return Check(False, float("inf"), 0.0,
                     f"returned {len(outputs)} outputs, expected {len(names)} ({', '.join(names)})")
    shape = (case.num_tokens, case.hidden)
    for o in outputs:
        if tuple(o.shape) != shape or o.dtype != dtype:
            return Check(False, float("inf"), 0.0,
                         f"output has shape {tuple(o.shape)} {o.dtype}, expected {shape} {dtype}")
        if x is not None and o.data_ptr() == x.data_ptr():
            return Check(False, float("inf"), 0.0, "output aliases the input (the op is out of place)")
    outs = tuple(o.detach().cpu() for o in outputs)
    bits = digest(outs)
    if case.kind == "exact":
        refs = reference_outputs(case, inputs)
        error = max((o.double() - r.double()).abs().max().item() if o.numel() else 0.0 for o, r in zip(outs, refs))
        if any(not torch.isfinite(o).all() for o in outs):
            error = float("inf")
        bad = [(n, int((o != r).sum()), r.numel()) for n, o, r in zip(names, outs, refs) if not torch.equal(o, r)]
        if not bad:
            return Check(True, error, 0.0, "bit-exact vs the reference (small integers)", bits)
        # NaN != NaN, so poisoned (unwritten) elements count
        differs = ", ".join(f"{n} differs from the reference in {k} of {total} elements" for n, k, total in bad)
        residual = "with" if case.has_residual else "no"
        if not tolerance_fallback:
            return Check(False, error, 0.0, f"not bit-exact on small integers ({residual} residual): {differs}", bits)
    refs64 = reference_outputs(case, inputs, float64=True)
    tol = TOLERANCE[dtype]
    errors = [relative_error(o, r) for o, r in zip(outs, refs64)]
    error = max(errors)
    for n, err in zip(names, errors):
        if not err <= tol:
            return Check(False, error, tol, f"{case.kind} case: {n} relative error {err:.3g} exceeds {tol:.3g} "
                                            "against the float64 reference", bits)
    if case.kind == "exact":
        return Check(True, error, tol, f"within tolerance {tol:.3g} of the float64 reference (small integers; "
                                       f"rel err {error:.3g}), not bit-exact", bits)
    return Check(True, error, tol, f"relative error {error:.3g} within {tol:.3g} of the float64 reference", bits)


def op_call(target, op: str) -> Callable[..., tuple[torch.Tensor, ...]]:
    """`(x, residual, weight) -> outputs` of `op` on a Communicator or a strategy instance."""
    if op == Op.ALL_REDUCE.value:
        return lambda x, residual, weight: (target.all_reduce(x),)
    return lambda x, residual, weight: tuple(target.all_reduce_residual_rmsnorm(x, residual, weight, EPS))


@contextlib.contextmanager
def host_share_of_threads(world_size: int):
    """torch's intra-op CPU threads limited to this rank's share of the host's cores
    (cores // world_size, at least one) inside the block, restored after it.

    For the checks' own CPU work (inputs, float64 reference, comparisons): every rank of a group
    runs it at the same moment, and ranks that each keep torch's default of one thread per core
    oversubscribe the host, their OpenMP pools spinning against each other's."""
    before = torch.get_num_threads()
    share = max(1, (os.cpu_count() or 1) // max(1, world_size))
    if share < before:
        torch.set_num_threads(share)
    try:
        yield
    finally:
        if share < before:
            torch.set_num_threads(before)


def run_case(fn: Callable[..., Sequence[torch.Tensor]], case: Case, *, rank: int, world_size: int, device,
             tolerance_fallback: bool = False) -> Check:
    """Poison, call `fn(x, residual, weight)` on this rank's inputs of `case`, check the outputs.
    Exceptions from `fn` propagate (each caller decides what a raising strategy means). The
    inputs and the check run on this rank's share of the host's threads
    (`host_share_of_threads`); `fn` runs with the caller's, as it would when serving."""
    with host_share_of_threads(world_size):
        inputs = case_inputs(case, world_size)
        x, residual, weight = inputs.for_rank(rank, device)
    poison_allocator((case.num_tokens, case.hidden), x.dtype, device)
    outputs = tuple(fn(x, residual, weight))
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    with host_share_of_threads(world_size):
        return check_outputs(case, inputs, outputs, x=x, tolerance_fallback=tolerance_fallback)


def candidate_cases(op: Op, *, num_tokens: int, hidden: int, dtype: str) -> list[Case]:
    """What a candidate must pass before it is timed: exact and random with a residual, and for
    the fused op exact without one."""
    cases = [Case("exact", op.value, num_tokens, hidden, dtype), Case("random", op.value, num_tokens, hidden, dtype)]
    if op == Op.ALL_REDUCE_RESIDUAL_RMSNORM:
        cases.append(Case("exact", op.value, num_tokens, hidden, dtype, has_residual=False))
    return cases


def check_candidate(instance, op: Op, *, num_tokens: int, hidden: int, dtype: torch.dtype, group,
                    rank: int, world_size: int, device: torch.device) -> Verdict:
    """Collective: the candidate's correctness verdict, identical on every rank (module doc)."""

    cases = candidate_cases(op, num_tokens=num_tokens, hidden=hidden, dtype=str(dtype).removeprefix("torch."))
    fn = op_call(instance, op.value)
    mine: list = []
    for case in cases:
        try:
            check = run_case(fn, case, rank=rank, world_size=world_size, device=device)
            reason, bits = ("" if check.passed else check.reason), check.digest
        except PeerLostError:  # not the candidate's fault alone: the group is out of step, stop the tune
            raise
        except Exception as exc:  # a broken candidate is rejected, not a crashed tune
            reason, bits = f"raised {type(exc).__name__}: {exc}", ""
        # No early exit: every rank runs every case, so all ranks issue the same collectives.
        mine.append((reason, bits))
    return agree_verdict(mine, cases, group=group, world_size=world_size)


def agree_verdict(mine: list[tuple[str, str]], cases: list[Case], *, group, world_size: int) -> Verdict:
    """Collective: one verdict from every rank's (failure reason or "", digest) per case: no when
    any rank failed a case (naming the ranks) or the ranks' digests of a case differ."""
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    failures = [f"rank {r}: {reason}" for r, results in enumerate(everyone) for reason, _ in results if reason]
    if failures:
        return Verdict.no("; ".join(failures))
    for i, case in enumerate(cases):
        if len({results[i][1] for results in everyone}) != 1:
            return Verdict.no(f"{case.kind} case: ranks returned different bits "
                              "(every rank must return identical outputs)")
    return Verdict.yes(f"bit-exact on small integers, within tolerance on random inputs, "
                       f"identical on {world_size} ranks")
