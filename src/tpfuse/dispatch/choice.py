"""Choosing a strategy for one problem: explicit request, else the measured table, else a default.

The only place that combines admission, a dispatch table and the conservative default. Every
function here is pure over rank-identical inputs (the Problem, the admission verdicts, a table
whose digest all ranks agreed on), so all ranks choose alike.

The conservative default (used with no dispatch table, or for a shape the table does not cover)
prefers paths that are never slower than the unfused baseline on any fabric: NCCL followed by the
fused epilogue kernel on GPUs, then the reference strategy. Fused collectives are chosen only by
measurement (`tpfuse tune`).

The do-no-harm guard applies at lookup as it did at tune time: a fused strategy (collective and
epilogue in one kernel) is used from the table only where its measured median beats the best
unfused strategy's by the table's margin; otherwise the best unfused strategy is used. A table
edited by hand, or tuned with another rule, cannot switch on a fused path that its own
measurements do not support.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tpfuse.spec import Problem, Verdict
from tpfuse.strategies import get_strategy

if TYPE_CHECKING:
    from tpfuse.dispatch.table import DispatchTable, Entry

CONSERVATIVE_DEFAULT = ("nccl_epilogue", "reference")


def is_fused(name: str) -> bool:
    """True when the strategy runs collective and epilogue in one kernel (the guard's subject);
    False for an unregistered name or one whose module cannot be imported here."""

    try:
        return bool(get_strategy(name).fused)
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class Choice:
    name: str
    source: str  # "explicit" | "table" | "default"
    reason: str
    warning: str = ""  # set when an explicit choice contradicts the measurements


def default_choice(verdicts: dict[str, Verdict], reason: str = "") -> Choice:
    """First admitted strategy of CONSERVATIVE_DEFAULT (ValueError with every reason if none)."""
    for name in CONSERVATIVE_DEFAULT:
        verdict = verdicts.get(name)
        if verdict is not None and verdict.ok:
            why = reason or "no dispatch table; run `tpfuse tune`"
            return Choice(name, "default", f"conservative default ({why})")
    reasons = "; ".join(f"{name}: {v.reason}" for name, v in verdicts.items())
    raise ValueError(f"no strategy is admitted for this problem ({reasons})")


def _shape(problem: Problem) -> str:
    return f"{problem.num_tokens}x{problem.hidden} {problem.dtype}"


def guarded(entry: Entry, margin: float, is_fused: Callable[[str], bool]) -> tuple[str, str]:
    """(name, reason): the entry's choice, or its best unfused strategy if the guard refuses it."""
    name = entry.choice
    if not is_fused(name):
        return name, entry.reason
    fused_us, unfused_us = entry.median(name), entry.median(entry.best_unfused) if entry.best_unfused else None
    if fused_us is None or unfused_us is None:
        if entry.best_unfused:
            return entry.best_unfused, f"do-no-harm guard: fused {name} has no measured unfused baseline to beat"
        return name, entry.reason
    if fused_us <= unfused_us * (1 - margin):
        return name, entry.reason
    return entry.best_unfused, (
        f"do-no-harm guard: fused {name} measured {fused_us:.1f} us vs {entry.best_unfused} {unfused_us:.1f} us, "
        f"not faster by the {margin:.0%} margin"
    )


def table_choice(problem: Problem, verdicts: dict[str, Verdict], table: DispatchTable,
                 is_fused: Callable[[str], bool]) -> Choice:
    """The table's (guarded) choice for `problem` if it is admitted here, else the default."""
    entry = table.lookup(problem.op.value, problem.dtype, problem.hidden, problem.num_tokens)
    if entry is None:
        return default_choice(verdicts, f"the dispatch table has no bucket for {problem.op.value} {_shape(problem)}")
    name, reason = guarded(entry, table.margin, is_fused)
    verdict = verdicts.get(name)
    if verdict is None or not verdict.ok:
        why = verdict.reason if verdict is not None else "not registered"
        return default_choice(verdicts, f"table choice {name} is not admitted here: {why}")
    return Choice(name, "table", f"measured, bucket {entry.tokens} tokens: {reason}")


def contradiction(requested: str, problem: Problem, table: DispatchTable | None,
                  is_fused: Callable[[str], bool]) -> str:
    """A warning when the measurements say `requested` is wrong for this shape, else ""."""
    if table is None:
        return ""
    entry = table.lookup(problem.op.value, problem.dtype, problem.hidden, problem.num_tokens)
    if entry is None:
        return ""
    best, _ = guarded(entry, table.margin, is_fused)
    if best == requested:
        return ""
    if requested in entry.rejected:
        return (f"strategy {requested!r} failed the correctness check when this machine was tuned "
                f"({entry.rejected[requested]}); the table chose {best!r} for {problem.op.value} {_shape(problem)}")
    req_us, best_us = entry.median(requested), entry.median(best)
    if req_us is not None and best_us is not None and req_us > best_us * (1 + table.margin):
        return (f"strategy {requested!r} measured {req_us:.1f} us vs {best_us:.1f} us for {best!r} "
                f"({req_us / best_us:.2f}x) on {problem.op.value} {_shape(problem)} here; "
                "remove the override to use the measured choice")
    return ""


def choose(problem: Problem, verdicts: dict[str, Verdict], *, requested: str = "auto",
           table: DispatchTable | None = None, is_fused: Callable[[str], bool] = lambda name: False,
           requested_by: str = "strategy=") -> Choice:
    """The strategy for `problem`: explicit request (checked against admission), else table, else default."""
    if requested != "auto":
        verdict = verdicts.get(requested)
        if verdict is None or not verdict.ok:
            why = verdict.reason if verdict is not None else "not registered"
            raise ValueError(
                f"{problem.op.value}: strategy {requested!r} cannot run {_shape(problem)} here: {why}; "
                "use strategy='auto' to fall back"
            )
        return Choice(requested, "explicit", f"requested by {requested_by}",
                      contradiction(requested, problem, table, is_fused))
    if table is None:
        return default_choice(verdicts)
    return table_choice(problem, verdicts, table, is_fused)


class DispatchWarning(UserWarning):
    """Warnings about strategy choice: no/ignored dispatch table, overrides against measurements."""


_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Warn with `message` the first time `key` is seen in this process (DispatchWarning)."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    import warnings

    warnings.warn(message, DispatchWarning, stacklevel=_caller_outside_package())


def _caller_outside_package() -> int:
    """The stacklevel (from warn_once's frame, level 1) of the first frame outside tpfuse, so a
    warning names the user's own call and source line rather than a line inside the package."""
    import os
    import sys

    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # src/tpfuse/
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package_dir):
        frame, level = frame.f_back, level + 1
    return level
