"""Every TPFUSE_* environment variable, declared once, parsed strictly where it is read: a bad value
raises ValueError naming the variable, what was wrong and the fix.

TPFUSE_STRATEGY   force one strategy for every Communicator (same as strategy=...; all ranks
                    must set the same value).
TPFUSE_DEBUG      "1": check before each collective that all ranks agree on shape and dtype.
TPFUSE_CACHE_DIR  where dispatch tables live (default: $XDG_CACHE_HOME/tpfuse or ~/.cache/tpfuse).
TPFUSE_TIMEOUT_S  seconds, finite, in (0, MAX_TIMEOUT_S]: bound on every device-side spin-wait
                    (default 5) and every gloo wait of the host strategies (default
                    HOST_DEFAULT_TIMEOUT_S when unset; tpfuse.strategies.host_wait).
TPFUSE_ENGINES    serving engines in which tpfuse takes the fused allreduce + residual + RMSNorm
                    call: "sglang", "vllm", both comma-separated, or "all"; unset or "0": none
                    (the engine plugins stay inert). Set it for the server and all its workers.
TPFUSE_CALIBRATE  the engine plugins' start-up calibration, when the dispatch table lacks the
                    engine's captured batch sizes: unset or "1": on, within 15 s; "0": off (the
                    conservative default serves those sizes); "30s": on, within 30 s.
TPFUSE_STRATEGIES extra strategies to register, "name=package.module:Class,..." (plugins; spawned
                    ranks inherit the environment, so they see the same registry as the parent).
TPFUSE_AUDIT_MAX_BYTES  the audit's per-file size bound, a positive whole number of bytes
                    (default: tpfuse.audit.target.MAX_SOURCE_BYTES).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

# The longest wait a bound may name: torch.distributed's default process-group timeout (30 min).
# A longer bound never takes effect, because the group's own timeout ends the wait first.
MAX_TIMEOUT_S = 1800.0
# Device-side spin-waits without TPFUSE_TIMEOUT_S: a peer kernel that has not arrived within 5 s
# is not coming (a chosen default; a call takes microseconds).
SPIN_DEFAULT_TIMEOUT_S = 5.0
# Host waits without an explicit bound: longer than the spin default, because a rank of a gloo
# group on a shared, loaded CPU can legitimately run seconds behind its peers (a first-call import
# or compile), and a spurious PeerLostError would end the group; still far below MAX_TIMEOUT_S.
HOST_DEFAULT_TIMEOUT_S = 30.0

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*\Z")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


def strategy_override() -> str | None:
    value = os.environ.get("TPFUSE_STRATEGY", "").strip()
    if value and not _NAME.match(value):
        raise ValueError(f"TPFUSE_STRATEGY={value!r} is not a strategy name; give one name, e.g. "
                         "TPFUSE_STRATEGY=reference, or unset it to use the measured choice")
    return value or None


def debug_enabled() -> bool:
    value = os.environ.get("TPFUSE_DEBUG", "0").strip().lower()
    if value not in ("0", "1", "false", "true", ""):
        raise ValueError(f"TPFUSE_DEBUG={value!r}: use 1 (on) or 0 (off)")
    return value in ("1", "true")


def cache_dir() -> Path:
    """TPFUSE_CACHE_DIR made absolute (ranks may start elsewhere), else the XDG cache's tpfuse folder."""
    raw = os.environ.get("TPFUSE_CACHE_DIR", "")
    if raw.strip():
        if "\0" in raw:
            raise ValueError("TPFUSE_CACHE_DIR holds a NUL byte; set it to a directory path")
        return Path(os.path.abspath(os.path.expanduser(raw)))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tpfuse"


def _out_of_bound(name: str, shown) -> ValueError:
    return ValueError(f"{name}={shown!r}: must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}] (a longer "
                      f"wait is ended by the process group's own {MAX_TIMEOUT_S:g} s timeout first); e.g. 5")


def check_timeout_s(value, name: str) -> float:
    """`value` (a number) as seconds, or ValueError naming `name` unless it is a finite number in
    (0, MAX_TIMEOUT_S]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}; e.g. {name}=5")
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise _out_of_bound(name, value)
    return float(value)


def parse_timeout_s(raw: str, name: str = "TPFUSE_TIMEOUT_S") -> float:
    """The text of a timeout variable as seconds, held to `check_timeout_s`'s bound, naming the variable."""
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: give a number of seconds, e.g. 5") from None
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_TIMEOUT_S:
        raise _out_of_bound(name, raw)
    return seconds


def spin_timeout_s() -> float:
    raw = os.environ.get("TPFUSE_TIMEOUT_S")
    return SPIN_DEFAULT_TIMEOUT_S if raw is None else parse_timeout_s(raw)


def host_timeout_s() -> float:
    """The host strategies' bound without a `timeout_s` option: TPFUSE_TIMEOUT_S, else HOST_DEFAULT_TIMEOUT_S."""
    raw = os.environ.get("TPFUSE_TIMEOUT_S")
    return HOST_DEFAULT_TIMEOUT_S if raw is None else parse_timeout_s(raw)


def is_strategy_entry(name: str, target: str) -> bool:
    """True when `name` is a strategy name and `target` reads "package.module:Class" (syntax only)."""
    module, colon, cls = target.partition(":")
    return bool(colon and _NAME.match(name) and _DOTTED.match(module) and _DOTTED.match(cls))


def extra_strategies() -> dict[str, str]:
    raw = os.environ.get("TPFUSE_STRATEGIES", "").strip()
    entries: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, sep, target = (part.strip() for part in item.partition("="))
        if not sep or not is_strategy_entry(name, target):
            raise ValueError(f"TPFUSE_STRATEGIES: entry {item!r} must look like name=package.module:Class")
        entries[name] = target
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
        raise ValueError(f"TPFUSE_ENGINES={raw!r}: unknown engine(s) {', '.join(unknown)}; "
                         f"use {', '.join(ENGINES)} or all")
    return frozenset(names)


# The start-up calibration's default time budget: the bound on what a server start may
# spend measuring (a chosen default, said in the log line, overridable as "Ns").
CALIBRATE_DEFAULT_S = 15.0


def calibrate_budget_s() -> float | None:
    """Seconds the engine plugins may spend calibrating at start-up, or None when TPFUSE_CALIBRATE=0."""
    raw = os.environ.get("TPFUSE_CALIBRATE", "").strip().lower()
    if raw in ("", "1", "on", "true"):
        return CALIBRATE_DEFAULT_S
    if raw in ("0", "off", "false"):
        return None
    try:
        value = float(raw.removesuffix("s")) if raw.endswith("s") else float("nan")
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"TPFUSE_CALIBRATE={raw!r}: use 1 (on, {CALIBRATE_DEFAULT_S:g} s), 0 (off) "
                         "or a budget in seconds such as 30s")
    return value


def audit_max_bytes() -> int | None:
    """TPFUSE_AUDIT_MAX_BYTES as a byte count, or None when unset (the audit's default applies)."""
    raw = os.environ.get("TPFUSE_AUDIT_MAX_BYTES", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"TPFUSE_AUDIT_MAX_BYTES={raw!r}: give a positive whole number of bytes, "
                         "e.g. 4194304 for 4 MiB, or unset it for the default bound")
    return int(raw)
