"""Run a function on N local ranks, each in its own spawned process with a process group.

Used by `selftest`, `tune`, `verify`, the benchmarks and the tests. `run_ranks(fn, N)` starts N
processes (spawn, never fork: CUDA and gloo both dislike forked state), initialises
torch.distributed over TCP on a free loopback port (gloo, or NCCL with one GPU per rank), calls
`fn(rank, world_size, *args)` and returns the N results in rank order. A rank that raises makes
`run_ranks` raise `RankFailure` with that rank's traceback; a rank that hangs past `timeout_s`
is killed, and the error names the ranks that never reported.

Lifecycle: a rank never outlives the process that started it. On Linux each rank asks the kernel
to SIGKILL it when its parent dies (prctl PR_SET_PDEATHSIG) and then checks that the parent has not
already gone; elsewhere a watchdog thread polls the parent's pid. So killing a command (SIGKILL,
SIGTERM, a closed terminal) takes its ranks with it at once; commands write their outputs from the
parent after every rank has reported, so an aborted run writes nothing.

Failures are reported fast: a rank reports its outcome before tearing down its process group
(which a dead peer can leave blocked), a rank that dies without reporting is named with its exit
code, and once one rank has failed the others get `FAILURE_GRACE_S` to report their own errors
before they are killed.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# <linux/prctl.h>: ask for a signal when the parent exits.
PR_SET_PDEATHSIG = 1
# After the first failure, how long the other ranks may take to report theirs: longer than the
# strategies' default peer timeout (TPFUSE_TIMEOUT_S, 5 s), so survivors name the dead peer
# themselves; short enough that a rank blocked in an unbounded collective is not waited on for long.
FAILURE_GRACE_S = 10.0
# A rank seen dead without a result is declared failed after this long, so that a result it queued
# just before exiting is still read (the queue's feeder flushes it before the process ends).
_EXIT_SETTLE_S = 1.0


class RankFailure(RuntimeError):
    """One or more ranks failed; `failures` maps rank -> formatted traceback or exit reason, and
    `results` holds the values of the ranks that did report one."""

    def __init__(self, failures: dict[int, str], results: dict[int, Any] | None = None) -> None:
        self.failures = failures
        self.results = dict(results or {})
        detail = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed: {sorted(failures)}\n{detail}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(parent_pid: int) -> None:
    """Make this process end when `parent_pid` (its parent) does; see the module doc.

    Linux signals the child when the *thread* that started it exits; `run_ranks` blocks in that
    thread until every rank has finished, so the two coincide."""
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
            prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
            armed = prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
        if armed:
            if os.getppid() != parent_pid:  # the parent died before the request took effect
                os.kill(os.getpid(), signal.SIGKILL)
            return
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="tpfuse-parent-watch", daemon=True).start()


def _worker(rank, world_size, backend, port, fn, args, results, env, parent_pid) -> None:
    die_with_parent(parent_pid)
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        # NCCL ranks are bound to their GPU up front, so collectives and barriers need not guess it.
        device_id = None
        if backend == "nccl":
            device_id = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device_id)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, device_id=device_id
        )
    except BaseException:  # report every failure to the parent, which raises RankFailure
        results.put((rank, False, traceback.format_exc()))
        return
    try:
        # Pickle here: torch's queue would share tensors by file descriptor, which dies with
        # this process; bytes survive it. Return CPU values (CUDA tensors would init CUDA in the parent).
        outcome = (rank, True, pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:
        outcome = (rank, False, traceback.format_exc())
    results.put(outcome)  # before the teardown, which a dead peer can block
    try:
        dist.destroy_process_group()
    except Exception:  # the outcome is reported; a group broken by a failed peer may not tear down cleanly
        pass


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process killed by {name} (exit code {code}) before reporting"
    return f"process exited with code {code} before reporting"


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "gloo",
    args: tuple = (),
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """`[fn(0, N, *args), ..., fn(N-1, N, *args)]`, each run in its own process; see module doc."""
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"run_ranks: backend must be 'gloo' or 'nccl', got {backend!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, backend, port, fn, args, results, dict(env or {}), os.getpid()),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    dead_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    first_failure = None
    finished = False
    try:
        while len(values) + len(failures) < world_size:
            now = time.monotonic()
            if failures and first_failure is None:
                first_failure = now
                deadline = min(deadline, now + FAILURE_GRACE_S)
            if now >= deadline:
                why = (f"still running {FAILURE_GRACE_S:.0f} s after rank(s) {sorted(failures)} failed "
                       "(waiting on a failed peer?); killed" if first_failure is not None
                       else f"no result within {timeout_s:.0f} s (hung or waiting on a peer)")
                for r in range(world_size):
                    if r not in values and r not in failures:
                        failures[r] = why
                break
            try:
                rank, ok, value = results.get(timeout=min(deadline - now, 0.5))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r in values or r in failures or p.is_alive():
                        continue
                    if now - dead_since.setdefault(r, now) >= _EXIT_SETTLE_S:
                        failures[r] = _exit_reason(p.exitcode)
                continue
            if ok:
                values[rank] = pickle.loads(value)
            else:
                failures[rank] = value
        finished = True
    finally:
        # Ranks that all reported get 5 s, shared, to tear down; after a failure or an interrupt
        # (KeyboardInterrupt here) they are killed at once.
        stop = time.monotonic() + (5.0 if finished and not failures else 0.5 if finished else 0.0)
        for p in procs:
            p.join(timeout=max(stop - time.monotonic(), 0.0))
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise RankFailure(failures, values)
    return [values[r] for r in range(world_size)]
