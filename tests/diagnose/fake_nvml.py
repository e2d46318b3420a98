"""A stand-in for the `pynvml` module with known readings, so the sampler, the watcher and the CLI's
live path run on CPU. Each GPU i reads power (200 + 100 i) W of a 700 W limit, utilisation
(90 - 10 i) %, SM clock 1500 of 1980 MHz, memory 3 + i GiB of 141 GiB, and lists every child of
the test process (read from /proc) as a compute process holding PROC_MEM_BYTES on GPU 0.
"""

from __future__ import annotations

import os
import types

from fusegate.diagnose.sampler import process_tree

GIB = 1024**3
PROC_MEM_BYTES = 7 * 1024**2
LIMIT_W = 700.0


class NVMLError(Exception):
    pass


def power_w(i: int) -> float:
    return 200.0 + 100.0 * i


def util_pct(i: int) -> float:
    return 90.0 - 10.0 * i


def make(num_gpus: int = 2, *, power_supported: bool = True) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.NVMLError = NVMLError
    nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM = 1, 2
    nv.calls = {"init": 0, "shutdown": 0}

    def init():
        nv.calls["init"] += 1

    def shutdown():
        nv.calls["shutdown"] += 1

    def power(h):
        if not power_supported:
            raise NVMLError("Not Supported")
        return int(power_w(h) * 1000)  # milliwatts, as NVML reports

    def procs(h):
        if h != 0:
            return []
        me = os.getpid()
        return [types.SimpleNamespace(pid=p, usedGpuMemory=PROC_MEM_BYTES) for p in process_tree(me) - {me}]

    nv.nvmlInit, nv.nvmlShutdown = init, shutdown
    nv.nvmlDeviceGetCount = lambda: num_gpus
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlSystemGetDriverVersion = lambda: "999.1"
    nv.nvmlDeviceGetName = lambda h: b"Fake GPU"  # old pynvml returns bytes
    nv.nvmlDeviceGetUUID = lambda h: f"GPU-fake-{h}"
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=141 * GIB, used=(3 + h) * GIB, free=0)
    nv.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980 if kind == 1 else 3201
    nv.nvmlDeviceGetClockInfo = lambda h, kind: 1500 if kind == 1 else 3201
    nv.nvmlDeviceGetPowerUsage = power
    nv.nvmlDeviceGetEnforcedPowerLimit = lambda h: int(LIMIT_W * 1000)
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=int(util_pct(h)), memory=20)
    nv.nvmlDeviceGetComputeRunningProcesses = procs
    return nv
