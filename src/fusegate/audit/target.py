"""What `fusegate audit TARGET` means: a directory, a file, or an installed package's name.

A package name is located with `importlib.util.find_spec` on the top-level name (which reads the
import system's finders and never executes the package) and, failing that, by searching
`sys.path` directly. Files are listed in a stable order; caches and VCS directories are skipped.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

PY_SUFFIXES = (".py",)
NATIVE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".hh", ".cpp", ".cc", ".cxx", ".c", ".inl")
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".tox", ".venv", "node_modules", ".mypy_cache", ".pytest_cache", ".fusegate"}
KNOWN_PACKAGES = ("sglang", "vllm", "flashinfer", "tensorrt_llm")


@dataclass(frozen=True)
class Target:
    """The audited tree: `root` (paths are reported relative to it) and the files in it."""

    spec: str
    root: Path
    python_files: tuple
    native_files: tuple
    note: str | None = None  # why nothing was scanned (a file that is neither Python nor native source)


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
            raise ValueError(f"TARGET: path {spec!r} does not exist; pass a directory, a .py file or an installed package name")
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
            return Target(spec, path.parent, (), (), f"{path.name} is not a Python (.py) or C/C++/CUDA/CMake source; nothing to audit")
        return Target(spec, path.parent, () if is_native else (path,), (path,) if is_native and native else ())
    py, nat = [], []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
        for fname in sorted(filenames):
            full = Path(dirpath) / fname
            if fname.endswith(PY_SUFFIXES):
                py.append(full)
            elif native and (fname.endswith(NATIVE_SUFFIXES) or _is_cmake(fname)):
                nat.append(full)
    return Target(spec, path, tuple(py), tuple(nat))
