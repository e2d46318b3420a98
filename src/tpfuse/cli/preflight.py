"""Checks every command runs before it spawns a rank or imports torch: cheap facts first.

The commands that spawn local ranks (selftest, tune, verify, bench e2e, profile) call, in order:
1. `check_world_size` and `require_runtime` (no torch: os, /proc and importlib only), so a bad
   `--world-size` or a missing runtime package fails in milliseconds with the fix named;
2. after torch is imported for the launch mode, `not_admitted_anywhere` (the probe and admission
   in this process, with the group the ranks would agree on), so asking for a strategy that cannot
   run here is one reason and exit 2 instead of a table of per-bucket failures.
Every failure is a `UsageError` (exit 2) whose message ends with the fix.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable

from tpfuse.cli.exits import UsageError

# CPU ranks are processes sharing the usable cores. Each imports torch (about 1 s of one core
# measured here, several seconds on a loaded machine) and then blocks in gloo collectives; past a
# few ranks per core the start-up alone outlasts the store's connect timeout and the run fails
# after minutes (100 ranks on 2 cores: 330 s, then a thousand lines of store errors). 4 per core
# is a bound chosen well inside what worked here (2 cores: 8 ranks), not a measured maximum.
CPU_RANKS_PER_CORE = 4
# Resident memory budget per rank: a rank with torch and a gloo group measured 220 MiB RSS; the
# selftest and tune tensors at hidden 8192 add a few MiB. 512 MiB leaves room for both.
RANK_MEMORY_BYTES = 512 * 2**20

# Packages the product needs at run time that torch does not declare: torch.distributed's
# object collectives (all_gather_object, used when a Communicator is built) call Tensor.numpy().
RUNTIME_PACKAGES = {"numpy": "torch.distributed.all_gather_object (Communicator construction) calls Tensor.numpy()"}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def available_memory_bytes(meminfo_path: str = "/proc/meminfo") -> int | None:
    try:
        with open(meminfo_path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def max_local_ranks(*, cores: int | None = None, memory_bytes: int | None = None) -> tuple[int, str]:
    """(the most local ranks this host can run as processes, why that number)."""
    cores = usable_cores() if cores is None else cores
    memory_bytes = available_memory_bytes() if memory_bytes is None else memory_bytes
    limit, why = CPU_RANKS_PER_CORE * cores, f"{CPU_RANKS_PER_CORE} rank processes per usable core, {cores} core(s)"
    if memory_bytes is not None and memory_bytes // RANK_MEMORY_BYTES < limit:
        limit = int(memory_bytes // RANK_MEMORY_BYTES)
        why = f"{RANK_MEMORY_BYTES // 2**20} MiB per rank, {memory_bytes / 2**30:.1f} GiB available"
    return max(limit, 1), why


def check_world_size(value: int | None, *, cores: int | None = None,
                     memory_bytes: int | None = None) -> None:
    """UsageError unless `value` is None (the command's default) or 1 <= value <= max_local_ranks()."""
    if value is None:
        return
    if value < 1:
        raise UsageError(f"--world-size must be >= 1, got {value}; pass the number of local ranks, e.g. --world-size 2")
    limit, why = max_local_ranks(cores=cores, memory_bytes=memory_bytes)
    if value > limit:
        raise UsageError(f"--world-size {value} is more local ranks than this machine can run: at most {limit} "
                         f"({why}); use --world-size {limit} or less")


def require_runtime() -> None:
    """UsageError naming the install command when a package the ranks need at run time is missing."""
    for name, why in RUNTIME_PACKAGES.items():
        if importlib.util.find_spec(name) is None:
            raise UsageError(f"{name} is not installed and the ranks need it ({why}); install it with "
                             f"`pip install {name}` (tpfuse declares it: `pip install .` brings it)")


def check_positive(**flags: int | None) -> None:
    """UsageError for the first flag (given as --name=value keywords, '_' for '-') below 1."""
    for name, value in flags.items():
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} must be >= 1, got {value}; pass a positive integer")


def admission_here(names: Iterable[str], problems: Iterable[tuple], *, world_size: int, backend: str,
                   device: str) -> dict[str, dict]:
    """{strategy: {problem tuple: Verdict}} for `problems` given as (op, num_tokens, hidden, dtype, has_residual)."""
    from tpfuse.group import expected_group_facts
    from tpfuse.probe import probe
    from tpfuse.spec import Op, Problem
    from tpfuse.strategies import admission

    caps = probe()
    facts = expected_group_facts(caps, world_size, backend=backend, device_type=device)
    names = list(names)
    out: dict[str, dict] = {name: {} for name in names}
    for op, num_tokens, hidden, dtype, has_residual in problems:
        verdicts = admission(Problem(Op(op), num_tokens, hidden, dtype, facts, has_residual), caps, names)
        for name in names:
            out[name][(op, num_tokens, hidden, dtype, has_residual)] = verdicts[name]
    return out


def reject_not_admitted(names: Iterable[str], problems: list[tuple], *, world_size: int, backend: str, device: str,
                        flag: str = "--strategy") -> None:
    """UsageError, with each reason said once, for every named strategy admitted for none of `problems`."""
    verdicts = admission_here(names, problems, world_size=world_size, backend=backend, device=device)
    refused = {}
    for name, by_problem in verdicts.items():
        if by_problem and not any(v.ok for v in by_problem.values()):
            refused[name] = next(iter(by_problem.values())).reason
    if refused:
        where = f"{world_size} {backend} rank(s) on {device}"
        reasons = "; ".join(f"{name}: {reason}" for name, reason in refused.items())
        raise UsageError(f"{flag} {', '.join(refused)} is not admitted on {where} ({reasons}); "
                         "`tpfuse doctor` lists what is admitted here and why")


def check_writable(path: str, *, flag: str, directory: bool = False) -> None:
    """UsageError unless `path` (a file, or a directory when `directory`) can be created or written,
    checked before the work so that a run does not end by failing to save what it measured."""
    from pathlib import Path

    target = Path(path).expanduser()
    if target.exists() and target.is_dir() != directory:
        raise UsageError(f"{flag} {path} is {'a file' if directory else 'a directory'}; pass a "
                         f"{'directory' if directory else 'file'} path")
    existing = target if target.exists() else target.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path} cannot be written: {existing} is not a writable directory; pass a path "
                         "under a directory you can write")
