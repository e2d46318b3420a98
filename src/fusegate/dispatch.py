"""Choosing a strategy for one problem: explicit request, else the measured table, else a default.

The only place that combines admission, a dispatch table and the conservative default. It is a
pure function of rank-identical inputs, so all ranks choose alike.

The conservative default (used with no dispatch table) prefers paths that are never slower than
the unfused baseline on any fabric: NCCL followed by the fused epilogue kernel on GPUs, then the
reference strategy. Fused collectives are chosen only by measurement (`fusegate tune`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fusegate.spec import Verdict

CONSERVATIVE_DEFAULT = ("nccl_fused", "reference")


@dataclass(frozen=True)
class Choice:
    name: str
    source: str  # "explicit" | "table" | "default"
    reason: str


def default_choice(verdicts: dict[str, Verdict]) -> Choice:
    """First admitted strategy of CONSERVATIVE_DEFAULT (ValueError with every reason if none)."""
    for name in CONSERVATIVE_DEFAULT:
        verdict = verdicts.get(name)
        if verdict is not None and verdict.ok:
            return Choice(name, "default", "conservative default (no dispatch table; run `fusegate tune`)")
    reasons = "; ".join(f"{name}: {v.reason}" for name, v in verdicts.items())
    raise ValueError(f"no strategy is admitted for this problem ({reasons})")
