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
