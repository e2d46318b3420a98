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


def _capture_refused_rank(rank, world_size):
    from unittest import mock

    import torch.distributed as dist

    from tpfuse.strategies.base import StrategyContext
    from tpfuse.strategies.ring import RingStrategy

    ring = RingStrategy(StrategyContext(dist.group.WORLD, rank, world_size, None, None, torch.device("cpu"),
                                        {"timeout_s": 5.0}))
    ring._stage = True  # as for CUDA tensors over gloo; the staging copies are no-ops on CPU tensors
    x, res, w = small_integer_inputs(rank, 1, H, torch.bfloat16), small_integer_inputs(50, 1, H, torch.bfloat16), \
        _weight(torch.bfloat16, True)
    refusals = []
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.is_current_stream_capturing", return_value=True):
        for call in (lambda: ring.all_reduce(x), lambda: ring.all_reduce_residual_rmsnorm(x, res, w, 1e-6)):
            try:
                call()
                refusals.append("")
            except RuntimeError as exc:
                refusals.append(str(exc))
    after = ring.all_reduce_residual_rmsnorm(x, res, w, 1e-6)  # still in step: the next eager call is served
    ring.check()
    ring.close()
    return refusals, after


def test_ring_staged_through_the_host_refuses_graph_capture_on_every_rank_before_any_exchange():
    """One token over two ranks: rank 1 sends an empty chunk at the first step. Were the refusal
    left to the staging copy, rank 0's copy would fail at once while rank 1 posted its receive and
    waited: the ranks would part ways. Refused at the op's entry, both raise and stay in step."""
    results = run_ranks(_capture_refused_rank, 2, timeout_s=120)
    want = all_reduce_residual_rmsnorm_ref([small_integer_inputs(r, 1, H, torch.bfloat16) for r in range(2)],
                                           small_integer_inputs(50, 1, H, torch.bfloat16),
                                           _weight(torch.bfloat16, True))
    for refusals, after in results:
        assert len(refusals) == 2 and all("a CUDA graph cannot capture" in r for r in refusals), refusals
        assert all(torch.equal(a, b) for a, b in zip(after, want))
