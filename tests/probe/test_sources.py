"""Unit tests of the probe's sources on fixtures and fakes: /proc parsing, torch device
properties, peer links and native atomics, versions, optional packages."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from tpfuse.probe.capabilities import GpuInfo
from tpfuse.probe.cpu import cpu_model, mem_total_bytes, read_cpu
from tpfuse.probe.gpus import no_gpu_reason, parse_pci_bus_id, read_gpus
from tpfuse.probe.links import read_links
from tpfuse.probe.nvml import NvmlPair
from tpfuse.probe.optional import OptionalPackage, read_package
from tpfuse.probe.versions import cuda_version_string, driver_from_proc, nccl_version

X86_CPUINFO = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n\nprocessor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
ARM_CPUINFO = "processor\t: 0\nBogoMIPS\t: 2000.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd4f\n"


def test_cpu_model_from_cpuinfo():
    assert cpu_model(X86_CPUINFO) == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu_model(ARM_CPUINFO) is None
    assert cpu_model("Hardware\t: BCM2835\n") == "BCM2835"


def test_memtotal_kib_to_bytes():
    assert mem_total_bytes("MemTotal:       263856220 kB\nMemFree: 1 kB\n") == 263856220 * 1024
    assert mem_total_bytes("garbage") is None


def test_read_cpu_falls_back_when_proc_is_missing(tmp_path):
    cpu = read_cpu(cpuinfo_path=tmp_path / "none", meminfo_path=tmp_path / "none")
    assert cpu.memory_bytes is None and cpu.model and cpu.num_cores >= 1


def test_pci_bus_id_parsing():
    assert parse_pci_bus_id("0000:19:00.0") == (0, 0x19, 0)
    assert parse_pci_bus_id(b"00000001:3B:1F.0") == (1, 0x3B, 0x1F)
    assert parse_pci_bus_id("nonsense") is None and parse_pci_bus_id(None) is None


def fake_torch(props=(), *, cuda="13.0", peers=None):
    def can_access(a, b):
        if peers is None:
            raise RuntimeError("peer query failed")
        return (a, b) in peers

    cuda_ns = SimpleNamespace(
        is_available=lambda: bool(props), device_count=lambda: len(props),
        get_device_properties=lambda i: props[i], can_device_access_peer=can_access,
    )
    return SimpleNamespace(__version__="2.11.0+cu130", version=SimpleNamespace(cuda=cuda), cuda=cuda_ns)


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


def _gpus(n):
    return [GpuInfo(i, "G", None, (9, 0), 1, None, None, 1, None, None, None, None) for i in range(n)]


def test_links_combine_peer_access_atomics_and_nvml_kind():
    pairs = {(0, 1): NvmlPair("nvlink", 18, "switch", "node"), (1, 0): NvmlPair("pcie", None, None, "system")}
    torch = fake_torch(peers={(0, 1)})
    links, notes = read_links(torch, _gpus(2), pairs, atomics=lambda a, b: int(a < b))
    by = {(l.a, l.b): l for l in links}
    assert by[(0, 0)].kind == "same_device" and by[(0, 0)].peer_access and by[(0, 0)].native_atomics
    l01, l10 = by[(0, 1)], by[(1, 0)]
    assert (l01.peer_access, l01.kind, l01.nvlink_count, l01.nvlink_via, l01.pcie_level, l01.native_atomics) == (
        True, "nvlink", 18, "switch", "node", True)
    assert (l10.peer_access, l10.kind, l10.pcie_level, l10.native_atomics) == (False, "pcie", "system", False)
    assert notes == []


def test_links_without_nvml_or_atomics_say_unknown_with_notes():
    def broken(a, b):
        raise RuntimeError("cudaDeviceGetP2PAttribute(0, 1) returned cudaError 101")

    links, notes = read_links(fake_torch(peers=None), _gpus(2), {}, atomics=broken)
    l01 = next(l for l in links if (l.a, l.b) == (0, 1))
    assert (l01.kind, l01.peer_access, l01.native_atomics) == ("unknown", False, None)
    assert "GPU pairs 0->1, 1->0: cudaDeviceGetP2PAttribute(0, 1) returned cudaError 101" in notes
    assert any(n.startswith("GPU pairs 0->1, 1->0: can_device_access_peer: peer query failed") for n in notes)
    _, notes = read_links(fake_torch(peers=set()), _gpus(2), {}, atomics=None, atomics_unavailable="no loadable libcudart")
    assert notes == ["native peer atomics unknown: no loadable libcudart"]


def test_version_helpers(tmp_path):
    assert cuda_version_string(13000) == "13.0" and cuda_version_string(12080) == "12.8"
    assert cuda_version_string(None) is None
    f = tmp_path / "version"
    f.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U16)\n")
    assert driver_from_proc(f) == "580.95.05"
    f.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Feb 26 2025\n")
    assert driver_from_proc(f) == "570.124.06"
    assert driver_from_proc(tmp_path / "missing") is None
    nccl = SimpleNamespace(cuda=SimpleNamespace(nccl=SimpleNamespace(version=lambda: (2, 27, 5))))
    assert nccl_version(nccl) == "2.27.5"
    assert nccl_version(SimpleNamespace(cuda=SimpleNamespace())) is None


def test_optional_package_missing_and_broken(tmp_path, monkeypatch):
    missing = read_package(OptionalPackage("nothere", "tpfuse_no_such_module", ("nothere",), "pip install nothere"))
    assert (missing.available, missing.reason) == (False, "not installed (pip install nothere)")
    (tmp_path / "tpfuse_broken_pkg.py").write_text("raise OSError('libfoo.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = read_package(OptionalPackage("broken", "tpfuse_broken_pkg", ("broken",), "pip install broken", import_check=True))
    assert not broken.available
    assert broken.reason == "installed but import failed: OSError: libfoo.so: cannot open shared object file"
    sys.modules.pop("tpfuse_broken_pkg", None)
    parentless = read_package(OptionalPackage("x", "tpfuse_no_parent.sub", ("x",), "pip install x"))
    assert parentless.reason == "not installed (pip install x)"
