"""A QuantOutput as bytes: what spawned ranks return and the tests compare with the reference's."""

from __future__ import annotations

import contextlib

import torch


def pack(result):
    """Bytes and layout of every output (float8 storages do not pickle between processes)."""
    out = []
    for t in result:
        out.append(None if t is None
                   else (str(t.dtype), tuple(t.shape), t.stride(), t.contiguous().view(torch.uint8).clone()))
    return out


@contextlib.contextmanager
def poisoned_empty():
    """Within it, every fresh uint8 buffer from torch.empty holds 0xAB and every fp32 one NaN (not
    whatever the allocator held, often zeros): a byte a kernel leaves unwritten shows."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.dtype == torch.uint8:
            t.fill_(0xAB)
        elif t.dtype == torch.float32:
            t.fill_(float("nan"))
        return t

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = empty
