"""Spawning ranks for a command: the CLI's warning format in every rank, and rank failures in one line each.

`spawn(fn, N, ...)` is `fusegate.launch.run_ranks` with `fn` run through `rank_entry`, which makes
the rank print fusegate's warnings as one plain line (the library's `warnings.warn` would show the
file, the line number and the caller's source line). `describe_failure` turns a `RankFailure`
into one line per distinct error, naming the ranks; the full tracebacks go to the debug log
(`fusegate -v ...`), so a user error never prints a Python traceback.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

log = logging.getLogger("fusegate.cli")

_default_formatwarning = warnings.formatwarning


def _format_warning(message, category, filename, lineno, line=None) -> str:
    if category.__module__.startswith("fusegate"):
        return f"fusegate: warning: {message}\n"
    return _default_formatwarning(message, category, filename, lineno, line)


def install_warning_format() -> None:
    """fusegate warnings as `fusegate: warning: <message>` lines in this process (the CLI's choice;
    the library never changes warning formatting)."""
    warnings.formatwarning = _format_warning


def rank_entry(rank: int, world_size: int, fn: Callable[..., Any], *args: Any) -> Any:
    install_warning_format()
    return fn(rank, world_size, *args)


def spawn(fn: Callable[..., Any], world_size: int, *, backend: str, args: tuple = (), timeout_s: float,
          env: dict[str, str] | None = None) -> list[Any]:
    from fusegate.launch import run_ranks

    return run_ranks(rank_entry, world_size, backend=backend, args=(fn, *args), timeout_s=timeout_s, env=env)


def describe_failure(exc) -> str:
    """One clause per distinct error of a RankFailure: "rank(s) 0, 1: RuntimeError: ..."."""
    log.debug("%s", exc)
    groups: dict[str, list[int]] = {}
    for rank, text in sorted(exc.failures.items()):
        lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
        groups.setdefault(lines[-1] if lines else "failed without a message", []).append(rank)
    clauses = [f"rank(s) {', '.join(map(str, ranks))}: {error}" for error, ranks in groups.items()]
    return "; ".join(clauses) + " (`fusegate -v ...` prints the ranks' tracebacks)"
