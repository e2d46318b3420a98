"""Software versions: Python, tpfuse, torch, CUDA runtime, NVIDIA driver, NCCL, Triton.

The driver version comes from NVML when it answers (the caller passes it in), else from the
kernel module's /proc file, so it is known on machines without NVML too. Nothing here imports
torch itself: the caller passes the module (or None when torch is not importable).
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
from pathlib import Path

from tpfuse._version import __version__
from tpfuse.probe.capabilities import Versions

# The NVIDIA kernel module's version file; its first line reads like
# "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Feb 26 ..." (open and proprietary modules alike).
DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"
_DRIVER_RE = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)")


def driver_from_proc(path: str | Path = DRIVER_VERSION_FILE) -> str | None:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    match = _DRIVER_RE.search(text)
    return match.group(1) if match else None


def cuda_version_string(encoded: int | None) -> str | None:
    """CUDA's integer version (1000 * major + 10 * minor, e.g. 13000) as "13.0"."""
    if not encoded:
        return None
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


def nccl_version(torch) -> str | None:
    """torch's NCCL version as "2.27.5"; None for builds without NCCL (CPU wheels)."""
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # CPU builds lack torch._C._nccl_version (AttributeError); others raise RuntimeError
        return None
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    if isinstance(version, int):  # torch < 1.x encoded it as major * 1000 + minor * 100 + patch
        return f"{version // 1000}.{(version % 1000) // 100}.{version % 100}"
    return str(version)


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def read_versions(torch, *, driver: str | None = None, cuda_driver: str | None = None) -> Versions:
    """Versions of this environment; `torch` is the module or None, `driver` the NVML answer."""
    return Versions(
        python=platform.python_version(),
        tpfuse=__version__,
        torch=str(torch.__version__) if torch is not None else None,
        cuda_runtime=(torch.version.cuda or None) if torch is not None else None,
        driver=driver or driver_from_proc(),
        nccl=nccl_version(torch) if torch is not None else None,
        triton=_distribution_version("triton", "pytorch-triton"),
        cuda_driver=cuda_driver,
    )
