"""A strategy for the failure-report tests only (registered through TPFUSE_STRATEGIES): admitted where
`reference` is, and every call raises, so that a command's ranks fail in the middle of a run."""

from tpfuse.strategies.reference import ReferenceStrategy


class RaisesStrategy(ReferenceStrategy):
    name = "raises"
    description = "test only: every call raises RuntimeError"

    def all_reduce(self, x):
        raise RuntimeError("raises: this strategy fails every call")

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps, *, quant=None):
        raise RuntimeError("raises: this strategy fails every call")


class RaisesOnRankOneLater(ReferenceStrategy):
    """Rank 1's twelfth fused call raises (as a peer kernel's timeout does on one rank), after the
    correctness check has passed: the other rank is then left inside a collective of the run."""

    name = "raises_on_rank_one_later"
    description = "test only: the reference, whose twelfth fused call on rank 1 raises RuntimeError"
    fused = True

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.calls = 0

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps, *, quant=None):
        self.calls += 1
        if self.ctx.rank == 1 and self.calls == 12:
            raise RuntimeError("raises_on_rank_one_later: rank 1 failed on the device")
        return super().all_reduce_residual_rmsnorm(x, residual, weight, eps, quant=quant)
