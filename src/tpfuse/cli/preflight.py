"""Checks every command runs before it spawns a rank or imports torch: cheap facts first.

The commands that spawn local ranks (selftest, tune, verify, bench e2e, profile) call, in order:
1. `check_world_size`, `check_environment` and `require_runtime` (no torch: os, /proc and
   importlib only), so a bad `--world-size`, a bad TPFUSE_* variable or a missing runtime package
   fails in milliseconds with the fix named; `check_writable` for every path the run will write;
2. `check_rank_memory` with the command's estimate of what one rank holds (`check_bytes` for the
   correctness checks of selftest, tune and verify; the model's own for bench e2e and profile),
   so a size that cannot fit is refused before any rank starts, not killed by the kernel later;
3. `reject_not_admitted` for a strategy asked for by name: a built-in that needs CUDA is refused
   for CPU ranks at once (no torch); otherwise the probe and admission run in this process, with
   the group the ranks would agree on, so a strategy that cannot run here is one reason and exit 2
   instead of a table of per-bucket failures.
Every failure is a `UsageError` (exit 2) whose message ends with the fix.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable

from tpfuse import env, host_memory
from tpfuse.cli.exits import UsageError
from tpfuse.host_memory import format_bytes

# CPU ranks are processes sharing the usable cores. Each imports torch (about 1 s of one core
# measured here, several seconds on a loaded machine) and then blocks in gloo collectives; past a
# few ranks per core the start-up alone outlasts the store's connect timeout and the run fails
# after minutes (100 ranks on 2 cores: 330 s, then a thousand lines of store errors). 4 per core
# is a bound chosen well inside what worked here (2 cores: 8 ranks), not a measured maximum.
CPU_RANKS_PER_CORE = 4
# Resident memory budget of a rank process itself: a rank with torch and a gloo group measured
# 220 MiB RSS, 310-340 MiB after selftest's or tune's smallest cases. 512 MiB leaves room.
RANK_MEMORY_BYTES = 512 * 2**20
# What the correctness check and the timing of one call hold at once, in float64 copies of its
# [tokens, hidden] input: measured about 10 (peak RSS per rank, 2 gloo ranks: `tpfuse selftest
# --strategy reference --tokens 2048` 1583 MiB against 310 MiB at 4 tokens, hidden 8192; `tpfuse
# tune --preset glm5 --max-tokens 1024 --no-save` 805 MiB against 339 MiB at 64 tokens); 16 leaves
# room. tests/cli/test_preflight.py checks the estimate against a rank's measured peak.
CHECK_COPIES = 16

# Packages the product needs at run time that torch does not declare: torch.distributed's
# object collectives (all_gather_object, used when a Communicator is built) call Tensor.numpy().
RUNTIME_PACKAGES = {"numpy": "torch.distributed.all_gather_object (Communicator construction) calls Tensor.numpy()"}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def max_local_ranks(*, cores: int | None = None, memory_bytes: int | None = None) -> tuple[int, str]:
    """(the most local ranks this host can run as processes, why that number)."""
    cores = usable_cores() if cores is None else cores
    memory_bytes = host_memory.available_bytes() if memory_bytes is None else memory_bytes
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


def check_environment() -> None:
    """UsageError naming the variable for a TPFUSE_* value the ranks would refuse (`tpfuse.env`)."""
    try:
        env.strategy_override(), env.debug_enabled(), env.host_timeout_s(), env.extra_strategies(), env.cache_dir()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_bytes(num_tokens: int, hidden: int) -> int:
    """Bytes one rank holds to check and time one call of `num_tokens` x `hidden` (CHECK_COPIES)."""
    return CHECK_COPIES * num_tokens * hidden * 8


def gpu_memory_bytes() -> int | None:
    """The smallest GPU's memory here (imports torch: call only for CUDA ranks)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.device_count():
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


def check_rank_memory(per_rank: int, *, world_size: int, device: str, shared_gpu: bool = False, what: str,
                      fix: str) -> None:
    """UsageError when `world_size` ranks each holding `per_rank` bytes (on the host for CPU ranks, on
    their GPU for CUDA ranks, all on one with `shared_gpu`) plus the process itself do not fit the
    memory available now; `what` names the work, `fix` how to make it smaller."""
    on_host = world_size * (RANK_MEMORY_BYTES + (per_rank if device == "cpu" else 0))
    available = host_memory.available_bytes()
    if available is not None and on_host > available:
        total = f", {format_bytes(on_host)} for {world_size} ranks," if world_size > 1 else ""
        raise UsageError(f"{what} needs about {format_bytes(per_rank + RANK_MEMORY_BYTES)} per rank{total} and "
                         f"{format_bytes(available)} is available; {fix}")
    if device == "cuda":
        on_gpu, gpu = per_rank * (world_size if shared_gpu else 1), gpu_memory_bytes()
        if gpu is not None and on_gpu > gpu:
            raise UsageError(f"{what} needs about {format_bytes(on_gpu)} on a GPU of {format_bytes(gpu)}; {fix}")


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


def cuda_only_on_cpu(names: Iterable[str], device: str) -> dict[str, str]:
    """{name: reason} for the named built-ins that need CUDA tensors when the ranks run on `device`
    "cpu", decided without torch (`tpfuse.strategies.needs_cuda`); {} otherwise."""
    from tpfuse.strategies import needs_cuda

    if device != "cpu":
        return {}
    return {name: "needs CUDA tensors; this group runs on cpu" for name in names if needs_cuda(name)}


def reject_not_admitted(names: Iterable[str], problems: list[tuple] | Callable[[], list[tuple]], *, world_size: int,
                        backend: str, device: str, flag: str = "--strategy") -> None:
    """UsageError, with each reason said once, for every named strategy admitted for none of
    `problems` (or of what the callable returns: called only when the torch-free check did not
    already decide every name)."""
    names = list(names)
    refused = cuda_only_on_cpu(names, device)
    rest = [name for name in names if name not in refused]
    if rest:
        problems = problems() if callable(problems) else problems
        verdicts = admission_here(rest, problems, world_size=world_size, backend=backend, device=device)
        for name, by_problem in verdicts.items():
            if by_problem and not any(v.ok for v in by_problem.values()):
                refused[name] = next(iter(by_problem.values())).reason
    if refused:
        refused = {name: refused[name] for name in names if name in refused}
        where = f"{world_size} {backend} rank(s) on {device}"
        reasons = "; ".join(f"{name}: {reason}" for name, reason in refused.items())
        raise UsageError(f"{flag} {', '.join(refused)} is not admitted on {where} ({reasons}); "
                         "`tpfuse doctor` lists what is admitted here and why")


def check_writable(path: str, *, flag: str) -> None:
    """UsageError unless the file `path` can be written: tried for real (the file opened for
    appending, or created and removed; a missing folder created and removed in its nearest existing
    ancestor), before the work, so that a run does not end by failing to save what it measured
    (permission bits lie to root, and /proc accepts no new file whatever they say)."""
    import tempfile
    from pathlib import Path

    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a directory; pass a file path")
    existing = target.parent
    while not existing.exists():
        existing = existing.parent
    try:
        if target.exists():
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND))
        elif existing == target.parent:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(target)
        else:
            os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".tpfuse-write-check-"))
    except OSError as exc:
        raise UsageError(f"{flag} {path} cannot be written ({exc.strerror or exc}); pass a path under a directory "
                         "you can write") from None
