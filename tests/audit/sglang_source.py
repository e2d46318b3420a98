"""The real sglang source for the audit tests, from PyPI, cached outside the repository, and the
story's runtime gate in it.

Cache: `$XDG_CACHE_HOME/tpfuse-tests` (default `~/.cache/tpfuse-tests`): the wheel under
`wheels/`, its Python files under `sglang-<version>/sglang`. The wheel is fetched with
`pip download --no-deps` for a fixed interpreter/platform tag, so any test interpreter gets the
same file; tests skip with the pip error when the registry is unreachable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# The sglang release the idiom fixtures and expected gates were written against.
SGLANG_VERSION = "0.5.23"
# The file of the story's runtime gate (the allreduce fusion) in that release.
ADD_NORM = "srt/layers/layer_boundary/residual/add_norm.py"
# The wheel is only published as cp311 manylinux_2_34 x86_64 (pip index / the file name on PyPI).
_WHEEL_TAGS = ["--python-version", "3.11", "--platform", "manylinux_2_34_x86_64", "--only-binary=:all:"]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tpfuse-tests"


def sglang_source(version: str = SGLANG_VERSION) -> tuple[Path | None, str]:
    """(path of the extracted `sglang` package, '') or (None, why it is unavailable)."""
    dest = cache_dir() / f"sglang-{version}" / "sglang"
    if (dest / "__init__.py").is_file() and (dest.parent / ".complete").is_file():
        return dest, ""
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *_WHEEL_TAGS, f"sglang=={version}",
               "-d", str(wheels)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"pip download sglang=={version} failed: {exc}"
        found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
        if proc.returncode != 0 or not found:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return None, f"PyPI unreachable or sglang=={version} missing: {tail[0]}"
    staging = dest.parent.with_name(dest.parent.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with zipfile.ZipFile(found[0]) as wheel:
        for name in wheel.namelist():
            if name.startswith("sglang/") and name.endswith(".py"):
                wheel.extract(name, staging)
    shutil.rmtree(dest.parent, ignore_errors=True)
    staging.rename(dest.parent)
    (dest.parent / ".complete").write_text(found[0].name + "\n")
    return dest, ""


def runtime_gate(result):
    """The one finding of the story's runtime gate (`flashinfer_ar_fusion_applies` in ADD_NORM) of an audit."""
    hits = [f for f in result.findings if f.path == ADD_NORM and f.scope == "flashinfer_ar_fusion_applies"]
    assert len(hits) == 1, [(f.line, f.condition) for f in result.findings if f.path == ADD_NORM]
    return hits[0]
