"""Bounded host-side collectives, so that a dead or stuck peer is an error naming it, not a hang.

A gloo request waits, by default, for its process group's timeout (30 minutes unless the group
was created with another), and so does a process that exits with such a request pending: the
group's worker threads finish only when the request does. The host strategies (`reference`,
`ring`) therefore move their data over a `HostGroup`: a private gloo process group of the same
ranks, created with the strategy's bound as its own timeout (`timeout_s`: Communicator option,
else TPFUSE_TIMEOUT_S, else `env.HOST_DEFAULT_TIMEOUT_S`), so that an abandoned request ends
within the bound and `close()` and interpreter exit return within it too. Every wait is bounded
as well, shared by the requests of one wait (one ring step, one allreduce); a timeout or a lost
connection becomes `PeerLostError`.

Why per request and not only "the peer's socket closed": a rank whose own neighbours are alive
never sees a closed socket when a rank further round the ring dies; its neighbour raised and
stopped sending, and the rank waited for the group timeout (the blocked survivors of a SIGKILL).

Who failed: at construction every rank writes its host and pid to the group's store; a rank that
fails writes its reason there, then waits up to `CENSUS_S` for the others' and names them: the
ranks whose process has exited (same host: the pid is gone), those alive but silent (stuck, or
calling another collective), and those that failed the same way (victims, not the cause). When the
rank whose process hosts the store (world rank 0 under tcp:// or env:// rendezvous) is seen gone,
or the store does not answer, the census says so instead of waiting on it.

After a failure the group is out of step: an abandoned request may still complete later, and
point-to-point messages carry no call id, so a later call could receive an earlier call's data.
A `PeerGuard` therefore refuses every later call of its strategy with the first failure, and keeps
the abandoned requests (and so their buffers) alive until they end, so gloo never writes into
freed memory.

NCCL requests are not bounded here: waiting with a timeout blocks the host thread on the GPU,
which breaks CUDA-graph capture and stream ordering; NCCL's watchdog and the group timeout bound them.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections import Counter

import torch
import torch.distributed as dist

from tpfuse import env


class PeerLostError(RuntimeError):
    """A host collective did not complete: a peer died, hangs, or calls a different collective."""


# How long a failed rank waits for the other ranks' failure reports before it names who is silent:
# the survivors of one stuck or dead peer time out within milliseconds of each other (they entered
# the call together), so one second separates them from the rank that never answers.
CENSUS_S = 1.0
_POLL_S = 0.05

# HostGroups created per process group, so every rank names the n-th one's store keys alike (the
# host strategies are created at the same call on every rank: their choice is rank-identical).
_CREATED: Counter = Counter()


def strategy_timeout_s(options: dict, where: str = "") -> float:
    """The `timeout_s` Communicator option, else TPFUSE_TIMEOUT_S when set, else
    `env.HOST_DEFAULT_TIMEOUT_S`; ValueError unless finite and in (0, `env.MAX_TIMEOUT_S`]."""
    raw = options.get("timeout_s")
    if raw is None:
        return env.host_timeout_s()
    try:
        return env.check_timeout_s(raw, "timeout_s")
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}" if where else str(exc)) from None


def goes_through_host(group, device) -> bool:
    """True when this group moves tensors of `device` through gloo (host), whose waits we bound."""
    return device.type == "cpu" or "nccl" not in str(dist.get_backend(group)).lower()


def refuse_capture(where: str) -> None:
    """Raise RuntimeError when the current CUDA stream is capturing a graph: a strategy that stages
    CUDA tensors through the host (gloo) has copies and host waits no graph can hold. Called at the
    entry of every op, before any exchange, so every rank of a capture refuses at the same point;
    refused later, the ranks part ways (a ring step whose send is empty on one rank posts its
    receive and waits, while the neighbour's staging copy fails at once)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{where}: moves CUDA tensors through the host over gloo, which a CUDA graph cannot "
                           "capture; run it eagerly, or capture over an NCCL group or with a peer strategy")


_REMEDY = "the process group is out of step: destroy the process group and start every rank again"


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _process_gone(pid: int) -> bool:
    """True when `pid` (on this host) no longer runs: no such process, or a zombie not yet reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _gloo_group(store, rank: int, world_size: int, timeout_s: float):
    """A gloo process group of its own whose timeout is `timeout_s`: a ProcessGroup over one gloo
    backend, as torch.distributed builds its groups, so that its collectives are dispatched as the
    `c10d::` ops profilers and hooks see (a bare backend's are not)."""
    backend = dist.ProcessGroupGloo(dist.PrefixStore("pg/", store), rank, world_size,
                                    datetime.timedelta(seconds=timeout_s))
    group = dist.ProcessGroup(store, rank, world_size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


class HostGroup:
    """The ranks of a gloo `group` on a private gloo process group whose own timeout is
    `timeout_s`, and the census of who failed (module doc). A collective to create: every rank of
    `group` creates its n-th HostGroup at the same point; one that cannot connect to its peers
    within `timeout_s` raises PeerLostError."""

    def __init__(self, group, timeout_s: float, where: str) -> None:
        self.rank, self.world_size, self.where = dist.get_rank(group), dist.get_world_size(group), where
        name = getattr(group, "group_name", "") or str(id(group))
        _CREATED[name] += 1
        self.store = dist.PrefixStore(f"tpfuse/host-group/{where}/{_CREATED[name]}/", group.get_group_store())
        self.host = socket.gethostname()
        try:
            self.store.set(f"pid/{self.rank}", f"{self.host}\n{os.getpid()}")
            self.pg = _gloo_group(self.store, self.rank, self.world_size, timeout_s)
            # Every rank wrote its key before joining the group, so all are there now.
            self.peers = {r: tuple(self.store.get(f"pid/{r}").decode().split("\n")) for r in range(self.world_size)}
        except RuntimeError as exc:  # DistStoreError and gloo's connect errors are RuntimeErrors
            cause = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise PeerLostError(f"{where}: rank {self.rank} could not connect to the other ranks within "
                                f"{timeout_s:g} s ({cause}); {_REMEDY}") from exc
        # The store's server runs in the process of world rank 0 (tcp:// and env:// rendezvous): when
        # that process is gone, asking the store would only fail (and torch would log a stack for it).
        self.store_rank = dist.get_group_rank(group, 0) if 0 in dist.get_process_group_ranks(group) else None

    def census(self, failure: str) -> str:
        """Report `failure` for this rank, wait up to CENSUS_S for the others, and say who failed."""
        others = set(range(self.world_size)) - {self.rank}
        reported: set[int] = set()
        exited = {r for r in others if self._exited(r)}
        if self.store_rank in exited:
            return (f"{_ranks(exited)} exited (no process left on this host); rank {self.store_rank} hosted the "
                    "group's store, so the others could not report")
        try:
            self.store.set(f"failed/{self.rank}", failure)
            deadline = time.monotonic() + CENSUS_S
            while True:
                reported = {r for r in others if self.store.check([f"failed/{r}"])}
                exited = {r for r in others - reported if self._exited(r)}
                if reported | exited == others or time.monotonic() >= deadline:
                    break
                time.sleep(_POLL_S)
        except RuntimeError:
            return ("the group's store is unreachable: the rank that hosts it (world rank 0 under tcp:// or "
                    "env:// rendezvous) has died")
        parts = []
        if exited:
            parts.append(f"{_ranks(exited)} exited (no process left on this host)")
        silent = others - reported - exited
        if silent:
            here = {r for r in silent if self.peers[r][0] == self.host}
            if here:
                parts.append(f"{_ranks(here)} alive but did not answer (stuck, or calling another collective)")
            if silent - here:
                parts.append(f"{_ranks(silent - here)} on another host did not answer (dead or stuck)")
        if reported:
            parts.append(f"{_ranks(reported)} failed waiting too")
        return "; ".join(parts)

    def _exited(self, rank: int) -> bool:
        host, pid = self.peers[rank]
        return host == self.host and pid.isdigit() and _process_gone(int(pid))


class PeerGuard:
    """Waits on one strategy's requests within `timeout_s` and remembers the first failure;
    with a `HostGroup`, the failure names who failed (its census)."""

    def __init__(self, where: str, rank: int, timeout_s: float, *, bounded: bool,
                 host_group: HostGroup | None = None) -> None:
        self.where, self.rank, self.timeout_s, self.bounded = where, rank, timeout_s, bounded
        self.host_group = host_group
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
                if time.monotonic() >= deadline or "timed out" in str(exc).lower():
                    failure = f"waited {self.timeout_s:g} s for {peers} without an answer"
                else:
                    cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    failure = f"lost the connection to {peers} after {time.monotonic() - start:.2f} s ({cause[:300]})"
                who = self.host_group.census(failure) if self.host_group is not None else ""
                who = who or "a peer died, hangs, or calls another collective"
                self._failure = f"{failure}: {who}"
                raise PeerLostError(f"{self.where}: rank {self.rank} {self._failure}; {_REMEDY}") from exc

    def close(self) -> None:
        """Drop the abandoned requests: with a HostGroup they end within its timeout."""
        self._abandoned.clear()
