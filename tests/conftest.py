"""Test tiers, one marker each (registered in pyproject.toml; `pytest -m <tier>` selects one):

- `plain`: plain CPU tier: no spawned ranks, no Triton interpreter, no GPU (every test without another tier marker)
- `interpreter`: Triton interpreter tier: Triton kernels on the CPU through TRITON_INTERPRET=1
- `gloo`: gloo multi-process tier: ranks spawned on the CPU over gloo (by the test or by the command it runs)
- `gpu`: GPU tier: needs one CUDA GPU (skipped with the reason otherwise)
- `multi_gpu`: multi-GPU tier: needs two or more CUDA GPUs (skipped with the reason otherwise)

and `slow`: takes more than a few seconds on 2 CPU cores (any tier). A test carries at most one tier
marker (a GPU test whose ranks talk over gloo is `gpu`); this file gives `plain` to the rest.
`gpu` tests skip unless torch sees a CUDA GPU; `multi_gpu` tests skip unless it sees two or more.
Each skip names the exact reason.
"""

from __future__ import annotations

import pytest

TIERS = ("plain", "interpreter", "gloo", "gpu", "multi_gpu")
MARKERS = TIERS + ("slow",)


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def pytest_configure(config):
    registered = {line.split(":", 1)[0].strip() for line in config.getini("markers")}
    if registered != set(MARKERS):
        raise pytest.UsageError(f"tests/conftest.py: pyproject.toml registers the markers {sorted(registered)}, "
                                f"this file describes {sorted(MARKERS)}; "
                                "make [tool.pytest.ini_options] markers and this file agree")


def pytest_collection_modifyitems(config, items):
    count = _cuda_count()
    for item in items:
        tiers = [tier for tier in TIERS if item.get_closest_marker(tier)]
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid}: has the tier markers {tiers}; keep the one whose machine it needs")
        if not tiers:
            item.add_marker(pytest.mark.plain)
        if "multi_gpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"multi_gpu: needs >= 2 CUDA GPUs, torch sees {count}"))
        elif "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="gpu: needs a CUDA GPU, torch sees none"))
