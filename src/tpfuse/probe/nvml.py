"""NVML facts: power limit, PCIe link, NVLink links per GPU pair, PCIe topology, driver version.

`read_nvml(gpus)` opens NVML (nvidia-ml-py, `import pynvml`), reads, and shuts it down again.
Every NVML call is guarded: a missing library, a missing function in an older pynvml, a driver
that says "Not Supported" or "Insufficient Permissions" gives None for that fact and one note
naming the call and the error, never an exception. The `nvml` argument takes any object with
pynvml's function names, so tests run the logic against a fake module on CPU.

NVML numbers GPUs in PCI order over all GPUs of the machine; torch numbers CUDA ordinals after
CUDA_VISIBLE_DEVICES. GPUs are therefore matched by UUID, then by PCI address, never by index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpfuse.probe.capabilities import GpuInfo
from tpfuse.probe.gpus import parse_pci_bus_id

# nvmlGpuTopologyLevel_t (nvml.h): the closest common ancestor of two GPUs in the PCIe tree.
TOPOLOGY_LEVELS = {0: "internal", 10: "single", 20: "multiple", 30: "hostbridge", 40: "node", 50: "system"}
# nvmlGpuP2PCapsIndex_t NVML_P2P_CAPS_INDEX_NVLINK and nvmlGpuP2PStatus_t NVML_P2P_STATUS_OK (nvml.h);
# defined here because pynvml 13.x spells some neighbours of these constants as tuples.
P2P_CAPS_INDEX_NVLINK = 2
P2P_STATUS_OK = 0
# nvmlIntNvLinkDeviceType_t (nvml.h) and NVML_FEATURE_ENABLED.
NVLINK_DEVICE_GPU, NVLINK_DEVICE_SWITCH = 0, 2
FEATURE_ENABLED = 1
# NVML_NVLINK_MAX_LINKS was 18 (Hopper: 18 links) before pynvml 13 raised it to 36; links past a
# GPU's real count answer INVALID_ARGUMENT, so reading up to the module's constant is safe; the
# default is for pynvml-like modules that lack the constant.
DEFAULT_MAX_LINKS = 18
MILLIWATTS_PER_WATT = 1000  # nvmlDeviceGetEnforcedPowerLimit answers in mW


@dataclass(frozen=True)
class NvmlGpu:
    power_limit_w: float | None = None
    pcie_generation: int | None = None  # current; idle GPUs may train down to save power
    pcie_width: int | None = None
    pcie_max_generation: int | None = None
    pcie_max_width: int | None = None


@dataclass(frozen=True)
class NvmlPair:
    kind: str  # "nvlink" | "pcie" | "unknown"
    nvlink_count: int | None = None
    nvlink_via: str | None = None  # "direct" | "switch"
    pcie_level: str | None = None


@dataclass
class NvmlReport:
    """What NVML said; `status` is "ok" when NVML was opened, else why not."""

    status: str
    driver: str | None = None
    cuda_driver: int | None = None  # 1000 * major + 10 * minor
    gpus: dict[int, NvmlGpu] = field(default_factory=dict)  # by torch index
    pairs: dict[tuple[int, int], NvmlPair] = field(default_factory=dict)  # by torch indices
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Link:
    remote_pci: tuple[int, int, int] | None
    remote_type: int | None


class _Guarded:
    """Calls NVML functions by name; failures become None plus one note per (call, error)."""

    def __init__(self, nvml) -> None:
        self.nvml = nvml
        self._notes: dict[str, list[str]] = {}

    def call(self, name: str, *args, where: str = ""):
        fn = getattr(self.nvml, name, None)
        if fn is None:
            self._note(f"NVML {name}: not provided by this pynvml (pip install -U nvidia-ml-py)", where)
            return None
        try:
            return fn(*args)
        except Exception as exc:  # NVMLError subclasses: Not Supported, Insufficient Permissions, ...
            self._note(f"NVML {name}: {exc or type(exc).__name__}", where)
            return None

    def quiet(self, name: str, *args):
        """For probing calls whose failure is the answer (no NVLink, link index past the end)."""
        fn = getattr(self.nvml, name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except Exception:
            return None

    def _note(self, message: str, where: str) -> None:
        places = self._notes.setdefault(message, [])
        if where and where not in places:
            places.append(where)

    def notes(self) -> list[str]:
        return [f"{m} ({', '.join(w)})" if w else m for m, w in self._notes.items()]


def _text(value) -> str | None:
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _norm_uuid(uuid: str | None) -> str | None:
    return uuid.lower().removeprefix("gpu-") if uuid else None


def _pci_of(info) -> tuple[int, int, int] | None:
    """(domain, bus, device) of an nvmlPciInfo_t; falls back to parsing its busId string."""
    if info is None:
        return None
    try:
        return int(info.domain), int(info.bus), int(info.device)
    except (AttributeError, TypeError, ValueError):
        return parse_pci_bus_id(getattr(info, "busId", None))


def _match_handles(g: _Guarded, gpus: list[GpuInfo]) -> tuple[dict[int, object], dict[int, tuple], list[str]]:
    """torch index -> NVML handle and PCI address, by UUID then by PCI address."""
    by_uuid, by_pci = {}, {}
    count = g.call("nvmlDeviceGetCount") or 0
    for i in range(count):
        handle = g.call("nvmlDeviceGetHandleByIndex", i, where=f"NVML device {i}")
        if handle is None:
            continue
        pci = _pci_of(g.call("nvmlDeviceGetPciInfo", handle, where=f"NVML device {i}"))
        uuid = _norm_uuid(_text(g.call("nvmlDeviceGetUUID", handle, where=f"NVML device {i}")))
        if uuid:
            by_uuid[uuid] = (handle, pci)
        if pci:
            by_pci[pci] = (handle, pci)
    handles, pcis, notes = {}, {}, []
    for gpu in gpus:
        hit = by_uuid.get(_norm_uuid(gpu.uuid)) or by_pci.get(parse_pci_bus_id(gpu.pci_bus_id))
        if hit is None:
            notes.append(f"GPU {gpu.index}: no NVML device with its UUID or PCI address (MIG instance?); "
                         "NVML facts omitted")
            continue
        handles[gpu.index], pcis[gpu.index] = hit
    return handles, pcis, notes


def _gpu_facts(g: _Guarded, handle, where: str) -> NvmlGpu:
    limit_mw = g.call("nvmlDeviceGetEnforcedPowerLimit", handle, where=where)
    return NvmlGpu(
        power_limit_w=limit_mw / MILLIWATTS_PER_WATT if limit_mw is not None else None,
        pcie_generation=g.call("nvmlDeviceGetCurrPcieLinkGeneration", handle, where=where),
        pcie_width=g.call("nvmlDeviceGetCurrPcieLinkWidth", handle, where=where),
        pcie_max_generation=g.call("nvmlDeviceGetMaxPcieLinkGeneration", handle, where=where),
        pcie_max_width=g.call("nvmlDeviceGetMaxPcieLinkWidth", handle, where=where),
    )


def _active_links(g: _Guarded, handle) -> list[_Link]:
    """The GPU's active NVLink links; empty for GPUs without NVLink (their calls fail quietly).

    Every link index is asked (a few dozen cheap calls): a failing index means NOT_SUPPORTED (no
    NVLink) or INVALID_ARGUMENT (past this GPU's last link), and stopping at the first failure
    could miss active links after a disabled one."""
    links = []
    for link in range(int(getattr(g.nvml, "NVML_NVLINK_MAX_LINKS", DEFAULT_MAX_LINKS))):
        if g.quiet("nvmlDeviceGetNvLinkState", handle, link) != FEATURE_ENABLED:
            continue
        remote = _pci_of(g.quiet("nvmlDeviceGetNvLinkRemotePciInfo", handle, link))
        links.append(_Link(remote, g.quiet("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)))
    return links


def _switch_links(links: list[_Link], gpu_pcis: set) -> int:
    """Links that end at an NVSwitch (by remote type, or, on drivers without that call, at no known GPU)."""
    return sum(
        1 for link in links
        if link.remote_type == NVLINK_DEVICE_SWITCH or (link.remote_type is None and link.remote_pci not in gpu_pcis)
    )


def _pair_facts(g: _Guarded, a: int, b: int, handles, pcis, links) -> NvmlPair:
    level_code = g.call("nvmlDeviceGetTopologyCommonAncestor", handles[a], handles[b], where=f"GPUs {a},{b}")
    level = TOPOLOGY_LEVELS.get(level_code) if level_code is not None else None
    direct = sum(1 for link in links[a] if link.remote_pci is not None and link.remote_pci == pcis[b])
    if direct:
        return NvmlPair("nvlink", direct, "direct", level)
    gpu_pcis = set(pcis.values())
    via_a, via_b = _switch_links(links[a], gpu_pcis), _switch_links(links[b], gpu_pcis)
    status = g.quiet("nvmlDeviceGetP2PStatus", handles[a], handles[b], P2P_CAPS_INDEX_NVLINK)
    if status == P2P_STATUS_OK or (status is None and via_a and via_b):
        # Through an NVSwitch a pair's bandwidth is bounded by the side with fewer links.
        count = min(via_a, via_b) if via_a and via_b else None
        return NvmlPair("nvlink", count, "switch" if count else None, level)
    return NvmlPair("pcie" if level is not None else "unknown", None, None, level)


def read_nvml(gpus: list[GpuInfo], *, nvml=None) -> NvmlReport:
    """NVML facts for `gpus` (torch's view); never raises."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            return NvmlReport(f"NVML unavailable: pynvml is not importable ({exc}); pip install nvidia-ml-py")
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded on machines without a driver
        return NvmlReport(f"NVML unavailable: nvmlInit failed: {exc or type(exc).__name__}")
    g = _Guarded(nvml)
    try:
        report = NvmlReport("ok")
        report.driver = _text(g.call("nvmlSystemGetDriverVersion"))
        report.cuda_driver = g.call("nvmlSystemGetCudaDriverVersion")
        handles, pcis, report.notes = _match_handles(g, gpus)
        for index, handle in handles.items():
            report.gpus[index] = _gpu_facts(g, handle, f"GPU {index}")
        links = {index: _active_links(g, handle) for index, handle in handles.items()}
        for a in handles:
            for b in handles:
                if a != b:
                    report.pairs[(a, b)] = _pair_facts(g, a, b, handles, pcis, links)
        report.notes.extend(g.notes())
        return report
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass  # shutting down can only fail if init did not count; nothing to release then
