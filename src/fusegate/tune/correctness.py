"""Verify before timing: a candidate is timed only after it computed the right answer on every rank.

Collective: every rank calls `check_candidate` for the same candidate and shape, in the same order.

Checks, for one strategy instance and one (op, tokens, hidden, dtype):
1. exact: rank-tagged small-integer inputs (`reference.small_integer_inputs`), small-integer
   residual and weight. Their sums are exact in fp32 and in every 16-bit dtype up to 64 ranks, in
   any summation order, so the all_reduce output and new_residual must equal the reference bit for
   bit even for strategies that reduce in the input dtype; normed must equal it too (one correctly
   rounded 1/sqrt of an exact sum of squares, as `fusegate selftest` also requires). Run with and without residual.
2. random: standard-normal inputs; norm-wise relative error against the float64 reference within
   `reference.TOLERANCE[dtype]`.
3. every rank returned the same bits (digests gathered and compared).

Outputs are poisoned first: the strategies return fresh tensors, so before each call the
allocator's free blocks of the output size are filled with NaN (allocate, fill, free); an output
element the strategy never writes then reads as NaN and fails the check. Outputs that alias the
input fail too (the ops are out of place).

The verdict is reduced across ranks: one rank's failure (or exception) rejects the candidate on
every rank, with the failing ranks and their reasons in `Verdict.reason`.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from fusegate.strategies.host_wait import PeerLostError
from fusegate.reference import (
    TOLERANCE,
    all_reduce_ref,
    all_reduce_residual_rmsnorm_ref,
    random_inputs,
    relative_error,
    small_integer_inputs,
)
from fusegate.spec import Op, Verdict

# How many output-sized blocks to poison before a call: outputs of the fused op are two tensors,
# plus slack for temporaries the strategy frees before allocating its outputs.
_POISON_BLOCKS = 4


def poison_allocator(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """Fill free allocator blocks of this size with NaN, so unwritten outputs show up as NaN."""
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(_POISON_BLOCKS)]
    del blocks


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _inputs(kind: str, rank: int, world_size: int, tokens: int, hidden: int, dtype, has_residual: bool):
    make = small_integer_inputs if kind == "exact" else random_inputs
    xs = [make(r, tokens, hidden, dtype, seed=11) for r in range(world_size)]
    # Rank-independent residual and weight: the "rank" argument is only a seed offset here.
    residual = make(world_size + 1000, tokens, hidden, dtype, seed=12) if has_residual else None
    gen = torch.Generator().manual_seed(13)
    if kind == "exact":
        weight = torch.randint(1, 4, (hidden,), generator=gen).to(dtype)
    else:
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    return xs, residual, weight


def _run_case(instance, op: Op, kind: str, rank: int, world_size: int, tokens: int, hidden: int,
              dtype: torch.dtype, has_residual: bool, device: torch.device) -> tuple[str, str]:
    """(local failure reason or "", digest of the outputs) for one case on this rank."""
    xs, residual, weight = _inputs(kind, rank, world_size, tokens, hidden, dtype, has_residual)
    x = xs[rank].to(device)
    res = residual.to(device) if residual is not None else None
    w = weight.to(device)
    poison_allocator((tokens, hidden), dtype, device)
    if op == Op.ALL_REDUCE:
        outs = (instance.all_reduce(x),)
    else:
        outs = tuple(instance.all_reduce_residual_rmsnorm(x, res, w, 1e-6))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for o in outs:
        if o.shape != x.shape or o.dtype != x.dtype:
            return f"output has shape {tuple(o.shape)} {o.dtype}, expected {tuple(x.shape)} {x.dtype}", ""
        if o.data_ptr() == x.data_ptr():
            return "output aliases the input (the op is out of place)", ""
    outs_cpu = tuple(o.cpu() for o in outs)
    names = ("all_reduce",) if op == Op.ALL_REDUCE else ("normed", "new_residual")
    if kind == "exact":
        refs = (all_reduce_ref(xs),) if op == Op.ALL_REDUCE else all_reduce_residual_rmsnorm_ref(xs, residual, weight)
        for name, o, r in zip(names, outs_cpu, refs):
            if not torch.equal(o, r):
                bad = int((o != r).sum())  # NaN != NaN, so poisoned elements count
                return f"exact case ({'with' if has_residual else 'no'} residual): {name} differs from the reference in {bad} of {r.numel()} elements", ""
    else:
        xs64 = [t.double() for t in xs]
        res64 = residual.double() if residual is not None else None
        if op == Op.ALL_REDUCE:
            refs = (all_reduce_ref(xs64, acc_dtype=torch.float64),)
        else:
            refs = all_reduce_residual_rmsnorm_ref(xs64, res64, weight.double(), acc_dtype=torch.float64)
        tol = TOLERANCE[dtype]
        for name, o, r in zip(names, outs_cpu, refs):
            err = relative_error(o, r)
            if not err <= tol:
                return f"random case: {name} relative error {err:.3g} exceeds {tol:.3g}", ""
    return "", _digest(outs_cpu)


def check_candidate(instance, op: Op, *, tokens: int, hidden: int, dtype: torch.dtype, group,
                    rank: int, world_size: int, device: torch.device) -> Verdict:
    """Collective: the candidate's correctness verdict, identical on every rank (see module doc)."""
    cases = [("exact", True), ("random", True)]
    if op == Op.ALL_REDUCE_RESIDUAL_RMSNORM:
        cases.append(("exact", False))
    mine: list = []
    for kind, has_residual in cases:
        try:
            reason, digest = _run_case(instance, op, kind, rank, world_size, tokens, hidden, dtype, has_residual, device)
        except PeerLostError:  # not the candidate's fault alone: the group is out of step, stop the tune
            raise
        except Exception as exc:  # a broken candidate is rejected, not a crashed tune
            reason, digest = f"raised {type(exc).__name__}: {exc}", ""
        # No early exit: every rank runs every case, so all ranks issue the same collectives.
        mine.append((reason, digest))
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    failures = []
    for r, results in enumerate(everyone):
        for reason, _ in results:
            if reason:
                failures.append(f"rank {r}: {reason}")
    if failures:
        return Verdict.no("; ".join(failures))
    for i in range(len(cases)):
        if len({results[i][1] for results in everyone}) != 1:
            kind, has_residual = cases[i]
            return Verdict.no(f"{kind} case: ranks returned different bits (every rank must return identical outputs)")
    return Verdict.yes(f"bit-exact on small integers, within tolerance on random inputs, identical on {world_size} ranks")
