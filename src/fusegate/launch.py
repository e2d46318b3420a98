"""Run a function on N local ranks, each in its own spawned process with a process group.

Used by `selftest`, `tune`, `verify`, the benchmarks and the tests. `run_ranks(fn, N)` starts N
processes (spawn, never fork: CUDA and gloo both dislike forked state), initialises
torch.distributed over TCP on a free loopback port (gloo, or NCCL with one GPU per rank), calls
`fn(rank, world_size, *args)` and returns the N results in rank order. A rank that raises makes
`run_ranks` raise `RankFailure` with that rank's traceback; a rank that hangs past `timeout_s`
is killed, and the error names the ranks that never reported.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """One or more ranks failed; `failures` maps rank -> formatted traceback or exit reason."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        detail = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed: {sorted(failures)}\n{detail}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, backend, port, fn, args, results, env) -> None:
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
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Pickle here: torch's queue would share tensors by file descriptor, which dies with
        # this process; bytes survive it. Return CPU values (CUDA tensors would init CUDA in the parent).
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report every failure to the parent, which raises RankFailure
        results.put((rank, False, traceback.format_exc()))


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
        ctx.Process(target=_worker, args=(r, world_size, backend, port, fn, args, results, dict(env or {})), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(values) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for r in range(world_size):
                    if r not in values and r not in failures:
                        failures[r] = f"no result within {timeout_s:.0f} s (hung or waiting on a peer)"
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if not p.is_alive() and r not in values and r not in failures and p.exitcode not in (0, None):
                        failures[r] = f"process exited with code {p.exitcode} before reporting"
                continue
            if ok:
                values[rank] = pickle.loads(value)
            else:
                failures[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise RankFailure(failures)
    return [values[r] for r in range(world_size)]
