"""A strategy whose first call fails "on the device" the way a peer kernel's timeout does: the call
returns (correct data here), the failure is recorded, `check()` raises it and every later call
refuses to run. For the Communicator's contract that such an error surfaces at the next call or at
check(), also once the call's route is cached."""

from tpfuse.strategies.reference import ReferenceStrategy


class StickyDeviceError(RuntimeError):
    """Stands in for PeerTimeoutError."""


class FailsAfterFirstCall(ReferenceStrategy):
    name = "fails_after_first_call"
    description = "test only: the reference, whose first call records a sticky asynchronous failure"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.calls = 0

    def _before(self) -> None:
        if self.calls:
            raise StickyDeviceError(f"{self.name}: rank {self.ctx.rank}: call 0 timed out on the device")
        self.calls += 1

    def all_reduce(self, x):
        self._before()
        return super().all_reduce(x)

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps, *, quant=None):
        self._before()
        return super().all_reduce_residual_rmsnorm(x, residual, weight, eps, quant=quant)

    def check(self) -> None:
        if self.calls:
            raise StickyDeviceError(f"{self.name}: rank {self.ctx.rank}: call 0 timed out on the device")
