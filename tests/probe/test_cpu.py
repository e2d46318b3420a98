"""The probe's CPU source (`tpfuse.probe.cpu`) on /proc fixtures: the model name of x86 and other
cpuinfo layouts, MemTotal in bytes, and a fallback when /proc is missing."""

from __future__ import annotations

from tpfuse.probe.cpu import cpu_model, mem_total_bytes, read_cpu

X86_CPUINFO = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n\n"
               "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n")
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
