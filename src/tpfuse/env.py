"""Every TPFUSE_* environment variable, declared once, parsed strictly (a bad value raises).

TPFUSE_STRATEGY   force one strategy for every Communicator (same as strategy=...; all ranks
                    must set the same value).
TPFUSE_DEBUG      "1": check before each collective that all ranks agree on shape and dtype.
TPFUSE_CACHE_DIR  where dispatch tables live (default: $XDG_CACHE_HOME/tpfuse or ~/.cache/tpfuse).
TPFUSE_TIMEOUT_S  seconds: bound on every device-side spin-wait (default 5) and every gloo wait
                    of the host strategies (default 30 when unset; tpfuse.strategies.host_wait).
TPFUSE_ENGINES    serving engines in which tpfuse takes the fused allreduce + residual + RMSNorm
                    call: "sglang", "vllm", both comma-separated, or "all"; unset or "0": none
                    (the engine plugins stay inert). Set it for the server and all its workers.
TPFUSE_STRATEGIES extra strategies to register, "name=package.module:Class,..." (plugins; spawned
                    ranks inherit the environment, so they see the same registry as the parent).
TPFUSE_AUDIT_MAX_BYTES  the audit's per-file size bound, a positive whole number of bytes
                    (default: tpfuse.audit.target.MAX_SOURCE_BYTES).
"""

from __future__ import annotations

import os
from pathlib import Path


def strategy_override() -> str | None:
    value = os.environ.get("TPFUSE_STRATEGY", "").strip()
    return value or None


def debug_enabled() -> bool:
    value = os.environ.get("TPFUSE_DEBUG", "0").strip().lower()
    if value not in ("0", "1", "false", "true", ""):
        raise ValueError(f"TPFUSE_DEBUG={value!r}: use 1 (on) or 0 (off)")
    return value in ("1", "true")


def cache_dir() -> Path:
    if os.environ.get("TPFUSE_CACHE_DIR"):
        return Path(os.environ["TPFUSE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tpfuse"


def spin_timeout_s() -> float:
    raw = os.environ.get("TPFUSE_TIMEOUT_S", "5")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"TPFUSE_TIMEOUT_S={raw!r}: give a number of seconds, e.g. 5") from None
    if value <= 0:
        raise ValueError(f"TPFUSE_TIMEOUT_S={raw!r}: must be > 0 seconds")
    return value


def extra_strategies() -> dict[str, str]:
    raw = os.environ.get("TPFUSE_STRATEGIES", "").strip()
    entries: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, sep, target = item.partition("=")
        if not sep or ":" not in target or not name.strip():
            raise ValueError(
                f"TPFUSE_STRATEGIES: entry {item!r} must look like name=package.module:Class"
            )
        entries[name.strip()] = target.strip()
    return entries


ENGINES = ("sglang", "vllm")


def engines_enabled() -> frozenset[str]:
    raw = os.environ.get("TPFUSE_ENGINES", "").strip().lower()
    if raw in ("", "0", "false", "none"):
        return frozenset()
    if raw in ("1", "true", "all"):
        return frozenset(ENGINES)
    names = {part.strip() for part in raw.split(",") if part.strip()}
    unknown = sorted(names - set(ENGINES))
    if unknown:
        raise ValueError(f"TPFUSE_ENGINES={raw!r}: unknown engine(s) {', '.join(unknown)}; use {', '.join(ENGINES)} or all")
    return frozenset(names)


def audit_max_bytes() -> int | None:
    """TPFUSE_AUDIT_MAX_BYTES as a byte count, or None when unset (the audit's default applies)."""
    raw = os.environ.get("TPFUSE_AUDIT_MAX_BYTES", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"TPFUSE_AUDIT_MAX_BYTES={raw!r}: give a positive whole number of bytes, e.g. 4194304 for 4 MiB, "
                         f"or unset it for the default bound")
    return int(raw)
