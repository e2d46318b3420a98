"""GPU tier, fail-stop: under every fault a peer-kernel call raises or returns correct data.

Ranks are processes sharing one GPU over gloo (CUDA IPC buffers), as in test_gpu.py. Each case
builds the expected values from the inputs every rank can rebuild, and accepts only two outcomes
per element: the correct value, or NaN with an error from the call or from `check()`.
"""

import time

import pytest
import torch

from tpfuse.reference import all_reduce_residual_rmsnorm_ref, small_integer_inputs
from tpfuse.spawn import run_ranks

pytestmark = pytest.mark.gpu
ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
H = 1024


def _call(comm, value, tokens=4):
    """One allreduce of a constant `value` (exact in bf16): (result on the host, error or None)."""
    from tpfuse.strategies.workspace import PeerTimeoutError

    x = torch.full((tokens, H), float(value), dtype=torch.bfloat16, device="cuda")
    try:
        y = comm.all_reduce(x)
        comm.check()
        return y.float().cpu(), None
    except PeerTimeoutError as exc:
        return None, exc


def _straggler_rank(rank, world_size, name):
    import torch.distributed as dist

    from tpfuse import Communicator

    torch.cuda.set_device(0)
    seen = []
    with Communicator(strategy=name, device="cuda", timeout_s=2.0) as comm:
        comm.prepare(hidden=H, dtype=torch.bfloat16, max_tokens=8)
        dist.barrier()
        if rank == 1:
            time.sleep(4.0)  # past the peers' timeout: they give up on call 0
            seen.append(_call(comm, 10))
        else:
            for value in range(2, 8):  # calls 0..5; rank 1 makes only one, late
                seen.append(_call(comm, value))
        dist.barrier()
    return [(None if y is None else y.unique().tolist(), None if e is None else e.code) for y, e in seen]


@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_straggler_after_timeout_gets_an_error_or_correct_data(name):
    results = run_ranks(_straggler_rank, 2, args=(name,), env=ENV, timeout_s=300)
    (late_values, late_code), = results[1]
    # the only correct value for rank 1's single call is 10 + rank 0's call-0 value (2)
    assert late_code is not None or late_values == [12.0], (late_values, late_code)
    assert late_values is None or late_values in ([12.0],), late_values
    for values, code in results[0]:
        assert code is not None or values == [12.0], (values, code)  # never a sum of other calls


def _skew_rank(rank, world_size, name):
    from tpfuse import Communicator

    torch.cuda.set_device(0)
    outs = []
    with Communicator(strategy=name, device="cuda", timeout_s=10.0) as comm:
        comm.prepare(hidden=H, dtype=torch.bfloat16, max_tokens=8)
        for i in range(6):
            if rank == 1 and i == 2:
                time.sleep(0.5)  # one rank a call behind the others, well within the timeout
            x = small_integer_inputs(rank, 3, H, torch.bfloat16, seed=i, device="cuda")
            outs.append(comm.all_reduce(x).cpu())
        comm.check()
    return outs


@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_rank_skewed_by_one_call_still_sums_matching_calls(name):
    results = run_ranks(_skew_rank, 3, args=(name,), env=ENV, timeout_s=300)
    for i in range(6):
        want = sum(small_integer_inputs(r, 3, H, torch.bfloat16, seed=i).float() for r in range(3)).bfloat16()
        for rank in range(3):
            assert torch.equal(results[rank][i], want), (i, rank)


def _negative_zero_rank(rank, world_size, name):
    from tpfuse import Communicator

    torch.cuda.set_device(0)
    x = small_integer_inputs(rank, 5, H, torch.bfloat16, seed=3)
    x[:, ::3] = -0.0  # payloads of -0.0 (the sentinel's bit pattern) on every rank
    res = small_integer_inputs(100, 5, H, torch.bfloat16, seed=3)
    res[:, ::3] = -0.0
    w = small_integer_inputs(101, 1, H, torch.bfloat16, seed=3)[0]
    with Communicator(strategy=name, device="cuda", timeout_s=5.0) as comm:
        comm.prepare(hidden=H, dtype=torch.bfloat16, max_tokens=8)
        got = comm.all_reduce_residual_rmsnorm(x.cuda(), res.cuda(), w.cuda())
        comm.check()
    return tuple(t.cpu() for t in got), x, res, w


@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_negative_zero_payloads_are_delivered(name):
    results = run_ranks(_negative_zero_rank, 2, args=(name,), env=ENV, timeout_s=300)
    xs = [r[1] for r in results]
    ref = all_reduce_residual_rmsnorm_ref(xs, results[0][2], results[0][3])
    for (normed, new_res), *_ in results:
        assert torch.equal(new_res, ref[1]) and torch.equal(normed, ref[0])  # -0.0 == +0.0 by value


def _after_capture_rank(rank, world_size, name):
    from tpfuse import Communicator

    torch.cuda.set_device(0)
    outs = []
    with Communicator(strategy=name, device="cuda", timeout_s=10.0) as comm:
        comm.prepare(hidden=H, dtype=torch.bfloat16, max_tokens=8)
        x = torch.zeros(8, H, dtype=torch.bfloat16, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            comm.all_reduce(x)  # warm-up on the capture's stream
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = comm.all_reduce(x)
        for step in range(3):
            x.copy_(small_integer_inputs(rank, 8, H, torch.bfloat16, seed=step))
            graph.replay()
            outs.append(y.cpu())
            big = small_integer_inputs(rank, 64, H, torch.bfloat16, seed=10 + step, device="cuda")
            outs.append(comm.all_reduce(big).cpu())  # does not fit: the unfused path, no reallocation
        comm.check()
        (strategy,) = comm._instances.values()
        assert len(strategy._workspaces) == 1
    return outs


@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_larger_eager_call_after_capture_takes_the_unfused_path(name):
    results = run_ranks(_after_capture_rank, 2, args=(name,), env=ENV, timeout_s=300)
    for step in range(3):
        small = sum(small_integer_inputs(r, 8, H, torch.bfloat16, seed=step).float() for r in range(2)).bfloat16()
        big = sum(small_integer_inputs(r, 64, H, torch.bfloat16, seed=10 + step).float() for r in range(2)).bfloat16()
        for rank in range(2):
            assert torch.equal(results[rank][2 * step], small) and torch.equal(results[rank][2 * step + 1], big)


def _two_streams_rank(rank, world_size, name):
    from tpfuse import Communicator

    torch.cuda.set_device(0)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    with Communicator(strategy=name, device="cuda", timeout_s=10.0) as comm:
        comm.prepare(hidden=H, dtype=torch.bfloat16, max_tokens=8)
        xs = [small_integer_inputs(rank, 4, H, torch.bfloat16, seed=i, device="cuda") for i in range(8)]
        torch.cuda.synchronize()
        ys = []
        for i, x in enumerate(xs):  # alternate streams with no synchronisation in between
            with torch.cuda.stream(streams[i % 2]):
                ys.append(comm.all_reduce(x))
        torch.cuda.synchronize()
        outs = [y.cpu() for y in ys]
        comm.check()
    return outs


@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_two_streams_on_one_workspace_are_ordered(name):
    results = run_ranks(_two_streams_rank, 2, args=(name,), env=ENV, timeout_s=300)
    for i in range(8):
        want = sum(small_integer_inputs(r, 4, H, torch.bfloat16, seed=i).float() for r in range(2)).bfloat16()
        for rank in range(2):
            assert torch.equal(results[rank][i], want), (i, rank)
