"""The dispatch table: what `tpfuse tune` measured and chose, persisted as JSON.

File format (schema 2, `tpfuse.dispatch.schema.SCHEMA_VERSION`):

    {"kind": "tpfuse-dispatch-table", "schema": 2, "created": ISO-8601 UTC,
     "versions": {"tpfuse", "torch", "driver", "cuda"},
     "fingerprint": {world size, backend, device type, hosts, shared device, peer access,
                     GPUs (name, compute capability, SMs, memory), GPU pairs (kind, peer access),
                     CPU model and cores for CPU groups},
     "fingerprint_digest": sha256 of the canonical fingerprint,
     "settings": {"margin", "rounds", "confirm_rounds"},
     "entries": [{"op", "dtype", "hidden", "tokens", "choice", "reason", "best_unfused",
                  "times_us": {strategy: {"median", "p20", "p80", "n"}},
                  "confirmed_us": {strategy: {...}}, "rejected": {strategy: reason}, "guarded"}],
     "digest": sha256 of the canonical JSON of everything above}

`guarded` is true when a fused candidate reached the bucket's decision, so the do-no-harm guard
weighed it. A table of any other schema is stale: it is reported and ignored, never converted.

One file per fingerprint, `<cache dir>/dispatch-<fingerprint digest[:16]>.json`, cache dir from
`tpfuse.env.cache_dir()` (TPFUSE_CACHE_DIR, else the XDG cache). `load` never raises on a bad
file: it returns (None, why) for a missing, unreadable (not a regular file, over `MAX_TABLE_BYTES`),
corrupt (not UTF-8, not JSON, a field of the wrong type or range per `tpfuse.dispatch.schema`,
digest mismatch), stale (unreadable schema or other tpfuse/torch/driver versions) or foreign (other
fingerprint) table, so that the Communicator can warn and fall back. Writing: `check_writable`
before measuring, `save_merged` (a run's buckets into the table already saved, under a lock, a
file it cannot merge kept aside), `save` atomically (temp file, fsync, rename; it also removes the
temp files of saves killed mid-write); the writers raise `CacheDirError` with the fix. Plain data:
importing this imports no torch.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import hashlib
import json
import os
import secrets
import stat
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tpfuse import env
from tpfuse.dispatch.schema import SCHEMA_VERSION, check_table

KIND = "tpfuse-dispatch-table"
# Default do-no-harm margin: a fused strategy must beat the best unfused one by 3% (a chosen
# default; larger than the run-to-run spread of the interleaved medians seen in CPU tests).
DEFAULT_MARGIN = 0.03
# Largest file `load` reads: an entry is about 1 KB of JSON, so 16 MiB is over ten thousand buckets,
# far beyond any tuning; a larger file is not a table and is not read into memory.
MAX_TABLE_BYTES = 16 << 20


class CacheDirError(RuntimeError):
    """The dispatch table cannot be written where it should go; the message names the fix."""


class StaleTableError(ValueError):
    """A well-formed table of another schema version: ignore it and tune again."""


def token_buckets(max_tokens: int) -> list[int]:
    """1, 2, 4, ... below `max_tokens`, then `max_tokens` itself."""
    if max_tokens < 1:
        raise ValueError(f"token_buckets: max_tokens must be >= 1, got {max_tokens}")
    buckets, num_tokens = [], 1
    while num_tokens < max_tokens:
        buckets.append(num_tokens)
        num_tokens *= 2
    buckets.append(max_tokens)
    return buckets


def canonical_digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def fingerprint(facts, caps) -> dict:
    """What makes measurements transferable: the group's shape and the hardware it runs on."""
    fp = {
        "world_size": facts.world_size,
        "backend": facts.backend,
        "device_type": facts.device_type,
        "num_hosts": facts.num_hosts,
        "shares_device": facts.shares_device,
        "peer_access": facts.peer_access,
    }
    if facts.device_type == "cuda":
        fp["gpus"] = [[g.name, list(g.compute_capability), g.sm_count, g.memory_bytes] for g in caps.gpus]
        fp["links"] = [[link.a, link.b, link.kind, link.peer_access] for link in caps.links if link.a != link.b]
    else:
        fp["cpu"] = [caps.cpu.model, caps.cpu.num_cores]
    return fp


def versions_of(caps) -> dict:
    v = caps.versions
    return {"tpfuse": v.tpfuse, "torch": v.torch, "driver": v.driver, "cuda": v.cuda_runtime}


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
    # A fused candidate reached the decision, so the do-no-harm guard weighed it: the fused one won
    # by the margin, the guard kept the best unfused one, or no unfused one passed to compare.
    guarded: bool = False

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

    def merged(self, other: DispatchTable) -> DispatchTable:
        """This table with `other`'s entries replacing same-key ones (same fingerprint required)."""
        if other.fingerprint != self.fingerprint:
            raise ValueError("DispatchTable.merged: tables have different fingerprints; tune again instead of merging")
        keys = {(e.op, e.dtype, e.hidden, e.tokens) for e in other.entries}
        kept = tuple(e for e in self.entries if (e.op, e.dtype, e.hidden, e.tokens) not in keys)
        return DispatchTable(other.versions, other.fingerprint, kept + other.entries, other.settings, other.created, other.schema)


@dataclass(frozen=True)
class Saved:
    """What `save_merged` wrote: the table now at `path`, and where a file it could not merge went."""

    table: DispatchTable
    path: Path
    kept: Path | None = None  # the unreadable or foreign file found at `path`, renamed aside
    kept_why: str = ""  # why it could not be merged (load's reason)


def save_merged(measured: DispatchTable, path: str | Path, *, fresh: bool = False) -> Saved:
    """Save a tuning run's table at `path`: `measured` merged into the current table already there
    (its buckets replace same-key ones, the others are kept), or `measured` alone when `fresh`.

    Under an exclusive lock on a lock file beside `path`, and re-reading the table inside it, so
    that concurrent tunes of one machine never lose each other's buckets. A file at `path` that is
    not a current table for this fingerprint and `measured.versions` (corrupt, another schema,
    other versions or fingerprint) is never overwritten: it is renamed aside first
    (`<name>.kept-<UTC time>`, in `Saved.kept`). CacheDirError if the directory is not writable."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f".{path.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
            old, why = load(path, measured.fingerprint, measured.versions)
            kept = None
            if old is None and os.path.lexists(path):
                kept = path.with_name(f"{path.name}.kept-{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%S.%fZ}")
                os.replace(path, kept)
            table = measured if fresh or old is None else old.merged(measured)
            save(table, path)
    except OSError as exc:
        raise _cannot_write(path.parent, exc) from None
    return Saved(table, path, kept, why if kept else "")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def table_path(fingerprint_dict: dict, directory: str | Path | None = None) -> Path:
    """Where the table for this fingerprint lives."""
    base = Path(directory) if directory is not None else env.cache_dir()
    return base / f"dispatch-{canonical_digest(fingerprint_dict)[:16]}.json"


def _cannot_write(directory: Path, exc: OSError) -> CacheDirError:
    return CacheDirError(
        f"cannot write the dispatch table in {directory} ({exc.strerror or exc}); pass --cache-dir DIR "
        "(or set TPFUSE_CACHE_DIR) to a writable directory, or --no-save to measure without saving"
    )


def check_writable(directory: str | Path) -> Path:
    """Create `directory` if needed and prove a table can be written there (create, sync, remove a
    probe file); CacheDirError if not. Call before measuring, so a read-only cache fails in a second."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise _cannot_write(directory, NotADirectoryError(errno.ENOTDIR, "it is a file, not a directory"))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".tpfuse-write-check-")
        try:
            os.write(fd, b"tpfuse")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise _cannot_write(directory, exc) from None
    return directory


def _remove_orphans(path: Path) -> None:
    """Delete temp files of `save`s whose process died before the rename (a kill mid-write)."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:].split(".", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except OSError:  # alive, but another user's: not ours to touch
            pass


def save(table: DispatchTable, path: str | Path) -> Path:
    """Write atomically (temp file, fsync, rename), so concurrent writers and readers, and a kill at
    any instant, never leave half a file; CacheDirError if the directory is not writable."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Not mkstemp: its 0600 would hide the table from other users of a shared cache dir.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(table.to_json().encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        _remove_orphans(path)
    except OSError as exc:
        raise _cannot_write(path.parent, exc) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return path


def _no_constants(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def parse(text: str | bytes) -> DispatchTable:
    """The table in `text`; ValueError saying what is wrong (not UTF-8, not JSON, which field, digest),
    StaleTableError for a table of another schema."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 text (byte {text[exc.start]:#04x} at offset {exc.start})") from None
    try:
        raw = json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        raise ValueError("not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, integers too long to convert
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("kind") != KIND:
        raise ValueError(f"not a tpfuse dispatch table (kind is not {KIND!r})")
    schema = raw.get("schema")
    if isinstance(schema, int) and not isinstance(schema, bool) and schema != SCHEMA_VERSION:
        raise StaleTableError(f"stale: schema {schema}, this tpfuse reads schema {SCHEMA_VERSION}")
    try:
        check_table(raw)
    except ValueError as exc:
        raise ValueError(f"malformed field: {exc}") from None
    written = {k: v for k, v in raw.items() if k != "digest"}
    if canonical_digest(written) != raw["digest"] or raw["fingerprint_digest"] != canonical_digest(raw["fingerprint"]):
        raise ValueError("digest mismatch (the file was edited or truncated after it was written)")
    entries = tuple(Entry(**e) for e in raw["entries"])
    return DispatchTable(raw["versions"], raw["fingerprint"], entries, raw["settings"], raw["created"], raw["schema"])


def check_current(table: DispatchTable, fingerprint_dict: dict, versions: dict) -> str:
    """"" when `table` applies here, else why not (stale or foreign)."""
    if table.schema != SCHEMA_VERSION:  # `parse` reads only the current schema; a table built in memory may differ
        return f"stale: schema {table.schema}, this tpfuse reads schema {SCHEMA_VERSION}"
    for key in ("tpfuse", "torch", "driver"):
        if table.versions.get(key) != versions.get(key):
            return f"stale: tuned with {key} {table.versions.get(key)}, running {versions.get(key)}"
    if table.fingerprint != fingerprint_dict:
        return "foreign: tuned on another machine or group shape (fingerprint differs)"
    return ""


def load(path: str | Path, fingerprint_dict: dict, versions: dict) -> tuple[DispatchTable | None, str]:
    """(table, "") if the file at `path` is a valid, current table for this fingerprint; else (None, why).
    Never raises for anything about the file (see the module doc)."""
    path = Path(path)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            return None, f"ignoring {path}: not a regular file"
        if info.st_size > MAX_TABLE_BYTES:
            return None, f"ignoring {path}: {info.st_size} bytes, more than a table's {MAX_TABLE_BYTES}"
        with open(path, "rb") as f:
            data = f.read(MAX_TABLE_BYTES + 1)
    except FileNotFoundError:
        return None, f"no dispatch table at {path}"
    except OSError as exc:
        return None, f"cannot read {path}: {exc}"
    if len(data) > MAX_TABLE_BYTES:
        return None, f"ignoring {path}: more than a table's {MAX_TABLE_BYTES} bytes"
    try:
        table = parse(data)
    except StaleTableError as exc:
        return None, f"ignoring dispatch table {path}: {exc}"
    except ValueError as exc:
        return None, f"corrupt dispatch table {path}: {exc}"
    why = check_current(table, fingerprint_dict, versions)
    if why:
        return None, f"ignoring dispatch table {path}: {why}"
    return table, ""
