"""`tpfuse.host_memory` over fixture files: MemAvailable lowered to the cgroup's room (v2 and v1,
"no limit" read as none), resident size, and the OOM-kill counters."""

from __future__ import annotations

import os

from tpfuse.host_memory import available_bytes, format_bytes, oom_kills, resident_bytes

KiB = 1024


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_available_is_memavailable_lowered_to_the_cgroup_room(tmp_path):
    meminfo = _write(tmp_path / "meminfo", "MemTotal:  8000000 kB\nMemAvailable:  4000000 kB\n")
    none = tmp_path / "no-cgroup"
    assert available_bytes(meminfo=meminfo, cgroup_root=none) == 4000000 * KiB
    v2 = tmp_path / "v2"
    _write(v2 / "memory.max", "3000000000\n")
    _write(v2 / "memory.current", "1000000000\n")
    assert available_bytes(meminfo=meminfo, cgroup_root=v2) == 2000000000
    _write(v2 / "memory.max", "max\n")  # v2 without a limit
    assert available_bytes(meminfo=meminfo, cgroup_root=v2) == 4000000 * KiB
    v1 = tmp_path / "v1"
    _write(v1 / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1 without a limit
    _write(v1 / "memory" / "memory.usage_in_bytes", "5\n")
    assert available_bytes(meminfo=meminfo, cgroup_root=v1) == 4000000 * KiB
    _write(v1 / "memory" / "memory.limit_in_bytes", "1073741824\n")
    assert available_bytes(meminfo=meminfo, cgroup_root=v1) == 1073741824 - 5
    assert available_bytes(meminfo=tmp_path / "missing", cgroup_root=none) is None


def test_resident_size_of_this_process_and_of_none(tmp_path):
    rss = resident_bytes(os.getpid())
    assert rss is not None and rss > 10 * 2**20
    assert resident_bytes(os.getpid(), proc=tmp_path) is None


def test_oom_kill_counters(tmp_path):
    vmstat = _write(tmp_path / "vmstat", "pgfault 12\noom_kill 4\n")
    cg = tmp_path / "cg"
    _write(cg / "memory.events", "low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n")
    assert oom_kills(vmstat=vmstat, cgroup_root=cg) == {"/proc/vmstat oom_kill": 4, "cgroup memory.events oom_kill": 1}
    assert oom_kills(vmstat=tmp_path / "none", cgroup_root=tmp_path / "none") == {}


def test_format_bytes():
    assert (format_bytes(3 * 2**30), format_bytes(512 * 2**20)) == ("3.0 GiB", "512 MiB")
