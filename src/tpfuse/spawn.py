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

Failures are reported fast and named: a rank reports its outcome before tearing down its process
group (which a dead peer can leave blocked); a rank that dies without reporting is named with its
exit code or signal, and a SIGKILL while the kernel's out-of-memory kill counters rose
(`tpfuse.host_memory.oom_kills`) is named an OOM kill, with the rank's last resident size seen and
the memory left; once one rank has failed, the others get `failure_grace_s` (longer than the host
strategies' peer bound plus their census, so survivors name the failed peer themselves) to
report their own errors before they are killed.

Outcomes travel over one pipe per rank, not a multiprocessing queue: a queue holds semaphores,
which the resource tracker reports as leaked when the parent is killed; a pipe is a plain file
descriptor, and its end of file says the rank is gone.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for_pipes
from typing import Any

import torch.multiprocessing as mp

from tpfuse import env as tpfuse_env
from tpfuse.host_memory import available_bytes, format_bytes, oom_kills, resident_bytes
from tpfuse.strategies.host_wait import CENSUS_S

# <linux/prctl.h>: ask for a signal when the parent exits.
PR_SET_PDEATHSIG = 1
# A survivor's report crossing the pipe after its own error, on a loaded 2-core machine (a chosen
# slack, measured in seconds of scheduling delay there, not in compute).
REPORT_SLACK_S = 5.0
# How long the parent waits for a rank whose pipe closed to show its exit code.
_EXIT_CODE_WAIT_S = 1.0


def failure_grace_s(env: dict[str, str] | None = None) -> float:
    """After the first failure, how long the other ranks may take to report theirs: the host
    strategies' peer bound (TPFUSE_TIMEOUT_S in `env` or here, else its default) plus their
    census and REPORT_SLACK_S, so survivors name the dead peer themselves before they are killed."""
    raw = (env or {}).get("TPFUSE_TIMEOUT_S", os.environ.get("TPFUSE_TIMEOUT_S"))
    bound = tpfuse_env.HOST_DEFAULT_TIMEOUT_S if raw is None else tpfuse_env.parse_timeout_s(raw)
    return bound + CENSUS_S + REPORT_SLACK_S


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


def _worker(rank, world_size, backend, port, fn, args, conn, env, parent_pid) -> None:
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
        conn.send_bytes(pickle.dumps((False, traceback.format_exc())))
        return
    try:
        # Pickled here: the bytes survive this process. Return CPU values (CUDA tensors would
        # init CUDA in the parent).
        outcome = (True, pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:
        outcome = (False, traceback.format_exc())
    conn.send_bytes(pickle.dumps(outcome))  # before the teardown, which a dead peer can block
    conn.close()
    try:
        dist.destroy_process_group()
    except Exception:  # the outcome is reported; a group broken by a failed peer may not tear down cleanly
        pass


def _exit_reason(code: int | None, *, oom_rose: dict[str, int] | None = None, rss: int | None = None,
                 available: int | None = None) -> str:
    """Why a rank ended without reporting: its exit code or signal; an OOM kill when it was SIGKILLed
    while an OOM-kill counter rose (`oom_rose`: counter -> increase), with its last resident size."""
    if code == -signal.SIGKILL and oom_rose:
        evidence = ", ".join(f"{name} rose by {n}" for name, n in oom_rose.items())
        held = f" holding {format_bytes(rss)} resident when last seen" if rss else ""
        left = f", {format_bytes(available)} available now" if available is not None else ""
        return (f"process killed by the kernel's out-of-memory killer (SIGKILL; {evidence}){held}{left}; give each "
                "rank less to hold (fewer tokens, a smaller hidden size or model cut) or run fewer ranks")
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        held = f", {format_bytes(rss)} resident when last seen" if rss and code == -signal.SIGKILL else ""
        return f"process killed by {name} (exit code {code}) before reporting{held}"
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
    port = free_port()
    pipes, procs = [], []
    for r in range(world_size):
        reader, writer = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=_worker, daemon=True, args=(r, world_size, backend, port, fn, args, writer,
                                                                    dict(env or {}), os.getpid())))
        pipes.append((reader, writer))
    oom_before = oom_kills()
    for p, (_, writer) in zip(procs, pipes):
        p.start()
        writer.close()  # the child holds the write end: end of file here means the child is gone
    rank_of = {reader: r for r, (reader, _) in enumerate(pipes)}
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    last_rss: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    first_failure = None
    finished = False
    try:
        while len(values) + len(failures) < world_size:
            now = time.monotonic()
            if failures and first_failure is None:
                first_failure = now
                deadline = min(deadline, now + failure_grace_s(env))
            if now >= deadline:
                why = (f"still running {now - first_failure:.0f} s after rank(s) {sorted(failures)} failed "
                       "(waiting on a failed peer?); killed" if first_failure is not None
                       else f"no result within {timeout_s:.0f} s (hung or waiting on a peer)")
                for r in range(world_size):
                    if r not in values and r not in failures:
                        failures[r] = why
                break
            for r, p in enumerate(procs):  # the last resident size seen, for an OOM kill's message
                if r not in values and r not in failures:
                    rss = resident_bytes(p.pid)
                    if rss:
                        last_rss[r] = rss
            for reader in wait_for_pipes(list(rank_of), timeout=min(deadline - now, 0.5)):
                rank = rank_of.pop(reader)
                try:
                    ok, value = pickle.loads(reader.recv_bytes())
                except EOFError:  # the rank ended without reporting
                    procs[rank].join(timeout=_EXIT_CODE_WAIT_S)
                    rose = {k: v - oom_before.get(k, 0) for k, v in oom_kills().items() if v > oom_before.get(k, v)}
                    failures[rank] = _exit_reason(procs[rank].exitcode, oom_rose=rose, rss=last_rss.get(rank),
                                                  available=available_bytes())
                    continue
                finally:
                    reader.close()
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
        for reader in rank_of:
            reader.close()
    if failures:
        raise RankFailure(failures, values)
    return [values[r] for r in range(world_size)]
