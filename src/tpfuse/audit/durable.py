"""Durable file writes for `patch --apply` / `revert`: a write is on disk before the next step starts.

`write(path, data, mode)` writes `data` to `tmp_path(path)` (a fixed name beside `path`, so a
later `revert` finds and removes it after a crash), gives it `mode` and the owner of the file it
replaces, fsyncs it, renames it over `path` and fsyncs the directory: at every instant `path`
holds either its old bytes or all of its new ones.

`checkpoint(step)` marks the points between durable steps; `fault_hook`, when set, is called with
each step's name, which is how the crash tests kill a patch at every boundary (manifest.py lists the
steps). Production code never sets it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

TMP_SUFFIX = ".tpfuse-tmp"
fault_hook: Callable[[str], None] | None = None


def checkpoint(step: str) -> None:
    if fault_hook is not None:
        fault_hook(step)


def tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{TMP_SUFFIX}")


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(path: Path, data: bytes, mode: int, *, step: str | None = None) -> None:
    """Replace `path` with `data` (permission bits `mode`) atomically and durably; the temp file never outlives
    an error."""
    path = Path(path)
    tmp = tmp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            view = memoryview(data)
            _write_all(fd, view[: len(data) // 2])
            if step:
                checkpoint(f"tmp-half:{step}")  # a kill in the middle of a write
            _write_all(fd, view[len(data) // 2:])
            os.fchmod(fd, mode)
            _keep_owner(fd, path)
            os.fsync(fd)
        finally:
            os.close(fd)
        if step:
            checkpoint(f"tmp-written:{step}")
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise
    fsync_dir(path.parent)


def _keep_owner(fd: int, path: Path) -> None:
    """Give the new file the owner of the one it replaces (root patching another user's tree)."""
    try:
        st = os.stat(path)
        if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
            os.fchown(fd, st.st_uid, st.st_gid)
    except OSError:  # nothing to replace yet, or not permitted: the writer's ownership stands
        pass


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def remove(path: Path) -> bool:
    """Unlink `path` if it exists (a leftover temp file); True if it did."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def lock(path: Path) -> int:
    """An fd holding an exclusive flock on `path` (created if needed); BlockingIOError at once if held.

    The kernel drops a flock when its holder dies, so a killed patch never leaves the lock held."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd
