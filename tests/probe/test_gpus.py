"""The probe's GPU source (`tpfuse.probe.gpus`) on a fake torch: device properties, PCI bus ids, and
why there is no GPU."""

from __future__ import annotations

from types import SimpleNamespace

from support.fake_torch import fake_torch
from tpfuse.probe.gpus import no_gpu_reason, parse_pci_bus_id, read_gpus


def test_pci_bus_id_parsing():
    assert parse_pci_bus_id("0000:19:00.0") == (0, 0x19, 0)
    assert parse_pci_bus_id(b"00000001:3B:1F.0") == (1, 0x3B, 0x1F)
    assert parse_pci_bus_id("nonsense") is None and parse_pci_bus_id(None) is None


def h200_props(bus):
    return SimpleNamespace(
        name="NVIDIA H200", uuid=f"{bus:08x}-1111-2222-3333-444444444444", major=9, minor=0, multi_processor_count=132,
        shared_memory_per_block_optin=232448, L2_cache_size=52428800, total_memory=150_000_000_000,
        pci_domain_id=0, pci_bus_id=bus, pci_device_id=0,
    )


def test_read_gpus_from_torch_properties():
    gpus, notes = read_gpus(fake_torch([h200_props(0x19), h200_props(0x3B)]))
    assert notes == []
    g = gpus[1]
    assert (g.index, g.name, g.compute_capability, g.sm_count) == (1, "NVIDIA H200", (9, 0), 132)
    assert (g.shared_memory_per_block_optin, g.l2_cache_bytes, g.memory_bytes) == (232448, 52428800, 150_000_000_000)
    assert g.pci_bus_id == "0000:3b:00.0" and g.uuid == "0000003b-1111-2222-3333-444444444444"
    assert g.power_limit_w is None  # NVML's, merged later


def test_no_gpu_reasons():
    assert "built without CUDA" in no_gpu_reason(fake_torch(cuda=None))
    assert "torch sees no CUDA device" in no_gpu_reason(fake_torch(cuda="13.0"))
    assert no_gpu_reason(None) == "no GPU: torch is not importable"
