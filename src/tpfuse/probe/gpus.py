"""Per-GPU facts torch can read: name, UUID, compute capability, SMs, shared memory, L2, memory.

Indices are CUDA runtime ordinals as torch sees them (after CUDA_VISIBLE_DEVICES). NVML facts
(power limit, PCIe link) are merged in later by tpfuse.probe.nvml, matched by UUID or PCI
address, because NVML numbers GPUs differently. Reading properties initializes the CUDA runtime
in this process (no kernels run, no memory is allocated).
"""

from __future__ import annotations

from tpfuse.probe.capabilities import GpuInfo


def no_gpu_reason(torch) -> str | None:
    """Why torch sees no CUDA GPU (None when it sees at least one)."""
    if torch is None:
        return "no GPU: torch is not importable"
    if torch.version.cuda is None:
        return f"no GPU: torch {torch.__version__} is built without CUDA (install a CUDA build of torch to use GPUs)"
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:  # a broken driver install raises from cudaGetDeviceCount
        return f"no GPU: CUDA initialization failed: {type(exc).__name__}: {exc}"
    if count == 0:
        return "no GPU: torch sees no CUDA device (driver not loaded, or CUDA_VISIBLE_DEVICES hides them)"
    return None


def pci_bus_id(domain: int | None, bus: int | None, device: int | None) -> str | None:
    """Linux-style PCI address "0000:19:00.0" (function 0: CUDA devices are function 0)."""
    if domain is None or bus is None or device is None:
        return None
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def parse_pci_bus_id(text: str | bytes | None) -> tuple[int, int, int] | None:
    """(domain, bus, device) of "0000:19:00.0" or NVML's "00000000:19:00.0"; None if unparsable."""
    if text is None:
        return None
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    try:
        domain, bus, rest = text.strip().split(":")
        return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
    except ValueError:
        return None


def _uuid(props) -> str | None:
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else None


def read_gpu(torch, index: int) -> GpuInfo:
    props = torch.cuda.get_device_properties(index)
    return GpuInfo(
        index=index,
        name=props.name,
        uuid=_uuid(props),
        compute_capability=(int(props.major), int(props.minor)),
        sm_count=int(props.multi_processor_count),
        shared_memory_per_block_optin=getattr(props, "shared_memory_per_block_optin", None),
        l2_cache_bytes=getattr(props, "L2_cache_size", None),
        memory_bytes=int(props.total_memory),
        power_limit_w=None,
        pcie_generation=None,
        pcie_width=None,
        pci_bus_id=pci_bus_id(
            getattr(props, "pci_domain_id", None), getattr(props, "pci_bus_id", None),
            getattr(props, "pci_device_id", None),
        ),
    )


def read_gpus(torch) -> tuple[list[GpuInfo], list[str]]:
    """(GPUs torch sees, notes); an empty list with the reason when there are none."""
    reason = no_gpu_reason(torch)
    if reason is not None:
        return [], [reason]
    gpus, notes = [], []
    for index in range(torch.cuda.device_count()):
        try:
            gpus.append(read_gpu(torch, index))
        except Exception as exc:  # one unreadable GPU must not hide the others
            notes.append(f"GPU {index}: device properties unreadable: {type(exc).__name__}: {exc}")
    return gpus, notes
