"""NVML reader against a fake pynvml: unit conversion, PCIe link, topology levels, NVLink counts,
GPU matching across NVML's and torch's numbering, and guarded failures."""

from __future__ import annotations

import sys

import pytest

from support.fake_nvml import FakeNvml
from tpfuse.probe import probe
from tpfuse.probe.capabilities import GpuInfo
from tpfuse.probe.nvml import read_nvml


def gpu(index, uuid, pci_bus_id):
    return GpuInfo(index, f"GPU{index}", uuid, (9, 0), 132, 232448, 50 * 2**20, 141 * 2**30, None, None, None,
                   pci_bus_id)


# torch's numbering differs from NVML's on purpose: torch i -> NVML (2, 0, 3, 1); torch 3 has no
# UUID (matched by PCI address) and torch 4 has no NVML device at all (e.g. a MIG instance).
TORCH_GPUS = [
    gpu(0, "cccc0000-0000-0000-0000-000000000000", None),
    gpu(1, "AAAA0000-0000-0000-0000-000000000000", None),
    gpu(2, "GPU-dddd0000-0000-0000-0000-000000000000", None),
    gpu(3, None, "0000:3b:00.0"),
    gpu(4, "MIG-eeee", None),
]


@pytest.fixture
def report():
    return read_nvml(TORCH_GPUS, nvml=FakeNvml())


def test_gpu_facts_power_in_watts_and_pcie_link(report):
    assert report.status == "ok"
    assert report.driver == "580.95.05" and report.cuda_driver == 13000
    assert report.gpus[1].power_limit_w == 700.0  # 700000 mW
    assert report.gpus[3].power_limit_w == 600.5  # matched by PCI address, 600500 mW
    assert report.gpus[2].power_limit_w == 450.0
    assert (report.gpus[3].pcie_generation, report.gpus[3].pcie_width) == (4, 8)
    assert (report.gpus[1].pcie_generation, report.gpus[1].pcie_width) == (5, 16)
    assert (report.gpus[1].pcie_max_generation, report.gpus[1].pcie_max_width) == (5, 16)


def test_failed_call_is_none_with_one_note(report):
    assert report.gpus[0].power_limit_w is None
    assert report.gpus[0].pcie_generation == 5  # the other facts of that GPU are still read
    assert "NVML nvmlDeviceGetEnforcedPowerLimit: Insufficient Permissions (GPU 0)" in report.notes


def test_unmatched_gpu_gets_a_note_and_no_facts(report):
    assert 4 not in report.gpus
    assert any(note.startswith("GPU 4: no NVML device") for note in report.notes)
    assert not any(4 in pair for pair in report.pairs)


def test_direct_nvlink_counts_links_to_the_peer(report):
    pair = report.pairs[(1, 3)]
    assert (pair.kind, pair.nvlink_count, pair.nvlink_via, pair.pcie_level) == ("nvlink", 4, "direct", "single")
    assert report.pairs[(3, 1)].nvlink_count == 4


def test_nvswitch_pair_is_bounded_by_the_side_with_fewer_active_links(report):
    pair = report.pairs[(0, 2)]
    assert (pair.kind, pair.nvlink_count, pair.nvlink_via, pair.pcie_level) == ("nvlink", 12, "switch", "multiple")


@pytest.mark.parametrize("a,b,level", [(1, 0, "node"), (3, 0, "system"), (2, 1, "node"), (3, 2, "system")])
def test_pcie_pairs_carry_the_common_ancestor_level(report, a, b, level):
    pair = report.pairs[(a, b)]
    assert (pair.kind, pair.nvlink_count, pair.pcie_level) == ("pcie", None, level)


def test_every_ordered_pair_of_matched_gpus_is_read(report):
    assert set(report.pairs) == {(a, b) for a in range(4) for b in range(4) if a != b}


def test_init_failure_is_the_status_and_nothing_else_is_read():
    fake = FakeNvml(fail_init="Driver Not Loaded")
    report = read_nvml(TORCH_GPUS, nvml=fake)
    assert report.status == "NVML unavailable: nvmlInit failed: Driver Not Loaded"
    assert report.gpus == {} and report.pairs == {} and fake.shutdown_calls == 0


def test_shutdown_follows_a_successful_init():
    fake = FakeNvml()
    read_nvml(TORCH_GPUS, nvml=fake)
    assert (fake.init_calls, fake.shutdown_calls) == (1, 1)


def test_function_missing_from_an_old_pynvml_is_a_note():
    report = read_nvml(TORCH_GPUS, nvml=FakeNvml(missing=("nvmlDeviceGetMaxPcieLinkWidth",)))
    assert report.gpus[1].pcie_max_width is None and report.gpus[1].pcie_width == 16
    assert any("nvmlDeviceGetMaxPcieLinkWidth: not provided by this pynvml" in note for note in report.notes)


def test_without_pynvml_the_probe_says_why_and_still_runs(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    caps = probe()
    assert caps.nvml.startswith("NVML unavailable: pynvml is not importable")
    assert "pip install nvidia-ml-py" in caps.nvml
    assert caps.cpu.num_cores >= 1 and caps.versions.python


def test_probe_takes_driver_versions_from_nvml():
    caps = probe(nvml=FakeNvml())
    assert caps.nvml == "ok"
    assert caps.versions.driver == "580.95.05" and caps.versions.cuda_driver == "13.0"
