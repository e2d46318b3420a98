"""The ring strategy against the reference on 3 gloo ranks (odd world size, fewer rows than ranks)."""

import pytest
import torch

from tpfuse.reference import (
    TOLERANCE,
    all_reduce_ref,
    all_reduce_residual_rmsnorm_ref,
    random_inputs,
    relative_error,
    small_integer_inputs,
)
from tpfuse.spawn import run_ranks

pytestmark = pytest.mark.gloo

H = 40
TOKENS = (1, 2, 5)


def _weight(dtype, exact):
    gen = torch.Generator().manual_seed(9)
    w = torch.randint(1, 4, (H,), generator=gen) if exact else 1 + 0.1 * torch.randn(H, generator=gen)
    return w.to(dtype)


def _ring_rank(rank, world_size):
    from tpfuse import Communicator

    out = {}
    with Communicator(strategy="ring") as comm:
        for dtype in (torch.bfloat16, torch.float32):
            for tokens in TOKENS:
                for kind, make in (("exact", small_integer_inputs), ("random", random_inputs)):
                    x = make(rank, tokens, H, dtype)
                    res = make(50, tokens, H, dtype)
                    w = _weight(dtype, kind == "exact")
                    out[(kind, dtype, tokens, "ar")] = comm.all_reduce(x)
                    out[(kind, dtype, tokens, "fused")] = comm.all_reduce_residual_rmsnorm(x, res, w)
                    out[(kind, dtype, tokens, "first")] = comm.all_reduce_residual_rmsnorm(x, None, w)
    return out


def test_ring_matches_the_reference_and_returns_identical_bits_on_every_rank():
    results = run_ranks(_ring_rank, 3, timeout_s=120)
    for key, got in results[0].items():
        kind, dtype, tokens, what = key
        make = small_integer_inputs if kind == "exact" else random_inputs
        xs = [make(r, tokens, H, dtype) for r in range(3)]
        res, w = make(50, tokens, H, dtype), _weight(dtype, kind == "exact")
        if what == "ar":
            want = (all_reduce_ref(xs),)
            got = (got,)
        else:
            want = all_reduce_residual_rmsnorm_ref(xs, res if what == "fused" else None, w)
        for r in (1, 2):  # every rank holds the same bits
            other = results[r][key] if isinstance(results[r][key], tuple) else (results[r][key],)
            assert all(torch.equal(a, b) for a, b in zip(got, other)), key
        if kind == "exact":
            assert all(torch.equal(g, ref) for g, ref in zip(got, want)), key
            continue
        xs64 = [t.double() for t in xs]
        if what == "ar":
            want64 = (all_reduce_ref(xs64, acc_dtype=torch.float64),)
        else:
            want64 = all_reduce_residual_rmsnorm_ref(xs64, res.double() if what == "fused" else None, w.double(),
                                                     acc_dtype=torch.float64)
        for g, ref in zip(got, want64):
            assert relative_error(g, ref) <= TOLERANCE[dtype], key
