"""A QuantOutput as bytes: what spawned ranks return and the tests compare with the reference's."""

from __future__ import annotations

import torch


def pack(result):
    """Bytes and layout of every output (float8 storages do not pickle between processes)."""
    out = []
    for t in result:
        out.append(None if t is None
                   else (str(t.dtype), tuple(t.shape), t.stride(), t.contiguous().view(torch.uint8).clone()))
    return out
