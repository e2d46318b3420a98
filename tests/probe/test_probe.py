"""probe() on a faked two-GPU machine (fake torch + fake pynvml): torch facts, NVML facts and link
facts end up merged per GPU and per pair. On a machine without a GPU (CI): it says so, describes
the CPU, fills the versions, lists the optional packages with reasons; and nothing is probed at
import."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import tpfuse.probe
import tpfuse.probe.links as links_module
from support.fake_nvml import FakeNvml
from tpfuse import __version__
from tpfuse.probe import probe


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
    torch = SimpleNamespace(__version__="2.11.0+cu130", version=SimpleNamespace(cuda="13.0"), cuda=cuda,
                            __file__="/nonexistent/torch/__init__.py")
    monkeypatch.setattr(tpfuse.probe, "_import_torch", lambda: torch)
    return torch


def test_probe_merges_torch_nvml_and_link_facts(two_gpu_torch, monkeypatch):
    monkeypatch.setattr(links_module, "native_atomics_reader", lambda torch: (lambda a, b: 1, "fake"))
    caps = probe(nvml=FakeNvml())
    assert caps.nvml == "ok" and [g.index for g in caps.gpus] == [0, 1]
    g0, g1 = caps.gpus
    assert (g0.name, g0.sm_count, g0.power_limit_w, g0.pcie_generation, g0.pcie_width) == (
        "NVIDIA H200", 132, 700.0, 5, 16)
    assert (g1.power_limit_w, g1.pcie_generation, g1.pcie_width, g1.pci_bus_id) == (600.5, 4, 8, "0000:3b:00.0")
    link = caps.link(0, 1)
    assert (link.kind, link.nvlink_count, link.nvlink_via, link.pcie_level, link.peer_access, link.native_atomics) == (
        "nvlink", 4, "direct", "single", True, True)
    assert caps.link(1, 1).kind == "same_device" and len(caps.links) == 4
    v = caps.versions
    assert (v.torch, v.cuda_runtime, v.nccl, v.driver, v.cuda_driver) == (
        "2.11.0+cu130", "13.0", "2.27.5", "580.95.05", "13.0")
    assert caps.notes == ()


def test_probe_without_nvml_or_atomics_keeps_torch_facts_and_says_why(two_gpu_torch, monkeypatch):
    monkeypatch.setattr(links_module, "native_atomics_reader", lambda torch: (None, "no loadable libcudart"))
    caps = probe(nvml=FakeNvml(fail_init="Driver Not Loaded"))
    assert caps.nvml == "NVML unavailable: nvmlInit failed: Driver Not Loaded"
    assert caps.gpus[0].sm_count == 132 and caps.gpus[0].power_limit_w is None
    link = caps.link(0, 1)
    assert (link.kind, link.peer_access, link.native_atomics) == ("unknown", True, None)
    assert ("NVML unavailable: nvmlInit failed: Driver Not Loaded: power limits, PCIe links and link kinds are unknown"
            in caps.notes)
    assert "native peer atomics unknown: no loadable libcudart" in caps.notes


# ---- on this machine, without a GPU --------------------------------------------------------------

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine where torch sees no CUDA GPU")


@pytest.fixture(scope="module")
def caps():
    return probe()


@NO_GPU
def test_no_gpu_is_said_with_the_reason(caps):
    assert caps.gpus == () and caps.links == () and not caps.has_gpu
    expected = "built without CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
    assert any(note.startswith("no GPU:") and expected in note for note in caps.notes), caps.notes


@NO_GPU
def test_cpu_is_described_with_real_cores_and_memory(caps):
    assert caps.cpu.num_cores == os.cpu_count()
    assert caps.cpu.num_usable_cores == len(os.sched_getaffinity(0))
    # sysconf reads the same kernel total as /proc/meminfo's MemTotal, through another interface.
    assert caps.cpu.memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert caps.cpu.arch == platform.machine()
    assert caps.cpu.model and caps.cpu.model != "unknown"


@NO_GPU
def test_versions_are_filled(caps):
    v = caps.versions
    assert v.torch == torch.__version__ and v.python == platform.python_version() and v.tpfuse == __version__
    assert v.cuda_runtime == torch.version.cuda
    assert v.triton == importlib.metadata.version("triton")


@NO_GPU
def test_optional_packages_match_what_is_installed(caps):
    names = [b.name for b in caps.packages]
    assert names == ["triton", "flashinfer", "pynvml", "cuda-python", "matplotlib"]
    for backend, module in zip(caps.packages, ["triton", "flashinfer", "pynvml", None, "matplotlib"]):
        if module is not None:
            assert backend.available == (importlib.util.find_spec(module) is not None), backend
        if backend.available:
            assert backend.version and backend.reason == ""
        else:
            assert backend.reason.startswith("not installed (pip install "), backend
    assert caps.package("triton").available and caps.package("triton").version == importlib.metadata.version("triton")


@NO_GPU
def test_nvml_status_says_why_when_there_is_no_driver(caps):
    if caps.nvml != "ok":
        assert caps.nvml.startswith("NVML unavailable: ")


@NO_GPU
def test_to_dict_is_json_and_round_trips_the_facts(caps):
    data = json.loads(json.dumps(caps.to_dict()))
    assert data["gpus"] == [] and data["cpu"]["num_cores"] == os.cpu_count()
    assert data["versions"]["torch"] == torch.__version__
    assert {b["name"]: b["available"] for b in data["packages"]} == {b.name: b.available for b in caps.packages}


@NO_GPU
def test_import_probes_nothing():
    """Importing the package, the probe package and the doctor command loads neither torch nor
    NVML nor Triton: the probe functions cannot have run."""
    code = (
        "import sys, tpfuse, tpfuse.probe, tpfuse.probe.capabilities, tpfuse.cli.doctor;"
        "heavy = [m for m in ('torch', 'pynvml', 'triton') if m in sys.modules];"
        "probed = [m for m in ('tpfuse.probe.nvml', 'tpfuse.probe.links', 'tpfuse.probe.gpus') if m in sys.modules];"
        "print(heavy, probed)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] []"
