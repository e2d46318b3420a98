"""The host CPU: model name, logical cores, usable cores and memory, from /proc (Linux).

Pure reads of text files; the paths are parameters so that tests can point them at fixtures.
Anything that cannot be read falls back to `platform` facts or None, never raises.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from tpfuse.probe.capabilities import CpuInfo

# /proc/cpuinfo keys that name the CPU model, by platform: x86 ("model name"), some ARM and
# POWER kernels ("Model", "Hardware", "cpu"); aarch64 servers often report none of them.
_MODEL_KEYS = ("model name", "Model", "Hardware", "cpu model", "cpu")


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def cpu_model(cpuinfo: str) -> str | None:
    """The first model line of /proc/cpuinfo text, or None."""
    found: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if sep and value and key in _MODEL_KEYS and key not in found:
            found[key] = value
    for key in _MODEL_KEYS:
        if key in found:
            return found[key]
    return None


def mem_total_bytes(meminfo: str) -> int | None:
    """MemTotal of /proc/meminfo text in bytes (the kernel's "kB" there means KiB)."""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return int(fields[1]) * 1024
    return None


def read_cpu(*, cpuinfo_path: str | Path = "/proc/cpuinfo", meminfo_path: str | Path = "/proc/meminfo") -> CpuInfo:
    """CpuInfo of this host."""
    arch = platform.machine()
    model = cpu_model(_read(cpuinfo_path)) or platform.processor() or f"{arch or 'unknown'} CPU (model not reported)"
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        usable = None
    return CpuInfo(
        model=model,
        num_cores=os.cpu_count() or 1,
        memory_bytes=mem_total_bytes(_read(meminfo_path)),
        arch=arch,
        num_usable_cores=usable,
    )
