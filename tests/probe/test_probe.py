"""probe() on a faked two-GPU machine (fake torch + fake pynvml): torch facts, NVML facts and link
facts end up merged per GPU and per pair; libcudart discovery reads /proc/self/maps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import tpfuse.probe
import tpfuse.probe.links as links_module
from support.fake_nvml import FakeNvml
from tpfuse.probe import probe
from tpfuse.probe.links import _loaded_libraries


def props(uuid_head, bus):
    return SimpleNamespace(
        name="NVIDIA H200", uuid=f"{uuid_head}0000-0000-0000-0000-000000000000", major=9, minor=0,
        multi_processor_count=132, shared_memory_per_block_optin=232448, L2_cache_size=52428800,
        total_memory=150_000_000_000, pci_domain_id=0, pci_bus_id=bus, pci_device_id=0,
    )


@pytest.fixture
def two_gpu_torch(monkeypatch):
    # torch 0 and 1 are NVML devices 0 and 1 of the fake: NVLink-bridged with 4 links, PCIe "single".
    devices = [props("aaaa", 0x19), props("bbbb", 0x3B)]
    cuda = SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 2, get_device_properties=lambda i: devices[i],
        can_device_access_peer=lambda a, b: True, nccl=SimpleNamespace(version=lambda: (2, 27, 5)),
    )
    torch = SimpleNamespace(__version__="2.11.0+cu130", version=SimpleNamespace(cuda="13.0"), cuda=cuda, __file__="/nonexistent/torch/__init__.py")
    monkeypatch.setattr(tpfuse.probe, "_import_torch", lambda: torch)
    return torch


def test_probe_merges_torch_nvml_and_link_facts(two_gpu_torch, monkeypatch):
    monkeypatch.setattr(links_module, "native_atomics_reader", lambda torch: (lambda a, b: 1, "fake"))
    caps = probe(nvml=FakeNvml())
    assert caps.nvml == "ok" and [g.index for g in caps.gpus] == [0, 1]
    g0, g1 = caps.gpus
    assert (g0.name, g0.sm_count, g0.power_limit_w, g0.pcie_generation, g0.pcie_width) == ("NVIDIA H200", 132, 700.0, 5, 16)
    assert (g1.power_limit_w, g1.pcie_generation, g1.pcie_width, g1.pci_bus_id) == (600.5, 4, 8, "0000:3b:00.0")
    link = caps.link(0, 1)
    assert (link.kind, link.nvlink_count, link.nvlink_via, link.pcie_level, link.peer_access, link.native_atomics) == (
        "nvlink", 4, "direct", "single", True, True)
    assert caps.link(1, 1).kind == "same_device" and len(caps.links) == 4
    v = caps.versions
    assert (v.torch, v.cuda_runtime, v.nccl, v.driver, v.cuda_driver) == ("2.11.0+cu130", "13.0", "2.27.5", "580.95.05", "13.0")
    assert caps.notes == ()


def test_probe_without_nvml_or_atomics_keeps_torch_facts_and_says_why(two_gpu_torch, monkeypatch):
    monkeypatch.setattr(links_module, "native_atomics_reader", lambda torch: (None, "no loadable libcudart"))
    caps = probe(nvml=FakeNvml(fail_init="Driver Not Loaded"))
    assert caps.nvml == "NVML unavailable: nvmlInit failed: Driver Not Loaded"
    assert caps.gpus[0].sm_count == 132 and caps.gpus[0].power_limit_w is None
    link = caps.link(0, 1)
    assert (link.kind, link.peer_access, link.native_atomics) == ("unknown", True, None)
    assert "NVML unavailable: nvmlInit failed: Driver Not Loaded: power limits, PCIe links and link kinds are unknown" in caps.notes
    assert "native peer atomics unknown: no loadable libcudart" in caps.notes


def test_loaded_libraries_are_read_from_the_process_map(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcudart.so.13\n"
        "7f0000001000-7f0000002000 r--p 00001000 08:01 1 /venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcudart.so.13\n"
        "7f0000003000-7f0000004000 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    )
    assert _loaded_libraries("libcudart.so", maps=str(maps)) == ["/venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcudart.so.13"]
    assert _loaded_libraries("libcudart.so", maps=str(tmp_path / "missing")) == []
