"""Facts about the device a kernel runs on that decide how it is compiled, read once per device.

- `interpreting()`: kernels run in the Triton interpreter (TRITON_INTERPRET=1: CPU tensors, no
  inline assembly, bf16 casts that truncate).
- `hardware_fp8(device)`, `hardware_fp4(device)`: whether the e4m3 / e2m1 conversions of
  `tpfuse.kernels.quant` use the hardware cvt on `device` (same bits either way).
- `sm_count(device)`: the device's streaming multiprocessors.

Imports torch, not Triton; nothing runs at import.
"""

from __future__ import annotations

import functools
import os

import torch

from tpfuse.quant import FP4_CVT_MIN_CAPABILITY, FP8_CVT_MIN_CAPABILITY


def interpreting() -> bool:
    """True when kernels run in the Triton interpreter (no inline assembly there)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def hardware_fp8(device) -> bool:
    """Whether kernels on `device` round to e4m3 with the hardware cvt (sm_89 and newer; never in
    the interpreter, whose float8 cast does not round to nearest even). Same bits either way."""
    index = _cuda_index(device)
    return index is not None and capability(index) >= FP8_CVT_MIN_CAPABILITY


def hardware_fp4(device) -> bool:
    """Whether kernels on `device` convert to e2m1 with the hardware cvt (compute capability 10.0
    and newer, `tpfuse.quant.FP4_CVT_MIN_CAPABILITY`). Same bits either way."""
    index = _cuda_index(device)
    return index is not None and capability(index) >= FP4_CVT_MIN_CAPABILITY


def sm_count(device) -> int:
    """Streaming multiprocessors of CUDA `device`."""
    return _properties(_cuda_index(device, compiled_only=False)).multi_processor_count


def _cuda_index(device, *, compiled_only: bool = True) -> int | None:
    """The CUDA device index of `device`, or None on CPU (and, with compiled_only, in the interpreter)."""
    device = torch.device(device)
    if device.type != "cuda" or (compiled_only and interpreting()):
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)
