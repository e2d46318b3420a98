"""A fake pynvml module: the NVML calls the probe and diagnose's sampler make, answering from a table
of devices. Pass an instance as the probe's `nvml=` argument, or put it in sys.modules["pynvml"].

Models four GPUs in NVML (PCI) order; two NVLink-bridged directly (4 links), two on an NVSwitch
(18 and 12 active links; the latter with an unreadable and five inactive links in between), cross
pairs over PCIe. Functions raise FakeNVMLError like pynvml's NVMLError subclasses do ("Not
Supported", "Insufficient Permissions").

Live readings (what diagnose samples): GPU i reads power (200 + 50 i) W of its enforced limit,
utilisation (90 - 10 i) %, SM clock 1500 of 1980 MHz, memory 3 + i GiB of 141 GiB, and lists every
child of the test process (read from /proc) as a compute process holding PROC_MEM_BYTES on GPU 0.
`num_gpus` keeps the first devices of the table.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

NVML_NVLINK_MAX_LINKS = 18
DRIVER = "580.95.05"
GIB = 1024**3
PROC_MEM_BYTES = 7 * 1024**2


class FakeNVMLError(Exception):
    pass


def pci(domain, bus, device=0):
    return SimpleNamespace(domain=domain, bus=bus, device=device,
                           busId=f"{domain:08X}:{bus:02X}:{device:02X}.0".encode())


SWITCH_PCI = pci(0, 0xE0)
# nvml index -> device facts. UUIDs carry NVML's "GPU-" prefix; torch reports them without it.
DEVICES = [
    dict(uuid=b"GPU-aaaa0000-0000-0000-0000-000000000000", pci=pci(0, 0x19), power_mw=700000, gen=5, width=16,
         links=[(1, "gpu")] * 4),
    dict(uuid=b"GPU-bbbb0000-0000-0000-0000-000000000000", pci=pci(0, 0x3B), power_mw=600500, gen=4, width=8,
         links=[(0, "gpu")] * 4),
    dict(uuid=b"GPU-cccc0000-0000-0000-0000-000000000000", pci=pci(0, 0x4C), power_mw=None, gen=5, width=16,
         links=[(None, "switch")] * 18),
    dict(uuid=b"GPU-dddd0000-0000-0000-0000-000000000000", pci=pci(0, 0x5D), power_mw=450000, gen=5, width=16,
         links=[(None, "switch")] * 6 + [(None, "error")] + [(None, "inactive")] * 5 + [(None, "switch")] * 6),
]
# nvmlDeviceGetTopologyCommonAncestor answers by unordered pair; values are nvml.h levels.
TOPOLOGY = {frozenset((0, 1)): 10, frozenset((2, 3)): 20, frozenset((0, 2)): 40, frozenset((0, 3)): 40,
            frozenset((1, 2)): 50, frozenset((1, 3)): 50}


def power_w(i: int) -> float:
    return 200.0 + 50.0 * i


def util_pct(i: int) -> float:
    return 90.0 - 10.0 * i


def limit_w(i: int) -> float:
    return DEVICES[i]["power_mw"] / 1000


class FakeNvml:
    NVML_NVLINK_MAX_LINKS = NVML_NVLINK_MAX_LINKS
    NVMLError = FakeNVMLError
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2

    def __init__(self, num_gpus: int = len(DEVICES), *, fail_init: str | None = None, missing: tuple[str, ...] = (),
                 power_supported: bool = True):
        self.num_gpus, self.power_supported = num_gpus, power_supported
        self.fail_init = fail_init
        self.init_calls = self.shutdown_calls = 0
        for name in missing:
            setattr(self, name, None)

    def nvmlInit(self):
        self.init_calls += 1
        if self.fail_init:
            raise FakeNVMLError(self.fail_init)

    def nvmlShutdown(self):
        self.shutdown_calls += 1

    def nvmlSystemGetDriverVersion(self):
        return DRIVER

    def nvmlSystemGetCudaDriverVersion(self):
        return 13000

    def nvmlDeviceGetCount(self):
        return self.num_gpus

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetUUID(self, h):
        return DEVICES[h[1]]["uuid"]

    def nvmlDeviceGetPciInfo(self, h):
        return DEVICES[h[1]]["pci"]

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        mw = DEVICES[h[1]]["power_mw"]
        if mw is None:
            raise FakeNVMLError("Insufficient Permissions")
        return mw

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return DEVICES[h[1]]["gen"]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return DEVICES[h[1]]["width"]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return 5

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetTopologyCommonAncestor(self, h1, h2):
        return TOPOLOGY[frozenset((h1[1], h2[1]))]

    def _link(self, h, link):
        links = DEVICES[h[1]]["links"]
        if link >= len(links):
            raise FakeNVMLError("Invalid Argument" if links else "Not Supported")
        return links[link]

    def nvmlDeviceGetNvLinkState(self, h, link):
        kind = self._link(h, link)[1]
        if kind == "error":  # a link the driver will not report on, between active ones
            raise FakeNVMLError("Not Supported")
        return 0 if kind == "inactive" else 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        peer, kind = self._link(h, link)
        return DEVICES[peer]["pci"] if kind == "gpu" else SWITCH_PCI

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return {"gpu": 0, "switch": 2}.get(self._link(h, link)[1], 0xFF)

    def nvmlDeviceGetP2PStatus(self, h1, h2, index):
        assert index == 2, "the probe asks for NVML_P2P_CAPS_INDEX_NVLINK only"
        on_switch = {2, 3}
        return 0 if {h1[1], h2[1]} <= on_switch or {h1[1], h2[1]} == {0, 1} else 5

    def nvmlDeviceGetName(self, h):
        return b"Fake GPU"  # old pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=141 * GIB, used=(3 + h[1]) * GIB, free=0)

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        return 1980 if kind == self.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1500 if kind == self.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetPowerUsage(self, h):
        if not self.power_supported:
            raise FakeNVMLError("Not Supported")
        return int(power_w(h[1]) * 1000)  # milliwatts, as NVML reports

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=int(util_pct(h[1])), memory=20)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        from tpfuse.diagnose.sampler import process_tree

        if h[1] != 0:
            return []
        me = os.getpid()
        return [SimpleNamespace(pid=p, usedGpuMemory=PROC_MEM_BYTES) for p in process_tree(me) - {me}]
