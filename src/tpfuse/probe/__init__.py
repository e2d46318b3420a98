"""The capability probe: `probe()` reads what this machine can do, when asked (never at import).

Each source of facts is its own module (docs/ARCHITECTURE.md lists them). Every source may be
missing (no GPU, no NVML, no permission, no torch); the probe then leaves those facts None, says why
in `Capabilities.notes`, and never raises. Probing initializes the CUDA runtime in the calling
process (no context work beyond what torch.cuda.get_device_properties and peer queries do), so call
it after choosing the device.
"""

from __future__ import annotations

import dataclasses

from tpfuse.probe.capabilities import Capabilities

__all__ = ["probe", "Capabilities"]


def _import_torch():
    try:
        import torch
    except ImportError:  # the probe still describes the CPU and the optional packages
        return None
    return torch


def probe(*, nvml=None) -> Capabilities:
    """Capabilities of this machine. `nvml`: a pynvml-like module to use instead of pynvml (tests)."""
    from tpfuse.probe.cpu import read_cpu
    from tpfuse.probe.gpus import read_gpus
    from tpfuse.probe.links import native_atomics_reader, read_links
    from tpfuse.probe.nvml import read_nvml
    from tpfuse.probe.optional import read_packages
    from tpfuse.probe.versions import cuda_version_string, read_versions

    torch = _import_torch()
    notes: list[str] = [] if torch is not None else ["torch is not importable: no GPU facts (pip install torch)"]
    gpus, gpu_notes = read_gpus(torch)
    notes += gpu_notes
    report = read_nvml(gpus, nvml=nvml)
    notes += report.notes
    if report.status != "ok" and gpus:
        notes.append(f"{report.status}: power limits, PCIe links and link kinds are unknown")
    gpus = [
        dataclasses.replace(gpu, **dataclasses.asdict(report.gpus[gpu.index])) if gpu.index in report.gpus else gpu
        for gpu in gpus
    ]
    atomics, atomics_source = (None, "")
    if len(gpus) > 1:
        atomics, atomics_source = native_atomics_reader(torch)
    links, link_notes = read_links(
        torch, gpus, report.pairs, atomics=atomics, atomics_unavailable="" if atomics else atomics_source
    )
    notes += link_notes
    versions = read_versions(torch, driver=report.driver, cuda_driver=cuda_version_string(report.cuda_driver))
    return Capabilities(
        gpus=tuple(gpus),
        links=tuple(links),
        versions=versions,
        packages=read_packages(),
        cpu=read_cpu(),
        nvml=report.status,
        notes=tuple(notes),
    )
