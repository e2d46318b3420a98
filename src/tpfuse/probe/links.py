"""Facts per ordered GPU pair: peer access (torch), native peer atomics (CUDA), link kind (NVML).

Native atomics come from cudaDeviceGetP2PAttribute(cudaDevP2PAttrNativeAtomicSupported), which
torch does not expose. It is read, in order, through the libcudart that torch already loaded (found
in /proc/self/maps), another libcudart on disk, cuda-python, or the driver API in libcuda.so.1
(cuDeviceGetP2PAttribute, same attribute value). When none answers the fact is None with a note.
Device numbers are CUDA ordinals, the same ones torch uses (all honour CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from collections.abc import Callable

from tpfuse.probe.capabilities import GpuInfo, LinkInfo
from tpfuse.probe.nvml import NvmlPair

# cudaDevP2PAttrNativeAtomicSupported (driver_types.h) == CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED (cuda.h).
P2P_ATTR_NATIVE_ATOMIC = 3
CUDA_SUCCESS = 0  # cudaSuccess and CUDA_SUCCESS

# (src, dst) -> attribute value; raises RuntimeError when CUDA returns an error.
AttributeReader = Callable[[int, int], int]


def _loaded_libraries(fragment: str, maps: str = "/proc/self/maps") -> list[str]:
    try:
        with open(maps) as f:
            paths = {line.split()[-1] for line in f if fragment in line and "/" in line}
    except OSError:
        return []
    return sorted(paths)


def _cudart_candidates(torch) -> list[str]:
    """libcudart paths: the copy already in this process first (torch's), then wheels, then the system."""
    candidates = _loaded_libraries("libcudart.so")
    roots = [os.path.dirname(torch.__file__)] if torch is not None else []
    for root in roots:
        site = os.path.dirname(root)
        # torch's own lib dir, and the nvidia-cuda-runtime wheels (nvidia/cuda_runtime/lib for CUDA 12,
        # nvidia/cu13/lib for CUDA 13) that CUDA builds of torch depend on.
        candidates += sorted(glob.glob(os.path.join(root, "lib", "libcudart.so*")))
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so*")))
    found = ctypes.util.find_library("cudart")
    if found:
        candidates.append(found)
    return list(dict.fromkeys(candidates))


def _cudart_reader(torch) -> tuple[AttributeReader | None, str]:
    errors = []
    for path in _cudart_candidates(torch):
        try:
            fn = ctypes.CDLL(path).cudaDeviceGetP2PAttribute
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
            continue
        fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int

        def read(src: int, dst: int, fn=fn) -> int:
            value = ctypes.c_int(-1)
            err = fn(ctypes.byref(value), P2P_ATTR_NATIVE_ATOMIC, src, dst)
            if err != CUDA_SUCCESS:
                raise RuntimeError(f"cudaDeviceGetP2PAttribute({src}, {dst}) returned cudaError {err}")
            return value.value

        return read, f"libcudart ({path})"
    return None, "no loadable libcudart" + (f" ({'; '.join(errors)})" if errors else "")


def _cuda_python_reader() -> tuple[AttributeReader | None, str]:
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime  # cuda-python < 12.6 layout
        except ImportError:
            return None, "cuda-python not installed"

    def read(src: int, dst: int) -> int:
        err, value = runtime.cudaDeviceGetP2PAttribute(P2P_ATTR_NATIVE_ATOMIC, src, dst)
        if int(err) != CUDA_SUCCESS:
            raise RuntimeError(f"cudaDeviceGetP2PAttribute({src}, {dst}) returned {err}")
        return int(value)

    return read, "cuda-python"


def _driver_reader() -> tuple[AttributeReader | None, str]:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        init, get, attr = lib.cuInit, lib.cuDeviceGet, lib.cuDeviceGetP2PAttribute
    except (OSError, AttributeError) as exc:
        return None, f"libcuda.so.1 not loadable: {exc}"
    if init(0) != CUDA_SUCCESS:
        return None, "cuInit failed"

    def read(src: int, dst: int) -> int:
        devs = [ctypes.c_int(), ctypes.c_int()]
        for dev, ordinal in zip(devs, (src, dst)):
            if get(ctypes.byref(dev), ordinal) != CUDA_SUCCESS:
                raise RuntimeError(f"cuDeviceGet({ordinal}) failed")
        value = ctypes.c_int(-1)
        err = attr(ctypes.byref(value), P2P_ATTR_NATIVE_ATOMIC, devs[0], devs[1])
        if err != CUDA_SUCCESS:
            raise RuntimeError(f"cuDeviceGetP2PAttribute({src}, {dst}) returned CUresult {err}")
        return value.value

    return read, "libcuda.so.1 driver API"


def native_atomics_reader(torch) -> tuple[AttributeReader | None, str]:
    """The first working reader and its source, or (None, why none works)."""
    whys = []
    for make in (lambda: _cudart_reader(torch), _cuda_python_reader, _driver_reader):
        reader, source = make()
        if reader is not None:
            return reader, source
        whys.append(source)
    return None, "; ".join(whys)


def read_links(
    torch, gpus: list[GpuInfo], nvml_pairs: dict[tuple[int, int], NvmlPair], *, atomics: AttributeReader | None = None,
    atomics_unavailable: str = "",
) -> tuple[list[LinkInfo], list[str]]:
    """LinkInfo for every ordered pair of `gpus` (same-device pairs included) and notes.

    A GPU's own memory is always mapped and its atomics are native, so same-device pairs say so
    without asking CUDA (cudaDeviceGetP2PAttribute rejects src == dst)."""
    links, notes = [], []
    failures: dict[str, list[str]] = {}
    for ga in gpus:
        for gb in gpus:
            a, b = ga.index, gb.index
            if a == b:
                links.append(LinkInfo(a, b, True, "same_device", native_atomics=True))
                continue
            try:
                peer = bool(torch.cuda.can_device_access_peer(a, b))
            except Exception as exc:  # report, and assume no mapping: the safe answer for admission
                failures.setdefault(f"can_device_access_peer: {exc}", []).append(f"{a}->{b}")
                peer = False
            atomic = None
            if atomics is not None:
                try:
                    atomic = bool(atomics(a, b))
                except Exception as exc:
                    failures.setdefault(str(exc), []).append(f"{a}->{b}")
            nv = nvml_pairs.get((a, b)) or NvmlPair("unknown")
            links.append(LinkInfo(a, b, peer, nv.kind, nv.nvlink_count, nv.pcie_level, atomic, nv.nvlink_via))
    if atomics is None and len(gpus) > 1:
        notes.append(f"native peer atomics unknown: {atomics_unavailable or 'no CUDA library answered'}")
    notes += [f"GPU pairs {', '.join(pairs)}: {why}" for why, pairs in failures.items()]
    return links, notes
