"""Bounded waits for host-side collectives, so that a dead or stuck peer is an error, not a hang.

A gloo request waits, by default, for its process group's timeout (30 minutes unless the group
was created with another). The host strategies (`reference`, `ring`) wait on every request for
the strategy's own bound instead: `timeout_s` (Communicator option, else TPFUSE_TIMEOUT_S, else 30 s),
shared by the requests of one wait (one ring step, one allreduce). A timeout or a lost connection becomes `PeerLostError`,
naming the rank, the peers it was waiting on and the remedy.

Why per request and not only "the peer's socket closed": a rank whose own neighbours are alive
never sees a closed socket when a rank further round the ring dies; its neighbour raised and
stopped sending, and the rank waited for the group timeout (the blocked survivors of a SIGKILL).

After a failure the group is out of step: an abandoned request may still complete later, and
point-to-point messages carry no call id, so a later call could receive an earlier call's data.
A `PeerGuard` therefore refuses every later call of its strategy with the first failure, and keeps
the abandoned requests (and so their buffers) alive, so gloo never writes into freed memory.

NCCL requests are not bounded here: waiting with a timeout blocks the host thread on the GPU,
which breaks CUDA-graph capture and stream ordering; NCCL's watchdog and the group timeout bound them.
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

from tpfuse import env


class PeerLostError(RuntimeError):
    """A host collective did not complete: a peer died, hangs, or calls a different collective."""


# Host waits without an explicit bound: longer than the GPU spin default (5 s), because a rank of
# a gloo group on a shared, loaded CPU can legitimately run seconds behind its peers (a first-call
# import or compile), and a spurious PeerLostError would end the group; still far below the
# process group's 30 minutes.
HOST_DEFAULT_TIMEOUT_S = 30.0


def strategy_timeout_s(options: dict, where: str = "") -> float:
    """The `timeout_s` Communicator option, else TPFUSE_TIMEOUT_S when set, else
    HOST_DEFAULT_TIMEOUT_S; ValueError unless > 0."""
    raw = options.get("timeout_s")
    if raw is None:
        return env.spin_timeout_s() if "TPFUSE_TIMEOUT_S" in os.environ else HOST_DEFAULT_TIMEOUT_S
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not raw > 0:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}timeout_s must be a positive number of seconds, got {raw!r}; e.g. timeout_s=5")
    return float(raw)


def goes_through_host(group, device) -> bool:
    """True when this group moves tensors of `device` through gloo (host), whose waits we bound."""
    return device.type == "cpu" or "nccl" not in str(dist.get_backend(group)).lower()


_REMEDY = "the process group is out of step: destroy the process group and start every rank again"


class PeerGuard:
    """Waits on one strategy's requests within `timeout_s` and remembers the first failure."""

    def __init__(self, where: str, rank: int, timeout_s: float, *, bounded: bool) -> None:
        self.where, self.rank, self.timeout_s, self.bounded = where, rank, timeout_s, bounded
        self._failure = ""
        self._abandoned: list = []  # requests gloo may still complete into; kept alive on purpose

    def check(self) -> None:
        """Raise PeerLostError if an earlier call of this strategy failed."""
        if self._failure:
            raise PeerLostError(f"{self.where}: rank {self.rank}: an earlier call failed ({self._failure}); {_REMEDY}")

    def wait(self, requests: list, peers: str) -> None:
        """Wait for every request; `peers` names who they depend on, for the error message."""
        self.check()
        if not self.bounded:
            for req in requests:
                req.wait()
            return
        start = time.monotonic()
        deadline = start + self.timeout_s
        for req in requests:
            remaining = max(deadline - time.monotonic(), 1e-3)
            try:
                req.wait(timeout=datetime.timedelta(seconds=remaining))
            except RuntimeError as exc:  # gloo raises RuntimeError (DistBackendError) for both cases
                self._abandoned.extend(requests)
                if time.monotonic() >= deadline:
                    self._failure = (f"waited {self.timeout_s:g} s for {peers} without an answer: a peer died, "
                                     "hangs, or calls another collective")
                else:
                    cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    self._failure = f"lost the connection to {peers} after {time.monotonic() - start:.2f} s ({cause[:300]})"
                raise PeerLostError(f"{self.where}: rank {self.rank} {self._failure}; {_REMEDY}") from exc
