"""A stand-in for what the probe reads of torch: the CUDA version, device properties and peer access.

`peers=None` makes every peer query raise, as a broken driver does; otherwise (a, b) in `peers` has
peer access."""

from __future__ import annotations

from types import SimpleNamespace


def fake_torch(props=(), *, cuda="13.0", peers=None):
    def can_access(a, b):
        if peers is None:
            raise RuntimeError("peer query failed")
        return (a, b) in peers

    cuda_ns = SimpleNamespace(
        is_available=lambda: bool(props), device_count=lambda: len(props),
        get_device_properties=lambda i: props[i], can_device_access_peer=can_access,
    )
    return SimpleNamespace(__version__="2.11.0+cu130", version=SimpleNamespace(cuda=cuda), cuda=cuda_ns)
