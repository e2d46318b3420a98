"""Test tiers: plain CPU, Triton interpreter, gloo multi-process, `gpu`, `multi_gpu`.

`gpu` tests skip unless torch sees a CUDA GPU; `multi_gpu` tests skip unless it sees two or more.
Each skip names the exact reason.
"""

from __future__ import annotations

import pytest


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def pytest_collection_modifyitems(config, items):
    count = _cuda_count()
    for item in items:
        if "multi_gpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"multi_gpu: needs >= 2 CUDA GPUs, torch sees {count}"))
        elif "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="gpu: needs a CUDA GPU, torch sees none"))
