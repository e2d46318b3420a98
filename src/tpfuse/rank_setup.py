"""What a spawned rank of a command sets up for itself (no torch at import).

`share_cpu_threads` gives a CPU rank its share of the cores; `progress_bar` is rank 0's bar on
stderr. Used by the ranks of `tpfuse selftest`, `tune` and `verify` and by the benchmarks;
`tpfuse.spawn.run_ranks` starts the ranks.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


def share_cpu_threads(world_size: int, device: str) -> None:
    """In a spawned CPU rank: use this rank's share of the cores for torch's intra-op threads.

    N ranks each running one thread per core oversubscribe the machine (OpenMP threads spin while
    a peer waits in a collective), and times then measure the contention, not the strategy.
    torchrun sets OMP_NUM_THREADS=1 for multi-process runs for the same reason; here each rank gets
    cores // N threads. An explicit OMP_NUM_THREADS is left alone.
    """
    import os

    if device != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


@contextlib.contextmanager
def progress_bar(total: int, description: str, enabled: bool) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on stderr (when `enabled` and stderr is a terminal); yields advance(text)."""
    if not enabled or not sys.stderr.isatty():
        yield lambda text: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda text: bar.update(task, advance=1, description=f"{description}: {text}")
