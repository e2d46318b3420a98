"""Typed validation of a dispatch table's JSON (schema 2), before any of its fields is used.

`check_table(raw)` raises ValueError naming the first bad field by its JSON path, e.g.
"entries[2].tokens: expected an integer >= 1, got '8' (str)". A file that parses as JSON but
holds a wrong-typed or out-of-range field (even with a recomputed digest) is thereby refused at
load, with the reason, instead of loading and raising on the first call that looks it up. The
accepted shape is exactly what `DispatchTable.to_json` writes; unknown fields are refused too
(a reader cannot know what they mean). Plain data: no torch.
"""

from __future__ import annotations

import math
import re

from tpfuse.spec import Op

TOP_FIELDS = ("kind", "schema", "created", "versions", "fingerprint", "fingerprint_digest", "settings",
              "entries", "digest")
ENTRY_FIELDS = ("op", "dtype", "hidden", "tokens", "choice", "reason", "best_unfused", "times_us",
                "confirmed_us", "rejected", "guarded")
# The one schema written and read; it changes whenever a reader of the old format would misread
# the new one (`tpfuse.dispatch.table` says how the file is laid out).
SCHEMA_VERSION = 2
VERSION_FIELDS = ("tpfuse", "torch", "driver", "cuda")
STAT_FIELDS = ("median", "p20", "p80", "n")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_OPS = tuple(op.value for op in Op)


def _show(value) -> str:
    text = repr(value)
    return f"{text[:60]}... ({type(value).__name__})" if len(text) > 60 else f"{text} ({type(value).__name__})"


def _bad(path: str, want: str, value) -> ValueError:
    return ValueError(f"{path}: expected {want}, got {_show(value)}")


def _int(path: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(path, f"an integer >= {low}", value)


def _number(path: str, value, low: float, high: float | None = None) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= low
    if not ok or (high is not None and value >= high):
        raise _bad(path, f"a finite number in [{low:g}, {high:g})" if high is not None else f"a finite number >= {low:g}",
                   value)


def _str(path: str, value, *, nonempty: bool = False) -> None:
    if not isinstance(value, str) or (nonempty and not value):
        raise _bad(path, "a non-empty string" if nonempty else "a string", value)


def _object(path: str, value, *, required: tuple[str, ...] = (), optional: tuple[str, ...] = (),
            any_keys: bool = False) -> dict:
    if not isinstance(value, dict):
        raise _bad(path, "an object", value)
    missing = [k for k in required if k not in value]
    if missing:
        raise ValueError(f"{path}: missing field(s) {', '.join(missing)}")
    if not any_keys:
        extra = sorted(k for k in value if k not in required and k not in optional)
        if extra:
            raise ValueError(f"{path}: unexpected field(s) {', '.join(map(repr, extra))}")
    return value


def _times(path: str, value) -> None:
    for name, stats in _object(path, value, any_keys=True).items():
        _str(f"{path} key", name, nonempty=True)
        _object(f"{path}.{name}", stats, required=STAT_FIELDS)
        for key in ("median", "p20", "p80"):
            _number(f"{path}.{name}.{key}", stats[key], 0.0)
        _int(f"{path}.{name}.n", stats["n"], 0)


def _entry(path: str, value) -> tuple:
    e = _object(path, value, required=ENTRY_FIELDS)
    if e["op"] not in _OPS:
        raise _bad(f"{path}.op", f"one of {', '.join(_OPS)}", e["op"])
    _str(f"{path}.dtype", e["dtype"], nonempty=True)
    _int(f"{path}.hidden", e["hidden"], 1)
    _int(f"{path}.tokens", e["tokens"], 1)
    _str(f"{path}.choice", e["choice"], nonempty=True)
    _str(f"{path}.reason", e["reason"])
    if e["best_unfused"] is not None:
        _str(f"{path}.best_unfused", e["best_unfused"], nonempty=True)
    _times(f"{path}.times_us", e["times_us"])
    _times(f"{path}.confirmed_us", e["confirmed_us"])
    for name, why in _object(f"{path}.rejected", e["rejected"], any_keys=True).items():
        _str(f"{path}.rejected.{name}", why)
    if not isinstance(e["guarded"], bool):
        raise _bad(f"{path}.guarded", "true or false", e["guarded"])
    return e["op"], e["dtype"], e["hidden"], e["tokens"]


def check_table(raw) -> None:
    """Raise ValueError naming the first field of `raw` (parsed JSON) that its schema does not allow."""
    top = _object("table", raw, required=TOP_FIELDS)
    _int("schema", top["schema"], 1)
    if top["schema"] != SCHEMA_VERSION:
        raise _bad("schema", str(SCHEMA_VERSION), top["schema"])
    _str("created", top["created"])
    versions = _object("versions", top["versions"], required=VERSION_FIELDS[:3], optional=VERSION_FIELDS[3:])
    for key, value in versions.items():
        if value is not None:
            _str(f"versions.{key}", value)
    _object("fingerprint", top["fingerprint"], any_keys=True)
    settings = _object("settings", top["settings"], optional=("margin", "rounds", "confirm_rounds"))
    if "margin" in settings:
        _number("settings.margin", settings["margin"], 0.0, 1.0)
    for key in ("rounds", "confirm_rounds"):
        if key in settings:
            _int(f"settings.{key}", settings[key], 0)
    if not isinstance(top["entries"], list):
        raise _bad("entries", "a list", top["entries"])
    seen: dict[tuple, int] = {}
    for i, entry in enumerate(top["entries"]):
        key = _entry(f"entries[{i}]", entry)
        if key in seen:
            raise ValueError(f"entries[{i}]: the same bucket {key} as entries[{seen[key]}]")
        seen[key] = i
    for key in ("digest", "fingerprint_digest"):
        if not isinstance(top[key], str) or not _HEX64.fullmatch(top[key]):
            raise _bad(key, "64 lowercase hex digits (sha256)", top[key])
