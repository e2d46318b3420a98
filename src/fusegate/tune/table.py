"""The dispatch table: what `fusegate tune` measured and chose, persisted as JSON.

File format (schema 1; `SCHEMA_VERSION` changes whenever a reader of the old format would
misread the new one):

    {"kind": "fusegate-dispatch-table", "schema": 1, "created": ISO-8601 UTC,
     "versions": {"fusegate", "torch", "driver", "cuda"},
     "fingerprint": {world size, backend, device type, hosts, shared device, peer access,
                     GPUs (name, compute capability, SMs, memory), GPU pairs (kind, peer access),
                     CPU model and cores for CPU groups},
     "fingerprint_digest": sha256 of the canonical fingerprint,
     "settings": {"margin", "rounds", "confirm_rounds"},
     "entries": [{"op", "dtype", "hidden", "tokens", "choice", "reason", "best_unfused",
                  "times_us": {strategy: {"median", "p20", "p80", "n"}},
                  "confirmed_us": {strategy: {...}}, "rejected": {strategy: reason}}],
     "digest": sha256 of the canonical JSON of everything above}

One file per fingerprint, `<cache dir>/dispatch-<fingerprint digest[:16]>.json`, cache dir from
`fusegate.env.cache_dir()` (FUSEGATE_CACHE_DIR, else the XDG cache). `load` never raises on a bad
file: it returns (None, why) for a missing, corrupt (unparsable, missing fields, digest mismatch),
stale (other schema or other fusegate/torch/driver versions) or foreign (other fingerprint) table,
so that the Communicator can warn and fall back. Plain data: importing this imports no torch.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fusegate import env

SCHEMA_VERSION = 1
KIND = "fusegate-dispatch-table"
# Default do-no-harm margin: a fused strategy must beat the best unfused one by 3% (issue 4's
# default; larger than the run-to-run spread of the interleaved medians seen in CPU tests).
DEFAULT_MARGIN = 0.03


def token_buckets(max_tokens: int) -> list[int]:
    """1, 2, 4, ... below `max_tokens`, then `max_tokens` itself."""
    if max_tokens < 1:
        raise ValueError(f"token_buckets: max_tokens must be >= 1, got {max_tokens}")
    buckets, tokens = [], 1
    while tokens < max_tokens:
        buckets.append(tokens)
        tokens *= 2
    buckets.append(max_tokens)
    return buckets


def canonical_digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def fingerprint(info, caps) -> dict:
    """What makes measurements transferable: the group's shape and the hardware it runs on."""
    fp = {
        "world_size": info.world_size,
        "backend": info.backend,
        "device_type": info.device_type,
        "num_hosts": info.num_hosts,
        "shares_device": info.shares_device,
        "peer_access": info.peer_access,
    }
    if info.device_type == "cuda":
        fp["gpus"] = [[g.name, list(g.compute_capability), g.sm_count, g.memory_bytes] for g in caps.gpus]
        fp["links"] = [[link.a, link.b, link.kind, link.peer_access] for link in caps.links if link.a != link.b]
    else:
        fp["cpu"] = [caps.cpu.model, caps.cpu.num_cores]
    return fp


def versions_of(caps) -> dict:
    v = caps.versions
    return {"fusegate": v.fusegate, "torch": v.torch, "driver": v.driver, "cuda": v.cuda_runtime}


@dataclass(frozen=True)
class Entry:
    """One measured bucket: the choice for calls of up to `tokens` rows (and more than the bucket below)."""

    op: str
    dtype: str
    hidden: int
    tokens: int
    choice: str
    reason: str
    best_unfused: str | None
    times_us: dict = field(default_factory=dict)
    confirmed_us: dict = field(default_factory=dict)
    rejected: dict = field(default_factory=dict)

    def median(self, name: str) -> float | None:
        """The deciding time of `name`: confirmed if re-timed, else first pass; None if not timed."""
        for source in (self.confirmed_us, self.times_us):
            if name in source:
                return float(source[name]["median"])
        return None


@dataclass(frozen=True)
class DispatchTable:
    versions: dict
    fingerprint: dict
    entries: tuple[Entry, ...]
    settings: dict = field(default_factory=dict)
    created: str = ""
    schema: int = SCHEMA_VERSION

    @property
    def fingerprint_digest(self) -> str:
        return canonical_digest(self.fingerprint)

    @property
    def margin(self) -> float:
        return float(self.settings.get("margin", DEFAULT_MARGIN))

    def body(self) -> dict:
        return {
            "kind": KIND,
            "schema": self.schema,
            "created": self.created,
            "versions": self.versions,
            "fingerprint": self.fingerprint,
            "fingerprint_digest": self.fingerprint_digest,
            "settings": self.settings,
            "entries": [asdict(e) for e in self.entries],
        }

    @property
    def digest(self) -> str:
        return canonical_digest(self.body())

    def to_json(self) -> str:
        return json.dumps({**self.body(), "digest": self.digest}, indent=1, sort_keys=True)

    def lookup(self, op: str, dtype: str, hidden: int, num_tokens: int) -> Entry | None:
        """The entry of the smallest tuned bucket >= num_tokens for (op, dtype, hidden); None if
        the shape was not tuned or lies beyond the largest bucket (not measured: no extrapolation)."""
        best = None
        for e in self.entries:
            if e.op == op and e.dtype == dtype and e.hidden == hidden and e.tokens >= num_tokens:
                if best is None or e.tokens < best.tokens:
                    best = e
        return best

    def merged(self, other: "DispatchTable") -> "DispatchTable":
        """This table with `other`'s entries replacing same-key ones (same fingerprint required)."""
        if other.fingerprint != self.fingerprint:
            raise ValueError("DispatchTable.merged: tables have different fingerprints; tune again instead of merging")
        keys = {(e.op, e.dtype, e.hidden, e.tokens) for e in other.entries}
        kept = tuple(e for e in self.entries if (e.op, e.dtype, e.hidden, e.tokens) not in keys)
        return DispatchTable(other.versions, other.fingerprint, kept + other.entries, other.settings, other.created, other.schema)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def table_path(fingerprint_dict: dict, directory: str | Path | None = None) -> Path:
    """Where the table for this fingerprint lives."""
    base = Path(directory) if directory is not None else env.cache_dir()
    return base / f"dispatch-{canonical_digest(fingerprint_dict)[:16]}.json"


def save(table: DispatchTable, path: str | Path) -> Path:
    """Write atomically (temp file + rename), so concurrent writers and readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(table.to_json())
    os.replace(tmp, path)
    return path


def parse(text: str) -> DispatchTable:
    """The table in `text`; ValueError saying what is wrong (not JSON, fields, digest)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("kind") != KIND:
        raise ValueError(f"not a fusegate dispatch table (kind is not {KIND!r})")
    try:
        entries = tuple(Entry(**e) for e in raw["entries"])
        table = DispatchTable(raw["versions"], raw["fingerprint"], entries, raw.get("settings", {}),
                              raw.get("created", ""), int(raw["schema"]))
        stored = raw["digest"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"missing or malformed field ({type(exc).__name__}: {exc})") from None
    if table.digest != stored:
        raise ValueError("digest mismatch (the file was edited or truncated after it was written)")
    return table


def check_current(table: DispatchTable, fingerprint_dict: dict, versions: dict) -> str:
    """"" when `table` applies here, else why not (stale or foreign)."""
    if table.schema != SCHEMA_VERSION:
        return f"stale: schema {table.schema}, this fusegate reads schema {SCHEMA_VERSION}"
    for key in ("fusegate", "torch", "driver"):
        if table.versions.get(key) != versions.get(key):
            return f"stale: tuned with {key} {table.versions.get(key)}, running {versions.get(key)}"
    if table.fingerprint != fingerprint_dict:
        return "foreign: tuned on another machine or group shape (fingerprint differs)"
    return ""


def load(path: str | Path, fingerprint_dict: dict, versions: dict) -> tuple[DispatchTable | None, str]:
    """(table, "") if the file at `path` is a valid, current table for this fingerprint; else (None, why)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, f"no dispatch table at {path}"
    except OSError as exc:
        return None, f"cannot read {path}: {exc}"
    try:
        table = parse(text)
    except ValueError as exc:
        return None, f"corrupt dispatch table {path}: {exc}"
    why = check_current(table, fingerprint_dict, versions)
    if why:
        return None, f"ignoring dispatch table {path}: {why}"
    return table, ""
