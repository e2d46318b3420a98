"""What `tpfuse audit TARGET` means: a directory, a file, or an installed package's name.

A package name is located with `importlib.util.find_spec` on the top-level name (which reads the
import system's finders and never executes the package) and, failing that, by searching
`sys.path` directly. Files are listed in a stable order; caches, VCS directories and a patched
tree's own undo (`.tpfuse-patch/`) are skipped, and a directory that cannot be listed is recorded
in `Target.unlisted`. Symbolic links are never silent: a link to a directory is not followed (a
tree cannot loop through it); one into the tree itself, and a `.py` link to a file of the tree, is
an alias (`Target.aliases`: its text is audited once, under its real path, so a patch edits the
real file once), and a link to a directory outside the tree is listed as skipped (`linked-directory`).

Reading (`read_bytes`, `read_source`, `stream_matches`) never raises anything but `SourceSkip`,
whose `reason` is one of `REASONS`: the audit reports it and goes on. A file is read only if it is
a regular file, opened once (non-blocking) and checked with `fstat`, so a FIFO, a device or a file
that grows cannot block the audit or take its memory. `read_bytes` holds at most
`max_source_bytes()` bytes (MAX_SOURCE_BYTES unless TPFUSE_AUDIT_MAX_BYTES says otherwise); a larger
file is only streamed through the audit's text filter in 1 MiB chunks, and skipped as too large if
the filter says it may hold a gate. The bound is what bounds memory, as parsing costs a fixed
multiple of the source size (benchmarks/results/README.md has the measured peak RSS).
Python source is decoded as Python decodes it (PEP 263: BOM, coding cookie, else UTF-8), strictly:
text that Python itself could not import is skipped, never silently altered.
"""

from __future__ import annotations

import errno
import importlib.util
import io
import os
import stat
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

from tpfuse.env import audit_max_bytes

PY_SUFFIXES = (".py",)
NATIVE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".hh", ".cpp", ".cc", ".cxx", ".c", ".inl")
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".tox", ".venv", "node_modules", ".mypy_cache", ".pytest_cache",
              ".tpfuse", ".tpfuse-patch"}
KNOWN_PACKAGES = ("sglang", "vllm", "flashinfer", "tensorrt_llm")
# The largest Python file of sglang 0.5.23 is 282 KB (srt/managers/scheduler.py): 1 MiB leaves 3.6x room
# while one file's parse stays within the audit's memory target (peak RSS per bound: benchmarks/results/README.md).
MAX_SOURCE_BYTES = 2**20
MAX_BYTES_ENV = "TPFUSE_AUDIT_MAX_BYTES"
# Why a file was not scanned (the `reason` of a `skipped` entry); append-only, reports carry them.
REASONS = ("symlink-loop", "dangling-link", "unreadable", "not-a-file", "too-large", "undecodable", "unparsable",
           "unlistable", "linked-directory")


class SourceSkip(Exception):
    """A file the audit cannot scan: `reason` (one of REASONS) and a message saying why."""

    def __init__(self, reason: str, message: str):
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason


def max_source_bytes() -> int:
    """The per-file bound: TPFUSE_AUDIT_MAX_BYTES, else MAX_SOURCE_BYTES; ValueError naming the variable for a bad
    value."""
    return audit_max_bytes() or MAX_SOURCE_BYTES


def _open_error(path: Path, exc: OSError) -> SourceSkip:
    if exc.errno == errno.ELOOP:
        return SourceSkip("symlink-loop", f"symbolic link loop ({exc.strerror})")
    if exc.errno == errno.ENOENT and os.path.islink(path):
        return SourceSkip("dangling-link", f"dangling symbolic link to {os.readlink(path)!r}")
    return SourceSkip("unreadable", f"cannot be read ({exc.strerror or exc})")


def read_bytes(path: Path, *, limit: int | None = None) -> bytes:
    """The bytes of a regular file of at most `limit` (default `max_source_bytes()`) bytes; else SourceSkip."""
    limit = max_source_bytes() if limit is None else limit
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat below then refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _open_error(Path(path), exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("directory" if stat.S_ISDIR(st.st_mode)
                    else "FIFO" if stat.S_ISFIFO(st.st_mode) else "device or socket")
            raise SourceSkip("not-a-file", f"not a regular file (a {kind})")
        if st.st_size > limit:
            raise SourceSkip("too-large", _too_large(st.st_size, limit))
        chunks, size = [], 0
        # The first read asks for the size fstat gave and one byte more (a growing file shows), not a fixed
        # 1 MiB: allocating and shrinking a buffer that large for every small file was most of reading a tree.
        want = st.st_size + 1
        while size <= limit:  # read to EOF, but never more than limit + 1 bytes (the file may grow)
            chunk = os.read(fd, min(want, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            # A short read was the end of the file: the next read only confirms it (one byte, not a 1 MiB buffer).
            want = 1 << 20 if len(chunk) >= want else 1
        if size > limit:
            raise SourceSkip("too-large", _too_large(size, limit))
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    except OSError as exc:
        raise SourceSkip("unreadable", f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def _too_large(size: int, limit: int) -> str:
    return (f"{size} bytes, above the audit's per-file bound of {limit} bytes; set {MAX_BYTES_ENV} to a larger byte "
            "count to scan it")


def stream_matches(path: Path, predicate, *, chunk: int = 1 << 20, overlap: int = 64) -> bool:
    """True if `predicate(data)` holds for some window of the file's bytes, read `chunk` bytes at a time.

    Windows overlap by `overlap` bytes, so a match shorter than that is never split (the audit's
    filter words are at most 21 characters)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _open_error(Path(path), exc) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SourceSkip("not-a-file", "not a regular file")
        tail = b""
        while True:
            block = os.read(fd, chunk)
            if not block:
                return False
            if predicate(tail + block):
                return True
            tail = (tail + block)[-overlap:]
    except OSError as exc:
        raise SourceSkip("unreadable", f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def source_encoding(data: bytes) -> str:
    """The encoding Python reads `data` with (PEP 263); SourceSkip('undecodable') for a bad cookie."""
    try:
        return tokenize.detect_encoding(io.BytesIO(data).readline)[0]
    except SyntaxError as exc:
        msg = getattr(exc, "msg", None) or str(exc)
        if msg.startswith("invalid or missing encoding declaration"):
            return "utf-8"  # no cookie and not UTF-8 in the first two lines: the decode says where
        raise SourceSkip("undecodable", f"bad encoding declaration ({msg})") from None


def decode_source(data: bytes) -> tuple[str, str]:
    """(text, encoding) of Python source bytes, decoded strictly; SourceSkip('undecodable') otherwise.

    A UTF-8 BOM gives encoding 'utf-8-sig': the text has no BOM and `text.encode(encoding)` puts it back."""
    encoding = source_encoding(data)
    try:
        return data.decode(encoding), encoding
    except UnicodeDecodeError as exc:
        raise SourceSkip("undecodable",
                         f"not valid {encoding} at byte {exc.start}; Python cannot import it either (declare its "
                         "encoding with a coding cookie)") from None


def read_source(path: Path, *, limit: int | None = None) -> tuple[str, str, bytes]:
    """(text, encoding, raw bytes) of a Python file; SourceSkip when it cannot be read or decoded."""
    data = read_bytes(path, limit=limit)
    text, encoding = decode_source(data)
    return text, encoding, data


@dataclass(frozen=True)
class Target:
    """The audited tree: `root` (paths are reported relative to it) and the files in it."""

    spec: str
    root: Path
    python_files: tuple
    native_files: tuple
    # ({"path", "reason", "error"}, ...): directories that could not be listed or are linked from outside
    unlisted: tuple = ()
    note: str | None = None  # why nothing was scanned (a file that is neither Python nor native source)
    aliases: tuple = ()  # ({"path", "target"}, ...): links into the tree, audited under their real paths


def _walk(top: Path, onerror, onlink):
    """os.walk(top, onerror=onerror) top-down, without recursion: os.walk recurses once per level
    (Python 3.11), so a tree nested deeper than the interpreter's recursion limit would crash it.
    Links to directories are not followed; each is passed to `onlink(path)`. Yields (dirpath, dirnames,
    filenames, the names of filenames that are symbolic links)."""
    stack = [str(top)]
    while stack:
        dirpath = stack.pop()
        try:
            with os.scandir(dirpath) as it:
                entries = list(it)
        except OSError as exc:
            onerror(exc)
            continue
        dirnames, filenames, follow, links = [], [], set(), set()
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            (dirnames if is_dir else filenames).append(entry.name)
            is_link = entry.is_symlink()
            if is_dir and not is_link:
                follow.add(entry.name)
            elif not is_dir and is_link:
                links.add(entry.name)
        yield dirpath, dirnames, filenames, links
        for d in sorted(dirnames):
            if d not in follow:
                onlink(Path(dirpath) / d)
        stack.extend(os.path.join(dirpath, d) for d in reversed(dirnames) if d in follow)


def _is_cmake(name: str) -> bool:
    return name == "CMakeLists.txt" or name.endswith(".cmake")


def _find_package(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        if spec.submodule_search_locations:
            return Path(next(iter(spec.submodule_search_locations)))
        if spec.origin and spec.origin not in ("built-in", "frozen"):
            return Path(spec.origin)
    for entry in sys.path:
        for cand in (Path(entry or ".") / name, Path(entry or ".") / f"{name}.py"):
            if cand.is_dir() and (cand / "__init__.py").exists() or cand.is_file():
                return cand
    return None


def resolve_target(spec: str, *, native: bool = True) -> Target:
    """TARGET string -> `Target`; ValueError with the fix when it is neither a path nor an installed package."""
    path = Path(spec).expanduser()
    if not path.exists():
        if os.sep in spec or spec.startswith(".") or not spec.isidentifier():
            raise ValueError(f"TARGET: path {spec!r} does not exist; pass a directory, a .py file or an installed "
                             "package name")
        found = _find_package(spec)
        if found is None:
            raise ValueError(
                f"TARGET: {spec!r} is neither a path nor an installed package; install it "
                f"(pip install {spec}) or pass the directory of its source (known engines: {', '.join(KNOWN_PACKAGES)})"
            )
        path = found
    path = path.resolve()
    if path.is_file():
        is_native = path.suffix in NATIVE_SUFFIXES or _is_cmake(path.name)
        if not is_native and path.suffix not in PY_SUFFIXES:
            return Target(spec, path.parent, (), (),
                          note=f"{path.name} is not a Python (.py) or C/C++/CUDA/CMake source; nothing to audit")
        return Target(spec, path.parent, () if is_native else (path,), (path,) if is_native and native else ())
    py, nat, unlisted, aliases = [], [], [], []

    def unlistable(exc: OSError) -> None:
        rel = Path(exc.filename).relative_to(path).as_posix() if exc.filename else "."
        unlisted.append({"path": rel, "reason": "unlistable",
                         "error": f"directory cannot be listed ({exc.strerror or exc})"})

    def linked(link: Path) -> None:
        rel = link.relative_to(path).as_posix()
        if link.name in _SKIP_DIRS:
            return
        try:
            real = link.resolve(strict=True)
        except (OSError, RuntimeError):
            return  # dangling or looping: nothing to scan behind it
        if real.is_relative_to(path):
            aliases.append({"path": rel, "target": real.relative_to(path).as_posix()})
        else:
            unlisted.append({"path": rel, "reason": "linked-directory",
                             "error": f"a link to a directory outside the tree ({real}), not followed; "
                                      f"audit {real} itself"})

    links: set = set()  # the listed files that are symbolic links
    for dirpath, dirnames, filenames, linked_names in _walk(path, unlistable, linked):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
        for fname in sorted(filenames):
            if fname.endswith(PY_SUFFIXES):
                listed = py
            elif native and (fname.endswith(NATIVE_SUFFIXES) or _is_cmake(fname)):
                listed = nat
            else:
                continue
            full = Path(os.path.join(dirpath, fname))
            listed.append(full)
            if fname in linked_names:
                links.add(full)
    py = _without_aliases(path, py, aliases, links)
    nat = _without_aliases(path, nat, aliases, links)
    return Target(spec, path, tuple(py), tuple(nat), tuple(unlisted), aliases=tuple(aliases))


def _without_aliases(root: Path, files: list, aliases: list, links: set) -> list:
    """`files` less the links (those of them in `links`) to another listed file of the tree (recorded in
    `aliases`)."""
    if not links:
        return files
    listed = set(files)
    out = []
    for full in files:
        if full in links:
            try:
                real = full.resolve(strict=True)
            except (OSError, RuntimeError):
                real = None  # dangling or looping: read_bytes says so
            if real is not None and real != full and real in listed:
                aliases.append({"path": full.relative_to(root).as_posix(), "target": real.relative_to(root).as_posix()})
                continue
        out.append(full)
    return out
