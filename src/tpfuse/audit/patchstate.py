"""The on-disk state of a patch: its layout, the validated manifest, and what the backups can recover.

manifest.py writes this state and reverts from it (its docstring has the transaction); this module
reads it without trusting it: `read_manifest` raises `Unreadable` with the reason for a manifest that
is unreadable, empty, truncated, of the wrong shape or names a path outside the target, and
`recovery` says which backups SHA256SUMS verifies and the command that restores them.

Layout. A patched tree carries `.tpfuse-patch/` in its root: `marker.json` (which state holds the
patch and the checksums of every patched file before and after) and, by default, the state itself
(`state/`: manifest.json, SHA256SUMS, backups/) and its lock (`state.lock`). So the tree can be
reverted wherever it is moved, and a wiped cache loses nothing. `--state-dir DIR` keeps the state
in `DIR/<sha1(root)[:12]>/` instead; the marker then names that directory by its absolute path.
`locate` finds the state from the marker first, then from `--state-dir` or the default.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path, PurePosixPath

from tpfuse.audit import durable

MANIFEST, SUMS, BACKUPS = "manifest.json", "SHA256SUMS", "backups"
TREE_DIR, MARKER, STATE = ".tpfuse-patch", "marker.json", "state"  # in the patched tree's root
_ENTRY_KEYS = ("path", "sha256_before", "sha256_after")


class ManifestError(RuntimeError):
    """The tree is not in the state the operation needs; the message says what to do."""


class Unreadable(Exception):
    """manifest.json exists but cannot be used; the message says why."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def state_dir_for(root: Path, state_dir: str | Path | None = None) -> Path:
    """Where a new patch of `root` keeps its state: inside the tree, or under `state_dir` (made absolute)."""
    root = Path(root).resolve()
    if not state_dir:
        return root / TREE_DIR / STATE
    return Path(state_dir).expanduser().resolve() / hashlib.sha1(str(root).encode()).hexdigest()[:12]


def marker_path(root: Path) -> Path:
    return Path(root).resolve() / TREE_DIR / MARKER


def read_marker(root: Path) -> dict | None:
    """The tree's marker (None without one); Unreadable with the reason for a marker that cannot be used."""
    path = marker_path(root)
    if not os.path.lexists(path):
        return None
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise Unreadable(f"the patch marker {path} cannot be read ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("state"), str) or not isinstance(data.get("files"), list):
        raise Unreadable(f"the patch marker {path} lacks its 'state' or 'files'")
    return data


def marker_state(root: Path, marker: dict) -> Path:
    """The state directory a marker names (relative: inside the tree's `.tpfuse-patch/`)."""
    state = Path(marker["state"])
    return state if state.is_absolute() else Path(root).resolve() / TREE_DIR / state


def locate(root: Path, state_dir=None) -> tuple[Path, dict | None]:
    """(state directory, marker or None) of the patch on `root`: the marker's state first; else
    `state_dir`'s or the default (an apply killed before it wrote the marker)."""
    try:
        marker = read_marker(root)
    except Unreadable:
        marker = None
    if marker is not None:
        sdir = marker_state(root, marker)
        fallback = state_dir_for(root, state_dir)
        if not sdir.exists() and state_dir and fallback.exists():
            return fallback, marker  # the state was moved by hand and named again with --state-dir
        return sdir, marker
    return state_dir_for(root, state_dir), None


def revert_cmd(root: Path, state_dir, *, force: bool = False) -> str:
    where = f" --state-dir {Path(state_dir).expanduser().resolve()}" if state_dir else ""
    return f"tpfuse revert {root}{where}" + (" --force" if force else "")


def hash_or_none(path: Path) -> str | None:
    try:
        return sha256(path.read_bytes())
    except OSError:
        return None


def safe_rel(rel) -> bool:
    parts = PurePosixPath(rel).parts if isinstance(rel, str) and rel else ()
    return bool(parts) and not PurePosixPath(rel).is_absolute() and ".." not in parts


def read_manifest(path: Path) -> dict:
    """The parsed, validated manifest; Unreadable with the reason otherwise."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise Unreadable(f"cannot be read ({exc.strerror or exc})") from None
    if not raw.strip():
        raise Unreadable("is empty")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise Unreadable(f"is not valid JSON, probably truncated ({exc})") from None
    if not isinstance(data, dict):
        raise Unreadable(f"holds a JSON {type(data).__name__}, not an object")
    if not isinstance(data.get("files"), list):
        raise Unreadable("lacks its 'files' list")
    for i, entry in enumerate(data["files"]):
        if not isinstance(entry, dict):
            raise Unreadable(f"has files[{i}] that is not an object")
        missing = [k for k in _ENTRY_KEYS if not isinstance(entry.get(k), str)]
        if missing:
            raise Unreadable(f"has files[{i}] without {', '.join(repr(k) for k in missing)}")
        if not safe_rel(entry["path"]):
            raise Unreadable(f"has files[{i}] with a path outside the target ({entry['path']!r})")
        if not isinstance(entry.get("mode", 0o644), int):
            raise Unreadable(f"has files[{i}] with a non-integer 'mode'")
    return data


def read_sums(sdir: Path) -> dict | None:
    try:
        text = (sdir / SUMS).read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None
    sums = {}
    for line in text.splitlines():
        digest, sep, rel = line.partition("  ")
        if sep and len(digest) == 64:
            sums[rel] = digest
    return sums


def backups(sdir: Path) -> list:
    """[(relative path, state)] of the backups on disk, state 'verified' / 'corrupt' / 'unverified' / 'missing'."""
    sums = read_sums(sdir)
    base = sdir / BACKUPS
    found = {}
    if base.is_dir():
        for path in sorted(base.rglob("*")):
            if path.is_file() and not path.name.endswith(durable.TMP_SUFFIX):
                rel = path.relative_to(base).as_posix()
                digest = hash_or_none(path)
                found[rel] = ("unverified" if sums is None or rel not in sums
                              else "verified" if sums[rel] == digest else "corrupt")
    for rel in sums or ():
        found.setdefault(rel, "missing")
    return sorted(found.items())


def recovery(cmd: str, root: Path, sdir: Path, state_dir) -> str:
    """What the backups in `sdir` can restore, and the command that does it."""
    rows = backups(sdir)
    by_state: dict = {}
    for rel, st in rows:
        by_state.setdefault(st, []).append(rel)
    if not by_state.get("verified") and not by_state.get("unverified"):
        return (f"no usable backup is in {sdir / BACKUPS}, so tpfuse cannot restore the originals (reinstall the "
                f"engine for them); remove {sdir} to {'patch again' if cmd == 'patch' else 'clear the state'}")
    parts = []
    labels = {"verified": "whose checksums match SHA256SUMS", "unverified": "with no checksum to verify them against",
              "corrupt": "that do NOT match SHA256SUMS (kept, not restored)",
              "missing": "listed in SHA256SUMS but absent"}
    for st in ("verified", "unverified", "corrupt", "missing"):
        if by_state.get(st):
            more = len(by_state[st]) - 8
            shown = ", ".join(by_state[st][:8]) + (f" and {more} more" if more > 0 else "")
            parts.append(f"{len(by_state[st])} original file(s) {labels[st]}: {shown}")
    return (f"recoverable from the backups in {sdir / BACKUPS}: {'; '.join(parts)}. "
            f"Restore them byte for byte with `{revert_cmd(root, state_dir, force=True)}`"
            f" (it writes each backup over its file and removes the patch state)")


def load_or_explain(cmd: str, root: Path, sdir: Path, state_dir) -> dict:
    try:
        return read_manifest(sdir / MANIFEST)
    except Unreadable as why:
        raise ManifestError(f"{cmd}: the patch manifest {sdir / MANIFEST} {why}, so it cannot say which files were "
                            f"patched; {recovery(cmd, root, sdir, state_dir)}") from None


def leftover_differs(root: Path, sdir: Path) -> list:
    """Backups (in a state directory without a manifest) whose bytes differ from the target's file."""
    base = sdir / BACKUPS
    differ = []
    for rel, _ in backups(sdir):
        backup = base / rel
        if backup.is_file() and hash_or_none(backup) != hash_or_none(root / rel):
            differ.append(rel)
    return differ


def remove_state(sdir: Path) -> None:
    """Delete the state: the manifest first (a kill after it leaves backups equal to the files: harmless)."""
    try:
        removed = durable.remove(sdir / MANIFEST)
    except OSError:  # not a plain file (a directory in its place): the rmtree below takes it
        removed = False
    if removed:
        durable.fsync_dir(sdir)
        durable.checkpoint("manifest-removed")
    shutil.rmtree(sdir, ignore_errors=True)


def remove_marker(root: Path) -> None:
    """Delete the tree's marker (before the state it names: a kill between leaves a state without marker,
    which `revert` finds in the default place or with --state-dir, never a marker naming nothing)."""
    tree_dir = Path(root).resolve() / TREE_DIR
    if durable.remove(tree_dir / MARKER):
        durable.fsync_dir(tree_dir)


def clear_tree_dir(root: Path) -> None:
    """Once the patch is gone: the default state's lock (the caller holds it and is done) and `.tpfuse-patch/`."""
    tree_dir = Path(root).resolve() / TREE_DIR
    durable.remove(tree_dir / f"{STATE}.lock")
    try:
        tree_dir.rmdir()
    except OSError:  # not empty (an external state's own files are elsewhere), or already gone
        return
    durable.fsync_dir(tree_dir.parent)


def has_manifest(sdir: Path) -> bool:
    return os.path.lexists(sdir / MANIFEST)


def load(root: Path, *, state_dir=None) -> tuple[Path, dict]:
    """(manifest path, manifest) of the patch on `root`; ManifestError if none or unreadable (with the recovery)."""
    root = Path(root).resolve()
    sdir, _ = locate(root, state_dir)
    if not has_manifest(sdir):
        raise ManifestError(f"revert: no tpfuse patch recorded for {root} (looked in {sdir}); nothing to revert")
    return sdir / MANIFEST, load_or_explain("revert", root, sdir, state_dir)
