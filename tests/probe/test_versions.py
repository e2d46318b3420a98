"""The probe's version helpers (`tpfuse.probe.versions`): CUDA's encoded versions, the driver from
/proc, NCCL's from torch."""

from __future__ import annotations

from types import SimpleNamespace

from tpfuse.probe.versions import cuda_version_string, driver_from_proc, nccl_version


def test_version_helpers(tmp_path):
    assert cuda_version_string(13000) == "13.0" and cuda_version_string(12080) == "12.8"
    assert cuda_version_string(None) is None
    f = tmp_path / "version"
    f.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  "
                 "(dvs-builder@U16)\n")
    assert driver_from_proc(f) == "580.95.05"
    f.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Feb 26 2025\n")
    assert driver_from_proc(f) == "570.124.06"
    assert driver_from_proc(tmp_path / "missing") is None
    nccl = SimpleNamespace(cuda=SimpleNamespace(nccl=SimpleNamespace(version=lambda: (2, 27, 5))))
    assert nccl_version(nccl) == "2.27.5"
    assert nccl_version(SimpleNamespace(cuda=SimpleNamespace())) is None
