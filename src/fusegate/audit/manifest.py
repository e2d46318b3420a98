"""Write patches atomically, keep byte-exact backups and a manifest, and revert from it.

State lives outside the target (which may be a read-only site-packages tree):
`<state_dir>/<sha1(target root)[:12]>/manifest.json` plus `backups/<relative path>`, where
`state_dir` defaults to `$XDG_CACHE_HOME/fusegate/patches` (`~/.cache/fusegate/patches`).

Apply: every file is checked first (unchanged since the audit, writable: a file without the owner
write bit counts as read-only even for root), backups are written, then each new text goes to a
temporary file in the same directory and `os.replace`s the original; if any step fails, the files
already replaced are restored from the backups, so the tree ends either fully patched or untouched.
Revert: each file must still hash to what the patch wrote (unless forced); the backups are
restored the same way and the manifest is removed.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path


class ManifestError(RuntimeError):
    """The tree is not in the state the operation needs; the message says what to do."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def state_dir_for(root: Path, state_dir: str | Path | None = None) -> Path:
    base = Path(state_dir) if state_dir else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fusegate" / "patches"
    return base / hashlib.sha1(str(Path(root).resolve()).encode()).hexdigest()[:12]


def _atomic_write(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".fusegate-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _check_writable(path: Path) -> str | None:
    try:
        st = path.stat()
    except OSError as exc:
        return str(exc)
    if not st.st_mode & stat.S_IWUSR or not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK):
        return "read-only"
    return None


def apply(root: Path, changes: dict, expected: dict, meta: dict, *, state_dir=None) -> Path:
    """Write `changes` ({relative path: new text}) under `root`, all or nothing; returns the manifest path.

    `expected` maps each path to the sha256 its content had when audited."""
    root = Path(root).resolve()
    sdir = state_dir_for(root, state_dir)
    manifest_path = sdir / "manifest.json"
    if manifest_path.exists():
        raise ManifestError(f"patch: {root} already carries a fusegate patch ({manifest_path}); run `fusegate revert {root}` first")
    originals = {}
    for rel in changes:
        path = root / rel
        data = path.read_bytes()
        if sha256(data) != expected.get(rel):
            raise ManifestError(f"patch: {rel} changed since it was audited; run `fusegate audit` again and re-select the gates")
        problem = _check_writable(path)
        if problem:
            raise ManifestError(f"patch: {rel} is {problem}; nothing was written; make it writable (chmod u+w) or patch a copy")
        originals[rel] = data
    backups = sdir / "backups"
    files = []
    for rel, data in originals.items():
        backup = backups / rel
        backup.parent.mkdir(parents=True, exist_ok=True)
        backup.write_bytes(data)
        new = changes[rel].encode("utf-8")
        files.append({"path": rel, "sha256_before": sha256(data), "sha256_after": sha256(new), "backup": str(backup), "mode": stat.S_IMODE((root / rel).stat().st_mode)})
    done = []
    try:
        for entry in files:
            path = root / entry["path"]
            _atomic_write(path, changes[entry["path"]].encode("utf-8"), entry["mode"])
            done.append(entry)
    except BaseException as exc:
        for entry in done:
            _atomic_write(root / entry["path"], originals[entry["path"]], entry["mode"])
        shutil.rmtree(sdir, ignore_errors=True)
        raise ManifestError(f"patch: writing {len(done) + 1}/{len(files)} failed ({exc}); restored the {len(done)} file(s) written, nothing changed") from exc
    manifest = {"target": str(root), "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **meta, "files": files}
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return manifest_path


def load(root: Path, *, state_dir=None) -> tuple[Path, dict]:
    path = state_dir_for(root, state_dir) / "manifest.json"
    if not path.exists():
        raise ManifestError(f"revert: no fusegate patch recorded for {Path(root).resolve()} (looked in {path.parent}); nothing to revert")
    return path, json.loads(path.read_text())


def revert(root: Path, *, force: bool = False, state_dir=None) -> list[dict]:
    """Restore every patched file byte-for-byte; ManifestError if one changed after patching (unless `force`)."""
    root = Path(root).resolve()
    manifest_path, manifest = load(root, state_dir=state_dir)
    changed = []
    for entry in manifest["files"]:
        path = root / entry["path"]
        current = sha256(path.read_bytes()) if path.exists() else None
        if current != entry["sha256_after"]:
            changed.append(entry["path"])
        backup = Path(entry["backup"])
        if not backup.exists() or sha256(backup.read_bytes()) != entry["sha256_before"]:
            raise ManifestError(f"revert: backup of {entry['path']} is missing or corrupt ({backup}); nothing restored; restore it by hand")
    if changed and not force:
        raise ManifestError(f"revert: {', '.join(changed)} changed after patching; nothing restored; pass --force to overwrite them with the originals")
    restored = []
    for entry in manifest["files"]:
        data = Path(entry["backup"]).read_bytes()
        _atomic_write(root / entry["path"], data, entry.get("mode", 0o644))
        restored.append({"path": entry["path"], "sha256": entry["sha256_before"], "was_changed": entry["path"] in changed})
    shutil.rmtree(manifest_path.parent, ignore_errors=True)
    return restored
