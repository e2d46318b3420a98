"""The probe on a machine without a GPU (CI): says so, describes the CPU, fills the versions,
lists the optional packages with reasons; and nothing is probed at import."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from tpfuse import __version__
from tpfuse.probe import probe

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine where torch sees no CUDA GPU")


@pytest.fixture(scope="module")
def caps():
    return probe()


def test_no_gpu_is_said_with_the_reason(caps):
    assert caps.gpus == () and caps.links == () and not caps.has_gpu
    expected = "built without CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
    assert any(note.startswith("no GPU:") and expected in note for note in caps.notes), caps.notes


def test_cpu_is_described_with_real_cores_and_memory(caps):
    assert caps.cpu.num_cores == os.cpu_count()
    assert caps.cpu.num_usable_cores == len(os.sched_getaffinity(0))
    # sysconf reads the same kernel total as /proc/meminfo's MemTotal, through another interface.
    assert caps.cpu.memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert caps.cpu.arch == platform.machine()
    assert caps.cpu.model and caps.cpu.model != "unknown"


def test_versions_are_filled(caps):
    v = caps.versions
    assert v.torch == torch.__version__ and v.python == platform.python_version() and v.tpfuse == __version__
    assert v.cuda_runtime == torch.version.cuda
    assert v.triton == importlib.metadata.version("triton")


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


def test_nvml_status_says_why_when_there_is_no_driver(caps):
    if caps.nvml != "ok":
        assert caps.nvml.startswith("NVML unavailable: ")


def test_to_dict_is_json_and_round_trips_the_facts(caps):
    data = json.loads(json.dumps(caps.to_dict()))
    assert data["gpus"] == [] and data["cpu"]["num_cores"] == os.cpu_count()
    assert data["versions"]["torch"] == torch.__version__
    assert {b["name"]: b["available"] for b in data["packages"]} == {b.name: b.available for b in caps.packages}


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
