"""Patch transactions: byte-exact backups and an intent record reach the disk before any target file changes.

The patched tree carries its own undo (patchstate.py has the layout): `<root>/.tpfuse-patch/`
holds `marker.json` (which state holds the patch, and every patched file's checksums) and, unless
`--state-dir DIR` puts it in `DIR/<sha1(root)[:12]>/`, the state itself:
    backups/<relative path>   each original, byte for byte, with its permission bits
    SHA256SUMS                `<sha256>  <relative path>` per backup (the `sha256sum -c` format)
    manifest.json             the intent record: target, files (path, sha256 before/after, mode), "complete"
so `revert` finds it wherever the tree is moved, and a wiped cache loses nothing.

Apply, each step durable (file and directory fsynced, durable.py) before the next: check every file
(unchanged since the audit, writable: a file without the owner write bit counts as read-only even
for root) -> backups -> SHA256SUMS -> manifest.json with "complete": false -> the tree's marker ->
each target file, re-hashed right before it is replaced (a file edited since it was read stops the
apply: the user's bytes are kept, the files already written are put back) and replaced through a
temp file beside it -> "complete": true. A kill at any instant therefore leaves one of two states.
Before the manifest exists no target file has changed, and a leftover state directory holds only
copies of the current files (the next apply or revert checks that and clears it). Once it exists
every original is on disk with its checksum, and each target file is whole: its original or its
patched bytes. `revert` works from both: a file that still hashes to its original is left alone,
one that hashes to the patched bytes is restored (re-hashed right before, so an edit made during
the revert is kept and stops it), anything else was edited after patching and is overwritten only
with `force`; the temp files beside the targets are removed; the marker, then the manifest, are
deleted before the backups, so a revert killed midway is finished by running it again. A second
apply refuses while the tree carries a marker or the state a manifest ("already carries a patch;
run revert"). A manifest that cannot be read (unreadable, empty,
truncated, missing keys) is never guessed at: the error names it, lists the backups SHA256SUMS
verifies, and gives the command that restores them without it (`tpfuse revert ROOT --force`);
patchstate.py reads and checks that state. One apply or revert runs at a time per state: each
holds a flock on `<state>.lock` beside the state directory, which the kernel drops if it is killed.

Fault injection: `durable.fault_hook` is called at each step. Apply: `backup:<rel>`, `sums`, `intent`,
`marker`, per file `tmp-half:<rel>`, `tmp-written:<rel>`, `replaced:<rel>`, then `commit`. Revert: per file
`tmp-half:revert:<rel>`, `tmp-written:revert:<rel>`, `restored:<rel>`, then `manifest-removed`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import stat
from pathlib import Path

from tpfuse.audit import durable
from tpfuse.audit import patchstate as ps
from tpfuse.audit.patchstate import ManifestError, load, sha256, state_dir_for
from tpfuse.audit.target import SourceSkip, source_encoding

__all__ = ["ManifestError", "apply", "existing_patch", "load", "revert", "sha256", "state_dir_for"]


def _check_writable(path: Path) -> str | None:
    try:
        st = path.stat()
    except OSError as exc:
        return str(exc)
    if not st.st_mode & stat.S_IWUSR or not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK):
        return "read-only"
    return None


def _encode(rel: str, text, original: bytes) -> bytes:
    """New file bytes in the encoding the original declares (PEP 263), so every byte outside the edit stays."""
    if isinstance(text, bytes):
        return text
    try:
        return text.encode(source_encoding(original))
    except SourceSkip as exc:
        raise ManifestError(f"patch: {rel}: {exc}; nothing was written; fix its coding cookie") from None
    except UnicodeEncodeError as exc:
        raise ManifestError(f"patch: the edit of {rel} cannot be written in its encoding {exc.encoding} "
                            f"({exc.reason}); nothing was written; patch it by hand") from None


# -- apply ------------------------------------------------------------------------------------
def _write_manifest(sdir: Path, manifest: dict) -> None:
    durable.write(sdir / ps.MANIFEST, json.dumps(manifest, indent=2).encode(), 0o644)


def _mkdir(path: Path) -> None:
    """mkdir -p, fsyncing each new directory's parent so the entries survive a power cut too."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        durable.fsync_dir(d.parent)


def _pending(cmd: str, root: Path, state_dir) -> str | None:
    """Why `root` cannot take a new patch now (it carries one, or an interrupted one), or None."""
    try:
        marker = ps.read_marker(root)
    except ps.Unreadable as why:
        return (f"{cmd}: {why}, so it cannot say whether {root} is patched; run `{ps.revert_cmd(root, state_dir)}`, "
                f"or remove {ps.marker_path(root).parent} if you know the files are the originals")
    sdir, _ = ps.locate(root, state_dir)
    if ps.has_manifest(sdir):
        manifest = ps.load_or_explain(cmd, root, sdir, state_dir)
        if manifest.get("complete", True):
            return (f"{cmd}: {root} already carries a tpfuse patch ({sdir / ps.MANIFEST}); "
                    f"run `{ps.revert_cmd(root, state_dir)}` first")
        return (f"{cmd}: an earlier `patch --apply` on {root} was interrupted and may have written some of its "
                f"{len(manifest['files'])} file(s) ({sdir / ps.MANIFEST}); run `{ps.revert_cmd(root, state_dir)}` "
                f"to restore the originals first")
    if marker is not None and not sdir.exists():
        patched = [e.get("path") for e in marker["files"] if isinstance(e, dict)
                   and ps.hash_or_none(root / str(e.get("path"))) != e.get("sha256_before")]
        if patched:
            return _lost_state(cmd, root, sdir, patched)
    return None


def _lost_state(cmd: str, root: Path, sdir: Path, patched: list) -> str:
    return (f"{cmd}: {root} carries a tpfuse patch ({ps.marker_path(root)}) whose state {sdir} is gone (a wiped "
            f"cache?), and {', '.join(patched)} differ from the originals it recorded; nothing changed; reinstall the "
            "engine for the originals (pip install --force-reinstall --no-deps <package>==<version>), then remove "
            f"{ps.marker_path(root).parent}")


def existing_patch(root: Path, state_dir=None) -> str | None:
    """Why a new `patch --apply` of `root` is refused before anything is planned (it carries a patch), or None."""
    return _pending("patch", Path(root).resolve(), state_dir)


def _refuse_pending(root: Path, sdir: Path, state_dir) -> None:
    why = _pending("patch", root, state_dir)
    if why:
        raise ManifestError(why)
    stale = ps.locate(root, state_dir)[0]
    for leftover in dict.fromkeys((stale, sdir)):
        if leftover.exists():
            differ = ps.leftover_differs(root, leftover)
            if differ:
                raise ManifestError(f"patch: {leftover} holds backups but no manifest, and {', '.join(differ)} differ "
                                    f"from the files in {root}; {ps.recovery('patch', root, leftover, state_dir)}")
            ps.remove_state(leftover)  # an apply killed before its manifest: copies of the current files only
    ps.remove_marker(root)  # a marker whose files all hold their originals (its state is gone)


@contextlib.contextmanager
def _locked(cmd: str, root: Path, sdir: Path):
    """One patch or revert at a time per target: a flock on a file beside its state directory."""
    try:
        fd = durable.lock(sdir.with_name(sdir.name + ".lock"))
    except BlockingIOError:
        raise ManifestError(f"{cmd}: another tpfuse patch or revert is running on {root}; wait for it to finish, then "
                            "run this again") from None
    except OSError as exc:
        raise ManifestError(f"{cmd}: cannot create the patch state in {sdir.parent} ({exc.strerror or exc}); nothing "
                            "was changed; pass --state-dir DIR on a writable disk") from None
    try:
        yield
    finally:
        os.close(fd)


def apply(root: Path, changes: dict, expected: dict, meta: dict, *, state_dir=None) -> Path:
    """Write `changes` ({relative path: new text}) under `root` as one transaction; returns the manifest path.

    `expected` maps each path to the sha256 its content had when audited. New text is encoded
    with the encoding its file declares. `state_dir` (made absolute) keeps the state outside the tree."""
    root = Path(root).resolve()
    sdir = ps.state_dir_for(root, state_dir)
    with _locked("patch", root, sdir):
        try:
            return _apply(root, sdir, changes, expected, meta, state_dir)
        except BaseException:
            if not sdir.exists() and not os.path.lexists(ps.marker_path(root)):
                ps.clear_tree_dir(root)  # refused before writing: leave the tree as it was (no lock file either)
            raise


class _ChangedDuringApply(Exception):
    def __init__(self, rel: str):
        super().__init__(rel)
        self.rel = rel


def _apply(root: Path, sdir: Path, changes: dict, expected: dict, meta: dict, state_dir) -> Path:
    _refuse_pending(root, sdir, state_dir)
    originals, new_bytes, files = {}, {}, []
    for rel, text in changes.items():
        path = root / rel
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ManifestError(f"patch: {rel} cannot be read ({exc.strerror or exc}); nothing was written; audit "
                                "again") from None
        if ps.sha256(data) != expected.get(rel):
            raise ManifestError(f"patch: {rel} changed since it was audited; run `tpfuse audit` again and re-select "
                                "the gates")
        # os.replace would put a file where the link was, and revert could not bring the link back
        if path.is_symlink():
            real = path.resolve()
            if real.is_relative_to(root):
                raise ManifestError(f"patch: {rel} is a symbolic link to {real.relative_to(root)} in the same tree; "
                                    f"nothing was written; patch {real.relative_to(root)} itself (tpfuse audit lists "
                                    "it as the alias's file)")
            raise ManifestError(f"patch: {rel} is a symbolic link to {os.readlink(path)}; nothing was written; "
                                f"patch the tree it points into instead (tpfuse patch {real.parent})")
        problem = _check_writable(path)
        if problem:
            raise ManifestError(f"patch: {rel} is {problem}; nothing was written; make it writable (chmod u+w) or "
                                "patch a copy")
        originals[rel], new_bytes[rel] = data, _encode(rel, text, data)
        files.append({"path": rel, "sha256_before": ps.sha256(data), "sha256_after": ps.sha256(new_bytes[rel]),
                      "backup": str(sdir / ps.BACKUPS / rel), "mode": stat.S_IMODE(path.stat().st_mode)})
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    manifest = {"version": 2, "target": str(root), "created": created, **meta, "complete": False, "files": files}
    inside = sdir.is_relative_to(root / ps.TREE_DIR)
    marker = {"version": 1, "target": str(root), "created": created,
              "state": str(sdir.relative_to(root / ps.TREE_DIR)) if inside else str(sdir),
              "files": [{k: e[k] for k in ("path", "sha256_before", "sha256_after")} for e in files]}
    try:
        for entry in files:
            backup = sdir / ps.BACKUPS / entry["path"]
            _mkdir(backup.parent)
            durable.write(backup, originals[entry["path"]], entry["mode"])
            durable.checkpoint(f"backup:{entry['path']}")
        durable.write(sdir / ps.SUMS, "".join(f"{e['sha256_before']}  {e['path']}\n" for e in files).encode(), 0o644)
        durable.checkpoint("sums")
        _write_manifest(sdir, manifest)
        durable.checkpoint("intent")
        _mkdir(ps.marker_path(root).parent)
        durable.write(ps.marker_path(root), json.dumps(marker, indent=2).encode(), 0o644)
        durable.checkpoint("marker")
    except BaseException as exc:
        ps.remove_marker(root)
        ps.remove_state(sdir)
        ps.clear_tree_dir(root)
        if not isinstance(exc, Exception):
            raise
        raise ManifestError(f"patch: writing the backups to {sdir} or the marker {ps.marker_path(root)} failed "
                            f"({exc}); no target file was changed, nothing changed; free space there or pass "
                            "--state-dir DIR on a writable disk") from exc
    done = 0
    try:
        for entry in files:
            path = root / entry["path"]
            if ps.hash_or_none(path) != entry["sha256_before"]:
                raise _ChangedDuringApply(entry["path"])  # edited since it was read: the user's bytes win
            durable.write(path, new_bytes[entry["path"]], entry["mode"], step=entry["path"])
            durable.checkpoint(f"replaced:{entry['path']}")
            done += 1
        manifest["complete"] = True
        _write_manifest(sdir, manifest)
        durable.checkpoint("commit")
    except BaseException as exc:
        what = f"{done + 1}/{len(files)} ({files[done]['path']})" if done < len(files) else "the manifest"
        try:
            undone = _undo(root, sdir, files)
        except Exception as again:
            raise ManifestError(f"patch: writing {what} failed ({exc}) and undoing it failed too ({again}); the "
                                f"originals are safe in {sdir / ps.BACKUPS}; run "
                                f"`{ps.revert_cmd(root, state_dir)}`") from exc
        if isinstance(exc, _ChangedDuringApply):
            raise ManifestError(f"patch: {exc.rel} changed while the patch was being applied (edited after it was "
                                f"read); kept its new bytes; restored the {undone} file(s) already written, nothing "
                                "else changed; audit again and re-run the patch") from None
        if not isinstance(exc, Exception):
            raise
        raise ManifestError(f"patch: writing {what} failed ({exc}); restored the {undone} file(s) written, nothing "
                            "changed") from exc
    return sdir / ps.MANIFEST


def _undo(root: Path, sdir: Path, files: list) -> int:
    """Put back every file that holds its patched bytes; then drop the state. Returns how many."""
    undone = 0
    for entry in files:
        path = root / entry["path"]
        durable.remove(durable.tmp_path(path))
        if ps.hash_or_none(path) == entry["sha256_after"]:
            durable.write(path, (sdir / ps.BACKUPS / entry["path"]).read_bytes(), entry["mode"])
            undone += 1
    ps.remove_marker(root)
    ps.remove_state(sdir)
    ps.clear_tree_dir(root)
    return undone


# -- revert -----------------------------------------------------------------------------------
def revert(root: Path, *, force: bool = False, state_dir=None) -> list[dict]:
    """Restore every patched file byte for byte; ManifestError if one changed after patching (unless `force`).

    The state is found from the tree's marker first (so a moved tree reverts), then `state_dir`.
    Rows: path, sha256 (of the original), was_changed (edited after patching), action ('restored' or
    'already original'). An empty list: a leftover of an apply killed before it changed anything was cleared."""
    root = Path(root).resolve()
    sdir, marker = ps.locate(root, state_dir)
    if not sdir.exists():
        if marker is not None:
            return _without_state(root, sdir, marker)
        raise ManifestError(f"revert: no tpfuse patch recorded for {root} (no {ps.marker_path(root)}, nothing in "
                            f"{sdir}); nothing to revert")
    with _locked("revert", root, sdir):
        rows = _revert(root, sdir, force, state_dir)
    ps.clear_tree_dir(root)
    return rows


def _without_state(root: Path, sdir: Path, marker: dict) -> list[dict]:
    """A marker whose state is gone: nothing to restore from; fine if every file holds its original."""
    entries = [e for e in marker["files"] if isinstance(e, dict) and ps.safe_rel(e.get("path"))]
    patched = [e["path"] for e in entries if ps.hash_or_none(root / e["path"]) != e.get("sha256_before")]
    if patched:
        raise ManifestError(_lost_state("revert", root, sdir, patched))
    ps.remove_marker(root)
    ps.clear_tree_dir(root)
    return [{"path": e["path"], "sha256": e["sha256_before"], "was_changed": False, "action": "already original"}
            for e in entries]


def _revert(root: Path, sdir: Path, force: bool, state_dir) -> list[dict]:
    if not ps.has_manifest(sdir):
        differ = ps.leftover_differs(root, sdir)
        if not differ:
            ps.remove_marker(root)
            ps.remove_state(sdir)
            return []
        if not force:
            raise ManifestError(f"revert: {sdir} holds backups but no manifest, and {', '.join(differ)} differ from "
                                f"the files in {root}; {ps.recovery('revert', root, sdir, state_dir)}")
        return _restore_backups(root, sdir, state_dir)
    try:
        manifest = ps.read_manifest(sdir / ps.MANIFEST)
    except ps.Unreadable:
        if not force:
            ps.load_or_explain("revert", root, sdir, state_dir)  # raises with the recovery message
        return _restore_backups(root, sdir, state_dir)
    changed, rows, seen = [], [], {}
    for entry in manifest["files"]:
        rel = entry["path"]
        backup = sdir / ps.BACKUPS / rel
        if ps.hash_or_none(backup) != entry["sha256_before"]:
            raise ManifestError(f"revert: the backup of {rel} ({backup}) is missing or does not match the manifest; "
                                f"nothing restored; restore {rel} by hand (reinstall the engine for its original)")
        current = seen[rel] = ps.hash_or_none(root / rel)
        if current not in (entry["sha256_before"], entry["sha256_after"]):
            changed.append(rel)
        rows.append({"path": rel, "sha256": entry["sha256_before"], "was_changed": rel in changed,
                     "action": "already original" if current == entry["sha256_before"] else "restored"})
    if changed and not force:
        raise ManifestError(f"revert: {', '.join(changed)} changed after patching; nothing restored; "
                            f"pass --force to overwrite them with the originals")
    for entry, row in zip(manifest["files"], rows):
        path = root / entry["path"]
        durable.remove(durable.tmp_path(path))
        if row["action"] == "restored":
            if ps.hash_or_none(path) != seen[entry["path"]]:  # edited since it was checked: the user's bytes win
                raise ManifestError(f"revert: {entry['path']} changed while the revert was running; kept its new "
                                    f"bytes; the patch state is kept; run `{ps.revert_cmd(root, state_dir)}` again "
                                    "(--force to overwrite it with the original)")
            path.parent.mkdir(parents=True, exist_ok=True)
            _restore(path, (sdir / ps.BACKUPS / entry["path"]).read_bytes(), entry.get("mode", 0o644), entry["path"],
                     root, state_dir, force)
            durable.checkpoint(f"restored:{entry['path']}")
    ps.remove_marker(root)
    ps.remove_state(sdir)
    return rows


def _restore(path: Path, data: bytes, mode: int, rel: str, root: Path, state_dir, force: bool) -> None:
    """One file back from its backup; a write error keeps the patch state, so the same revert can finish the job."""
    try:
        durable.write(path, data, mode, step=f"revert:{rel}")
    except OSError as exc:
        raise ManifestError(f"revert: restoring {rel} failed ({exc}); the backups and the manifest are kept; make "
                            f"{path.parent} writable and run `{ps.revert_cmd(root, state_dir, force=force)}` "
                            "again") from None


def _restore_backups(root: Path, sdir: Path, state_dir) -> list[dict]:
    """`revert --force` without a readable manifest: every backup SHA256SUMS does not contradict goes back."""
    rows = ps.backups(sdir)
    corrupt = [rel for rel, st in rows if st == "corrupt"]
    if corrupt:
        raise ManifestError(f"revert: the backup(s) {', '.join(corrupt)} in {sdir / ps.BACKUPS} do not match "
                            f"{sdir / ps.SUMS}; nothing restored; copy the intact ones back by hand (cp) and reinstall "
                            "the engine for the others")
    usable = [rel for rel, st in rows if st in ("verified", "unverified")]
    if not usable:
        raise ManifestError(f"revert: no backup is in {sdir / ps.BACKUPS}; nothing restored; reinstall the engine for "
                            f"the originals, then remove {sdir}")
    out = []
    for rel in usable:
        backup, path = sdir / ps.BACKUPS / rel, root / rel
        data = backup.read_bytes()
        durable.remove(durable.tmp_path(path))
        same = ps.hash_or_none(path) == ps.sha256(data)
        if not same:
            path.parent.mkdir(parents=True, exist_ok=True)
            _restore(path, data, stat.S_IMODE(backup.stat().st_mode), rel, root, state_dir, True)
        out.append({"path": rel, "sha256": ps.sha256(data), "was_changed": False,
                    "action": "already original" if same else "restored"})
    ps.remove_marker(root)
    ps.remove_state(sdir)
    return out
