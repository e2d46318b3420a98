"""Capabilities: what the machine can do, as frozen plain data (no torch, no NVML at import).

Every field is read or measured, never assumed from a compute-capability number; a field the
probe could not read is None (and `Capabilities.notes` says why). `to_dict()` is the JSON form
that `tpfuse doctor --json` prints and the dispatch table fingerprints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str | None
    compute_capability: tuple[int, int]
    sm_count: int
    shared_memory_per_block_optin: int | None  # bytes a block may opt in to
    l2_cache_bytes: int | None
    memory_bytes: int
    power_limit_w: float | None  # enforced limit, from NVML
    pcie_generation: int | None  # current link generation, from NVML
    pcie_width: int | None  # current link width (lanes), from NVML
    pci_bus_id: str | None
    # Fields below were added after the first release of this class; they default to "not read".
    pcie_max_generation: int | None = None  # highest generation the link supports, from NVML
    pcie_max_width: int | None = None  # widest the link supports (lanes), from NVML


@dataclass(frozen=True)
class LinkInfo:
    """Facts about one ordered GPU pair (a -> b): can a map b's memory, and over what."""

    a: int
    b: int
    peer_access: bool
    kind: str  # "same_device" | "nvlink" | "pcie" | "unknown"
    nvlink_count: int | None = None  # active NVLink links between the two, from NVML
    pcie_level: str | None = None  # common ancestor: "internal", "single", "multiple", "hostbridge", "node", "system"
    native_atomics: bool | None = None  # cudaDevP2PAttrNativeAtomicSupported
    nvlink_via: str | None = None  # "direct" (GPU to GPU links) or "switch" (NVSwitch fabric)


@dataclass(frozen=True)
class Versions:
    python: str
    tpfuse: str
    torch: str | None = None
    cuda_runtime: str | None = None
    driver: str | None = None
    nccl: str | None = None
    triton: str | None = None
    cuda_driver: str | None = None  # newest CUDA version the driver supports, e.g. "13.0"


@dataclass(frozen=True)
class PackageStatus:
    """An optional package a strategy may use; `reason` says why it is not available."""

    name: str
    available: bool
    version: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class CpuInfo:
    model: str
    num_cores: int  # logical CPUs in the machine
    memory_bytes: int | None
    arch: str = ""  # platform.machine(): "x86_64", "aarch64"
    num_usable_cores: int | None = None  # logical CPUs this process may run on (affinity)


@dataclass(frozen=True)
class PeerMeasurement:
    """Measured peer traffic for one ordered GPU pair (a reads or writes b's memory)."""

    a: int
    b: int
    read_gbps: float
    write_gbps: float
    latency_us: float


@dataclass(frozen=True)
class FabricMeasurements:
    """Measured by `tpfuse doctor --measure`; None in a plain probe."""

    pairs: tuple[PeerMeasurement, ...]
    all_to_all_score: float  # aggregate bandwidth all-at-once over one-peer-at-a-time
    prefers: str  # "push" | "pull"
    method: str = ""


@dataclass(frozen=True)
class Capabilities:
    gpus: tuple[GpuInfo, ...]
    links: tuple[LinkInfo, ...]
    versions: Versions
    packages: tuple[PackageStatus, ...]  # optional packages (tpfuse.probe.optional)
    cpu: CpuInfo
    nvml: str  # "ok" or why NVML facts are missing
    notes: tuple[str, ...] = ()
    fabric: FabricMeasurements | None = None

    @property
    def has_gpu(self) -> bool:
        return len(self.gpus) > 0

    def link(self, a: int, b: int) -> LinkInfo | None:
        for link in self.links:
            if link.a == a and link.b == b:
                return link
        return None

    def package(self, name: str) -> PackageStatus | None:
        for package in self.packages:
            if package.name == name:
                return package
        return None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
