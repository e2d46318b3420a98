"""The Strategy contract: declare needs, answer admission, run the ops, release resources.

A strategy class declares `needs` (checked against probed facts by `check_needs`, never against
an architecture list) and may add shape rules in `extra_admits`. The Communicator creates one
instance per strategy it uses, bound to a `StrategyContext`, and calls it on the caller's
current CUDA stream. Instances that hold device resources release them in `close()`; nothing
is released in `__del__`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from tpfuse.spec import GroupFacts, Needs, Op, Problem, Verdict

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from tpfuse.probe.capabilities import Capabilities


@dataclass(frozen=True)
class StrategyContext:
    """What a strategy instance is bound to. `options` carries Communicator keyword options."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    facts: GroupFacts
    caps: Capabilities
    device: torch.device
    options: dict = field(default_factory=dict)


class Strategy(ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    # True when the epilogue runs fused with the collective; the do-no-harm guard compares fused
    # strategies against the best unfused one.
    fused: ClassVar[bool] = False
    needs: ClassVar[Needs] = Needs()

    @classmethod
    def admits(cls, problem: Problem, caps: Capabilities) -> Verdict:
        verdict = check_needs(cls.needs, problem, caps)
        return verdict if not verdict.ok else cls.extra_admits(problem, caps)

    @classmethod
    def extra_admits(cls, problem: Problem, caps: Capabilities) -> Verdict:
        """Shape rules beyond `needs` (alignment, workspace fit); override with a reason."""
        return Verdict.yes()

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx

    def prepare(self, *, hidden: int, dtype: torch.dtype, max_tokens: int) -> None:
        """Allocate whatever the ops need for shapes up to `max_tokens x hidden`, outside graph capture."""

    def prepare_buckets(self, *, hidden: int, dtype: torch.dtype, max_tokens: int, buckets: tuple[int, ...],
                        op: Op | None = None) -> None:
        """What tune calls before it measures calls of the token counts `buckets` (each at most
        `max_tokens`): sizes as for prepare(max_tokens), set-up work only for calls of those counts
        (of `op` alone when given), not for every count up to max_tokens. Override where prepare()
        costs much more than the buckets' share (the peer strategies compile a kernel variant per
        plan); by default tune calls prepare() once."""
        self.prepare(hidden=hidden, dtype=dtype, max_tokens=max_tokens)

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the group's ranks, out of place, same dtype and shape."""

    @abstractmethod
    def all_reduce_residual_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, new_residual) as defined in tpfuse.reference, on validated inputs.

        Strategies whose `needs.quant` lists formats also take `quant=` (a tpfuse.quant.QuantSpec
        of one of them) and then return a tpfuse.quant.QuantOutput; they are called with it only
        for problems whose `quant` they admitted."""

    def fused_route(self, num_tokens: int, hidden: int, dtype: torch.dtype, *, has_residual: bool):
        """What serves unquantized `all_reduce_residual_rmsnorm` calls of this shape, called as that
        method is (x, residual, weight, eps), validated rows only. The Communicator asks once per
        shape and keeps it; strategies with a per-shape route of their own return it, so a steady
        call skips their lookup. Default: the method itself."""
        return self.all_reduce_residual_rmsnorm

    def check(self) -> None:
        """Raise if an earlier asynchronous call failed on the device (e.g. a peer timeout seen
        only after CUDA-graph replays); synchronises. Strategies without device-side state pass."""

    def close(self) -> None:
        """Release device resources; called by Communicator.close() on every rank."""


def check_needs(needs: Needs, problem: Problem, caps: Capabilities) -> Verdict:
    """Check declared needs against the problem's group facts and probed capabilities."""
    facts = problem.facts
    if problem.op not in needs.ops:
        return Verdict.no(f"does not implement {problem.op.value}")
    if problem.quant is not None and problem.quant not in needs.quant:
        return Verdict.no(f"does not implement quantized output {problem.quant}"
                          + (f" (implements {', '.join(needs.quant)})" if needs.quant else " (no quantized output)"))
    if problem.dtype not in needs.dtypes:
        return Verdict.no(f"dtype {problem.dtype} not supported (supports {', '.join(needs.dtypes)})")
    if needs.cuda and facts.device_type != "cuda":
        return Verdict.no(f"needs CUDA tensors; this group runs on {facts.device_type}")
    if needs.cuda and not caps.has_gpu:
        return Verdict.no("needs a CUDA GPU; the probe found none")
    if needs.nccl and facts.backend != "nccl":
        return Verdict.no(f"needs the NCCL process-group backend; this group uses {facts.backend}")
    if needs.single_host and facts.num_hosts != 1:
        return Verdict.no(f"needs all ranks on one host; the group spans {facts.num_hosts} hosts")
    if needs.peer_access and not facts.peer_access:
        return Verdict.no(
            "needs peer access between every pair of ranks' GPUs (or one shared GPU); "
            "at least one pair cannot map the other's memory"
        )
    if needs.package is not None:
        package = caps.package(needs.package)
        if package is None or not package.available:
            why = package.reason if package is not None else "not probed"
            return Verdict.no(f"needs the package {needs.package!r}: {why}")
    if needs.hidden_multiple > 1 and problem.hidden % needs.hidden_multiple:
        return Verdict.no(
            f"hidden size {problem.hidden} is not a multiple of {needs.hidden_multiple} "
            "(16-byte vector accesses); pad the hidden dimension"
        )
    if needs.max_input_bytes is not None and problem.nbytes > needs.max_input_bytes:
        return Verdict.no(f"input of {problem.nbytes} bytes exceeds the limit of {needs.max_input_bytes} bytes")
    return Verdict.yes()
