"""Capabilities as rich tables for people (`tpfuse doctor`); JSON comes from to_dict().

Pure formatting: every function takes plain probe facts and returns a rich renderable. Sizes
use binary units (KiB, MiB, GiB) because that is how the hardware sizes them.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from tpfuse.probe.capabilities import Capabilities, FabricMeasurements, LinkInfo

UNKNOWN = "?"


def add_row(table: Table, *cells) -> None:
    """Adds cells as plain text: probe strings (reasons, names) may contain "[...]", which rich
    would otherwise read as markup and drop."""
    table.add_row(*(cell if isinstance(cell, Text) else Text(str(cell)) for cell in cells))


def _size(n: int | None, unit: str) -> str:
    if n is None:
        return UNKNOWN
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    value = n / scale
    return f"{value:.0f} {unit}" if value >= 100 or value == int(value) else f"{value:.1f} {unit}"


def _yes_no(value: bool | None) -> str:
    return UNKNOWN if value is None else ("yes" if value else "no")


def cpu_table(caps: Capabilities) -> Table:
    cpu = caps.cpu
    table = Table(title="Machine", show_header=False)
    table.add_column("fact", style="bold")
    table.add_column("value")
    cores = f"{cpu.num_cores} logical" + (f" ({cpu.num_usable_cores} usable by this process)"
                                          if cpu.num_usable_cores not in (None, cpu.num_cores) else "")
    add_row(table, "CPU", f"{cpu.model} ({cpu.arch})" if cpu.arch else cpu.model)
    add_row(table, "cores", cores)
    add_row(table, "memory", _size(cpu.memory_bytes, "GiB"))
    add_row(table, "GPUs", str(len(caps.gpus)) if caps.gpus else "none")
    add_row(table, "NVML", caps.nvml)
    return table


def gpu_table(caps: Capabilities) -> Table:
    table = Table(title="GPUs")
    for column in ("#", "name", "compute capability", "SMs", "shared mem/block (opt-in)", "L2", "memory",
                   "power limit", "PCIe now (max)", "PCI address"):
        table.add_column(column)
    for g in caps.gpus:
        pcie = UNKNOWN
        if g.pcie_generation is not None or g.pcie_max_generation is not None:
            pcie = f"gen{g.pcie_generation or UNKNOWN} x{g.pcie_width or UNKNOWN}"
            if g.pcie_max_generation is not None:
                pcie += f" (gen{g.pcie_max_generation} x{g.pcie_max_width or UNKNOWN})"
        add_row(
            table,
            str(g.index), g.name, f"{g.compute_capability[0]}.{g.compute_capability[1]}", str(g.sm_count),
            _size(g.shared_memory_per_block_optin, "KiB"), _size(g.l2_cache_bytes, "MiB"), _size(g.memory_bytes, "GiB"),
            f"{g.power_limit_w:.0f} W" if g.power_limit_w is not None else UNKNOWN, pcie, g.pci_bus_id or UNKNOWN,
        )
    return table


def link_text(link: LinkInfo) -> str:
    """"NVLink x18 (switch)", "PCIe (node)", "same device", "unknown"."""
    if link.kind == "same_device":
        return "same device"
    if link.kind == "nvlink":
        count = f" x{link.nvlink_count}" if link.nvlink_count is not None else ""
        return f"NVLink{count}" + (f" ({link.nvlink_via})" if link.nvlink_via else "")
    if link.kind == "pcie":
        return f"PCIe ({link.pcie_level or 'level unknown'})"
    return link.kind


def pair_table(caps: Capabilities) -> Table:
    """Ordered GPU pairs a -> b (facts may differ by direction); same-device rows only for one GPU."""
    table = Table(title="GPU pairs (a -> b)")
    for column in ("a -> b", "link", "PCIe common ancestor", "peer access", "native atomics"):
        table.add_column(column)
    pairs = [l for l in caps.links if l.a != l.b] or list(caps.links)
    for link in pairs:
        add_row(table, f"{link.a} -> {link.b}", link_text(link),
                link.pcie_level or ("-" if link.a == link.b else UNKNOWN),
                _yes_no(link.peer_access), _yes_no(link.native_atomics))
    return table


def versions_table(caps: Capabilities) -> Table:
    v = caps.versions
    table = Table(title="Versions", show_header=False)
    table.add_column("software", style="bold")
    table.add_column("version")
    rows = [("python", v.python), ("tpfuse", v.tpfuse), ("torch", v.torch),
            ("CUDA runtime (torch)", v.cuda_runtime), ("NVIDIA driver", v.driver), ("CUDA (driver)", v.cuda_driver),
            ("NCCL (torch)", v.nccl), ("Triton", v.triton)]
    for name, value in rows:
        add_row(table, name, value or "not present")
    return table


def packages_table(caps: Capabilities) -> Table:
    table = Table(title="Optional packages")
    for column in ("package", "available", "version", "reason"):
        table.add_column(column)
    for b in caps.packages:
        add_row(table, b.name, _yes_no(b.available), b.version or "-", b.reason or "-")
    return table


def fabric_table(fabric: FabricMeasurements) -> Table:
    table = Table(title=f"Measured peer traffic ({fabric.method or 'tpfuse.probe.fabric'})")
    for column in ("a -> b", "read GB/s", "write GB/s", "latency us"):
        table.add_column(column)
    for p in fabric.pairs:
        add_row(table, f"{p.a} -> {p.b}", f"{p.read_gbps:.1f}", f"{p.write_gbps:.1f}", f"{p.latency_us:.2f}")
    table.caption = (f"all-to-all score {fabric.all_to_all_score:.2f} (all pairs at once / one at a time); "
                     f"prefers {fabric.prefers}")
    return table


def capability_tables(caps: Capabilities) -> list[Table]:
    """Machine, GPUs and pairs (when there are GPUs), versions, optional packages."""
    tables = [cpu_table(caps)]
    if caps.gpus:
        tables += [gpu_table(caps), pair_table(caps)]
    tables += [versions_table(caps), packages_table(caps)]
    if caps.fabric is not None:
        tables.append(fabric_table(caps.fabric))
    return tables
