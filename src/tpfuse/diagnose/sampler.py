"""NVML sampling: open NVML (or say exactly what is missing), then read every GPU at a fixed interval
on a background thread until told to stop.

Concurrency: one `Sampler` thread makes all the reads; the caller's thread only calls `latest()`
(for a live status line) and `stop()`. NVML is thread-safe (NVML API reference), and each GPU is
read in turn within a tick, so a tick's samples of different GPUs lie within a millisecond or so.
`pynvml` is imported only by `open_nvml`, never at module import.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable

from tpfuse.diagnose.samples import GpuMeta, Recording, Sample

# Why 100 ms: NVML updates utilisation once per sample period of 1/6 s to 1 s depending on the
# product, and on Ampere and newer reports power as a 1 s average (NVML API reference), so 100 ms
# reads every update at least once while repeating each value only a few times. Faster sampling
# adds identical readings and CPU load; slower sampling misses short phases.
DEFAULT_INTERVAL_S = 0.1
# Bounds on --interval: below 10 ms a tick over eight GPUs (about 8 NVML calls each) can take
# longer than the interval itself; above 60 s a run of minutes would have too few samples to judge.
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.01, 60.0
# How often the watched process tree is re-read from /proc: new workers appear within a second.
TARGET_REFRESH_S = 1.0


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here; the message names what is missing and what to do."""


_FIX = "or analyse a recording made elsewhere with `tpfuse diagnose --from FILE`"


class Nvml:
    """An initialised NVML with a handle per GPU; build it with `open_nvml()`, end with `close()`."""

    def __init__(self, nv) -> None:
        self._nv = nv
        self.failures: dict[str, str] = {}  # reading -> first error, reported in Recording.notes
        self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        self.driver = _text(self._try("driver", nv.nvmlSystemGetDriverVersion))
        self.gpus = tuple(self._meta(i, h) for i, h in enumerate(self.handles))

    def _try(self, what: str, fn, *args):
        try:
            return fn(*args)
        except self._nv.NVMLError as exc:  # NotSupported on some boards, NoPermission in some containers
            self.failures.setdefault(what, str(exc))
            return None

    def _meta(self, i: int, h) -> GpuMeta:
        nv = self._nv
        mem = self._try("memory", nv.nvmlDeviceGetMemoryInfo, h)
        return GpuMeta(
            index=i,
            name=_text(self._try("name", nv.nvmlDeviceGetName, h)) or f"GPU {i}",
            uuid=_text(self._try("uuid", nv.nvmlDeviceGetUUID, h)),
            mem_total_bytes=int(mem.total) if mem is not None else None,
            sm_clock_max_mhz=self._try("max clocks", nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
            mem_clock_max_mhz=self._try("max clocks", nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_MEM),
        )

    def read(self, i: int, t_s: float, target_pids: frozenset[int] | None = None) -> Sample:
        """One Sample of GPU i; a reading NVML refuses is None (and noted once in `failures`)."""
        nv, h = self._nv, self.handles[i]
        power = self._try("power", nv.nvmlDeviceGetPowerUsage, h)
        limit = self._try("power limit", nv.nvmlDeviceGetEnforcedPowerLimit, h)
        util = self._try("utilisation", nv.nvmlDeviceGetUtilizationRates, h)
        mem = self._try("memory", nv.nvmlDeviceGetMemoryInfo, h)
        target = None
        if target_pids is not None:
            procs = self._try("processes", nv.nvmlDeviceGetComputeRunningProcesses, h)
            if procs is not None:
                target = sum(int(p.usedGpuMemory or 0) for p in procs if p.pid in target_pids)
        return Sample(
            t_s=t_s,
            gpu=i,
            power_w=power / 1000.0 if power is not None else None,  # NVML reports milliwatts
            power_limit_w=limit / 1000.0 if limit is not None else None,
            util_pct=float(util.gpu) if util is not None else None,
            mem_util_pct=float(util.memory) if util is not None else None,
            sm_clock_mhz=_float(self._try("clocks", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)),
            mem_clock_mhz=_float(self._try("clocks", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)),
            mem_used_bytes=int(mem.used) if mem is not None else None,
            target_mem_bytes=target,
        )

    def close(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except self._nv.NVMLError:
            pass


def _text(value) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _float(value) -> float | None:
    return float(value) if value is not None else None


def open_nvml() -> Nvml:
    """Initialise NVML and open every GPU; NvmlUnavailable (a RuntimeError) says what is missing."""
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable(f"diagnose: NVML is not available (pynvml import failed: {exc}); install "
                              f"nvidia-ml-py and run on a machine with an NVIDIA driver, {_FIX}") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"diagnose: NVML is not available (nvmlInit failed: {exc}); run on a machine with "
                              f"an NVIDIA driver (libnvidia-ml.so), {_FIX}") from None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            raise NvmlUnavailable(f"diagnose: NVML sees no NVIDIA GPU; run on a machine with one, {_FIX}")
        return Nvml(pynvml)
    except BaseException:
        pynvml.nvmlShutdown()
        raise


def process_tree(root: int) -> frozenset[int]:
    """`root` and all its descendants, read from /proc (just `root` where /proc is missing)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return frozenset({root})
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # the process ended between listdir and open
            continue
        # The command name (field 2) may hold spaces and parentheses; ppid is the 2nd field after it.
        fields = stat.rpartition(")")[2].split()
        if len(fields) >= 2:
            children.setdefault(int(fields[1]), []).append(int(entry))
    seen, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return frozenset(seen)


class Sampler:
    """Reads every GPU of `nvml` every `interval_s` seconds on a daemon thread.

    Ticks are scheduled on a fixed grid (t0 + k * interval) so the interval does not drift by the
    cost of the reads; a tick that falls behind by more than one interval skips to the next grid
    point rather than bursting. `target_root`: a pid whose process tree's GPU memory is recorded.
    """

    def __init__(self, nvml: Nvml, *, interval_s: float = DEFAULT_INTERVAL_S, target_root: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not MIN_INTERVAL_S <= interval_s <= MAX_INTERVAL_S:
            raise ValueError(f"Sampler: interval {interval_s} s is outside [{MIN_INTERVAL_S}, {MAX_INTERVAL_S}] s; "
                             f"use the default {DEFAULT_INTERVAL_S} s")
        self.nvml, self.interval_s, self.target_root = nvml, interval_s, target_root
        self._clock = clock
        self._samples: list[Sample] = []
        self._latest: dict[int, Sample] = {}
        self._tick_s: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tpfuse-diagnose-sampler", daemon=True)
        self._error: BaseException | None = None
        self.started_unix = 0.0
        self._t0 = 0.0
        self._t_end = 0.0
        self.skipped_ticks = 0

    def start(self) -> Sampler:
        self.started_unix = time.time()
        self._t0 = self._clock()
        self._thread.start()
        return self

    def elapsed_s(self) -> float:
        return self._clock() - self._t0

    def _loop(self) -> None:
        try:
            pids, pids_at, k = None, -TARGET_REFRESH_S, 0
            while not self._stop.is_set():
                start = self._clock()
                t_s = start - self._t0
                if self.target_root is not None and t_s - pids_at >= TARGET_REFRESH_S:
                    pids, pids_at = process_tree(self.target_root), t_s
                tick = [self.nvml.read(i, t_s, pids) for i in range(len(self.nvml.handles))]
                with self._lock:
                    self._samples.extend(tick)
                    self._latest.update({s.gpu: s for s in tick})
                    self._tick_s.append(self._clock() - start)
                k += 1
                now = self._clock() - self._t0
                if now > (k + 1) * self.interval_s:
                    behind = int(now / self.interval_s) + 1
                    self.skipped_ticks += behind - k
                    k = behind
                self._stop.wait(max(0.0, k * self.interval_s - now))
        except BaseException as exc:  # surfaced by stop(), in the caller's thread
            self._error = exc

    def latest(self) -> dict[int, Sample]:
        with self._lock:
            return dict(self._latest)

    def num_samples(self) -> int:
        with self._lock:
            return len(self._samples)

    def stop(self) -> None:
        """Stop sampling and wait for the thread; re-raises an error the thread hit."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._t_end = self._clock() - self._t0
        if self._error is not None:
            raise RuntimeError(f"diagnose: the NVML sampler failed: {self._error!r}") from self._error

    def recording(self, *, mode: str, command: tuple[str, ...] | None = None, pid: int | None = None,
                  exit_code: int | None = None, interrupted: bool = False) -> Recording:
        """Everything sampled so far, as a Recording (call after stop())."""
        with self._lock:
            samples = tuple(self._samples)
            ticks = list(self._tick_s)
        notes = [f"NVML could not read {what}: {err}" for what, err in sorted(self.nvml.failures.items())]
        if self.skipped_ticks:
            notes.append(f"{self.skipped_ticks} ticks skipped: reading every GPU took longer than the interval")
        return Recording(
            gpus=self.nvml.gpus, samples=samples, interval_s=self.interval_s, mode=mode,
            started_unix=self.started_unix, duration_s=self._t_end, command=command, pid=pid,
            exit_code=exit_code, driver=self.nvml.driver, interrupted=interrupted,
            tick_ms_median=1000 * statistics.median(ticks) if ticks else None, notes=tuple(notes),
        )
