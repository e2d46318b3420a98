"""The engines the integration tests run, installed outside the repository and outside site-packages.

Cache: `$XDG_CACHE_HOME/tpfuse-tests/engines/<engine>/` (default `~/.cache/tpfuse-tests`),
filled once with `pip install --no-deps --target` from `requirements-<engine>.txt` (exact pins:
the engine and the few pure-Python modules its layers import on CPU). --no-deps keeps pip from
ever installing a torch (both engines pin a newer, CUDA one); the engine code runs in a child
interpreter with that directory on PYTHONPATH, so this test process and the installed torch are
untouched. Tests skip with pip's error when the registry is unreachable.

    python tests/integrations/engine_env.py sglang sglang-legacy vllm     # fill the cache ahead

Also here: `run_child`, which runs one of the child programs (`*_ranks.py`) and returns what it
pickled; a `tpfuse` distribution stub whose entry points are read from pyproject.toml, put first
on the child's path, so the engines discover this checkout's entry points however tpfuse itself
was installed; the torchvision stand-in sglang needs (see `TORCHVISION_SHIM`); and the stand-ins
sglang 0.5.10 needs besides (`install_legacy_stand_ins`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import tomllib

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ENGINES = ("sglang", "sglang-legacy", "vllm")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tpfuse-tests" / "engines"


def requirements(engine: str) -> Path:
    return HERE / f"requirements-{engine}.txt"


def engine_dir(engine: str) -> tuple[Path | None, str]:
    """(directory to put on PYTHONPATH, '') or (None, why the engine is unavailable)."""
    req = requirements(engine)
    pins = req.read_text()
    dest = cache_dir() / engine
    marker = dest / ".complete"
    if marker.is_file() and marker.read_text() == pins:
        return dest, ""
    staging = dest.with_name(engine + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    wheels = cache_dir().parent / "wheels"  # tests/audit/sglang_source.py caches the sglang wheel there
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
           "--target", str(staging), "--find-links", str(wheels), "-r", str(req)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"pip install of {req.name} failed: {exc}"
    if proc.returncode != 0:
        lines = [l for l in (proc.stderr or proc.stdout).splitlines() if l.startswith("ERROR")] or ["no output"]
        return None, f"PyPI unreachable or a pin in {req.name} missing: {lines[-1]}"
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    marker.write_text(pins)
    return dest, ""


def distribution_stub(where: Path) -> Path:
    """A `tpfuse` dist-info under `where` with pyproject.toml's entry points; returns `where`."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    info = where / "tpfuse-0+checkout.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tpfuse\nVersion: 0+checkout\n")
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return where


def child_env(engine_path: Path, stub_path: Path, **extra: str) -> dict[str, str]:
    """Environment of a child interpreter that runs engine code: stub, checkout, engine on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(stub_path), str(REPO / "src"), str(HERE), str(engine_path)])
    env.update(extra)
    return env


def run_child(engine: str, program: str, tmp: Path, scenario: str, cache: Path, **extra: str):
    """Run the child program `program` (a file beside this one: `python PROGRAM OUT.pkl SCENARIO`)
    with `engine` on its path and TPFUSE_CACHE_DIR=`cache`, and return what it pickled; the test
    skips, naming why, when the engine cannot be installed."""
    import pickle

    import pytest

    path, why = engine_dir(engine)
    if path is None:
        pytest.skip(f"{engine} ({requirements(engine).name}) not available: {why}")
    stub = distribution_stub(tmp / "stub")
    out = tmp / f"{scenario}-{len(list(tmp.iterdir()))}.pkl"
    proc = subprocess.run([sys.executable, str(HERE / program), str(out), scenario],
                          env=child_env(path, stub, TPFUSE_CACHE_DIR=str(cache), **extra),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out, "rb") as f:
        return pickle.load(f)


# sglang 0.5.23's model configs import torchvision at module level (InternVL, DeepSeek-OCR image
# constants). PyPI's torchvision wheels are CUDA builds whose extension cannot load against the
# CPU torch, and the CPU builds live on another index. The stand-in provides the one name those
# imports bind (InterpolationMode); transformers is asked first (its answer is cached), so it
# still sees no torchvision and takes no torchvision path. Nothing on the allreduce path uses it.
TORCHVISION_SHIM = '''
import enum, sys, types
import transformers.utils.import_utils as _iu
assert not _iu.is_torchvision_available()
class InterpolationMode(enum.Enum):
    NEAREST = "nearest"; BILINEAR = "bilinear"; BICUBIC = "bicubic"
_tv, _tr, _fn = (types.ModuleType(n)
                 for n in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"))
_tr.InterpolationMode = _fn.InterpolationMode = InterpolationMode
_tv.transforms, _tr.functional = _tr, _fn
sys.modules.update({"torchvision": _tv, "torchvision.transforms": _tr, "torchvision.transforms.functional": _fn})
'''


def install_torchvision_shim() -> None:
    if "torchvision" not in sys.modules:
        exec(TORCHVISION_SHIM, {})


class _StandIn(types.ModuleType):
    """A module whose every public attribute is a function that raises when called: it satisfies
    `from m import name` at import time and fails loudly if anything ever calls it."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def absent(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} is a test stand-in; nothing on the allreduce path calls it")

        absent.__name__ = name
        return absent


def install_legacy_stand_ins() -> None:
    """What sglang 0.5.10's modules import at module level beyond the torchvision shim, none of it
    on the allreduce path: `torchvision.io.decode_jpeg` (sglang.srt.utils.common) and `sgl_kernel`,
    its CUDA kernel package (`sgl_kernel.kvcacheio`, imported by the host KV cache that the CUDA-graph
    runner's module pulls in), whose wheels need a GPU build of torch."""
    install_torchvision_shim()
    vision = sys.modules["torchvision"]
    if not hasattr(vision, "io"):
        vision.__path__ = []  # a package, so that `torchvision.io` resolves
        vision.io = sys.modules["torchvision.io"] = _StandIn("torchvision.io")
    if "sgl_kernel" not in sys.modules:
        kernel = sys.modules["sgl_kernel"] = _StandIn("sgl_kernel")
        kernel.__path__ = []
        kernel.kvcacheio = sys.modules["sgl_kernel.kvcacheio"] = _StandIn("sgl_kernel.kvcacheio")


if __name__ == "__main__":
    status = 0
    for name in sys.argv[1:] or ENGINES:
        path, why = engine_dir(name)
        print(f"{name}: {path or why}")
        status |= path is None
    sys.exit(status)
