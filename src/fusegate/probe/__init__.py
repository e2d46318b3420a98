"""The capability probe: `probe()` reads what this machine can do (never at import)."""

from __future__ import annotations

import os
import platform
import sys

from fusegate._version import __version__
from fusegate.probe.capabilities import Capabilities, CpuInfo, GpuInfo, LinkInfo, OptionalBackend, Versions

__all__ = ["probe", "Capabilities"]


def probe() -> Capabilities:
    """Minimal probe (torch facts only); NVML facts are added by fusegate.probe.nvml."""
    import torch

    gpus, links = [], []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(GpuInfo(i, p.name, str(getattr(p, "uuid", "")) or None, (p.major, p.minor),
                                p.multi_processor_count, None, getattr(p, "L2_cache_size", None),
                                p.total_memory, None, None, None, None))
        for a in range(len(gpus)):
            for b in range(len(gpus)):
                if a == b:
                    links.append(LinkInfo(a, b, True, "same_device"))
                else:
                    links.append(LinkInfo(a, b, torch.cuda.can_device_access_peer(a, b), "unknown"))
    versions = Versions(python=platform.python_version(), fusegate=__version__, torch=torch.__version__,
                        cuda_runtime=torch.version.cuda)
    cpu = CpuInfo(platform.processor() or platform.machine(), os.cpu_count() or 1, None)
    return Capabilities(tuple(gpus), tuple(links), versions, (), cpu, nvml="not read")
