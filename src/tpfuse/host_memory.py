"""The host's memory as this process sees it, from /proc and the cgroup files (Linux; no torch).

- `available_bytes()`: what new processes may still allocate: MemAvailable, lowered to the room
  left under this process's cgroup limit (v2 `memory.max`, v1 `memory.limit_in_bytes`) if any;
- `resident_bytes(pid)`: a process's resident set (VmRSS);
- `oom_kills()`: the kernel's out-of-memory kill counters (`/proc/vmstat` oom_kill, and the
  cgroup's), so that a rank killed by SIGKILL while one of them rose is named an OOM kill.

Every reader returns None (or leaves a counter out) when its file is missing or unreadable; the
paths are parameters so that tests point them at fixtures.
"""

from __future__ import annotations

from pathlib import Path

MEMINFO = "/proc/meminfo"
VMSTAT = "/proc/vmstat"
CGROUP_ROOT = "/sys/fs/cgroup"


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _meminfo_available(meminfo: str) -> int | None:
    for line in meminfo.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "MemAvailable:" and fields[1].isdigit():
            return int(fields[1]) * 1024  # the kernel's "kB" means KiB
    return None


def _cgroup_room(root: str | Path) -> int | None:
    """Bytes left under this cgroup's memory limit, or None without a limit."""
    root = Path(root)
    pairs = ((root / "memory.max", root / "memory.current"),  # v2
             (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes"))  # v1
    for limit_path, usage_path in pairs:
        limit, usage = _read(limit_path), _read(usage_path)
        if limit is None or usage is None:
            continue
        limit, usage = limit.strip(), usage.strip()
        # v1 writes "no limit" as a huge page-aligned number (2**63 rounded down to a page).
        if not limit.isdigit() or not usage.isdigit() or int(limit) >= 2**62:
            return None
        return max(int(limit) - int(usage), 0)
    return None


def available_bytes(*, meminfo: str | Path = MEMINFO, cgroup_root: str | Path = CGROUP_ROOT) -> int | None:
    """Memory new processes may allocate here (module doc), or None when /proc/meminfo is unreadable."""
    text = _read(meminfo)
    available = _meminfo_available(text) if text is not None else None
    room = _cgroup_room(cgroup_root)
    if available is None:
        return room
    return available if room is None else min(available, room)


def resident_bytes(pid: int, *, proc: str | Path = "/proc") -> int | None:
    """VmRSS of `pid` in bytes, or None if it cannot be read (gone, not Linux)."""
    text = _read(Path(proc) / str(pid) / "status")
    for line in (text or "").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "VmRSS:" and fields[1].isdigit():
            return int(fields[1]) * 1024
    return None


def oom_kills(*, vmstat: str | Path = VMSTAT, cgroup_root: str | Path = CGROUP_ROOT) -> dict[str, int]:
    """{counter name: value} of the OOM-kill counters readable here (module doc)."""
    counters: dict[str, int] = {}
    sources = ((vmstat, "oom_kill", "/proc/vmstat oom_kill"),
               (Path(cgroup_root) / "memory.events", "oom_kill", "cgroup memory.events oom_kill"),
               (Path(cgroup_root) / "memory" / "memory.oom_control", "oom_kill", "cgroup memory.oom_control oom_kill"))
    for path, key, name in sources:
        for line in (_read(path) or "").splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[0] == key and fields[1].isdigit():
                counters[name] = int(fields[1])
    return counters


def format_bytes(n: float) -> str:
    """`n` bytes as GiB (or MiB below one GiB), for messages."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
