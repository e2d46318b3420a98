"""GPU tier: the kernels on one GPU; one-shot and two-shot with 2 and 4 processes sharing it.

The processes talk over gloo and map each other's buffers through CUDA IPC (symmetric memory with
overlapping devices allowed), the production path except for the fabric. Start MPS first for
speed (benchmarks/device/gpu_check_kernels.py does); without it the processes time-slice the GPU and
each collective call takes up to a fraction of a second, which the timeouts here allow.
Every output is poisoned with NaN before each call (through the launchers' `out=` buffers, or by
leaving NaN in the allocator's cache before an API call that allocates).
"""

import pytest
import torch

from tpfuse.reference import (
    TOLERANCE,
    all_reduce_ref,
    all_reduce_residual_rmsnorm_ref,
    random_inputs,
    relative_error,
    residual_rmsnorm_ref,
    small_integer_inputs,
)
from tpfuse.spawn import run_ranks

pytestmark = pytest.mark.gpu
ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
HIDDENS = (2880, 4096, 5120, 6144, 7168, 8192, 16384, 100)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _poison_cache(nbytes: int) -> None:
    """Leave NaN in the caching allocator's free blocks, so fresh outputs start as NaN."""
    torch.empty(nbytes // 4 + 1, dtype=torch.float32, device="cuda").fill_(float("nan"))


# Every hidden size in bf16; the other dtypes on the awkward sizes (each case is a compile).
EPILOGUE_CASES = [(h, torch.bfloat16) for h in HIDDENS] + [(h, d) for h in (100, 2880, 16384) for d in (torch.float16, torch.float32)]


@pytest.mark.parametrize("hidden, dtype", EPILOGUE_CASES)
def test_epilogue_on_gpu(hidden, dtype):
    from tpfuse.kernels.epilogue import residual_rmsnorm

    for kind, tokens in (("int", 7), ("rand", 33), ("rand", 1)):
        make = small_integer_inputs if kind == "int" else random_inputs
        s, res, w = (make(r, tokens, hidden, dtype, seed=hidden) for r in (0, 1, 2))
        w = w[0] if kind == "int" else (1 + 0.1 * w[0].float()).to(dtype)
        for residual in (res, None):
            nan = torch.full((tokens, hidden), float("nan"), dtype=dtype, device="cuda")
            normed, new_res = residual_rmsnorm(s.cuda(), None if residual is None else residual.cuda(), w.cuda(), 1e-6,
                                               out=(nan.clone(), nan.clone()))
            ref_normed, ref_new = residual_rmsnorm_ref(s, residual, w, 1e-6)
            assert torch.equal(new_res.cpu(), ref_new)
            if kind == "int":
                assert torch.equal(normed.cpu(), ref_normed)
            else:
                ref64 = residual_rmsnorm_ref(s, residual, w, 1e-6, acc_dtype=torch.float64)[0]
                assert relative_error(normed, ref64) <= TOLERANCE[dtype]


def test_custom_op_under_torch_compile():
    import tpfuse.kernels.custom_ops  # noqa: F401  (registers torch.ops.tpfuse.*)

    def layer(s, res, w):
        normed, new_res = torch.ops.tpfuse.residual_rmsnorm(s * 2, res, w, 1e-6)
        return normed + 1, new_res

    compiled = torch.compile(layer, fullgraph=True)
    s, res, w = (random_inputs(r, 16, 4096, torch.bfloat16, device="cuda") for r in (0, 1, 2))
    got = compiled(s, res, w[0])
    want = layer(s, res, w[0])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref = residual_rmsnorm_ref((s * 2).cpu(), res.cpu(), w[0].cpu(), 1e-6)
    assert torch.equal(got[1].cpu(), ref[1])


def _nccl_epilogue_rank(rank, world_size):
    from tpfuse import Communicator

    out = []
    with Communicator(strategy="nccl_epilogue") as comm:
        for kind, dtype in (("int", torch.bfloat16), ("rand", torch.float16)):
            make = small_integer_inputs if kind == "int" else random_inputs
            x, res, w = (make(r, 9, 6144, dtype, device="cuda") for r in (rank, 100, 101))
            _poison_cache(4 * 9 * 6144 * 4)
            normed, new_res = comm.all_reduce_residual_rmsnorm(x, res, w[0])
            out.append((kind, dtype, normed.cpu(), new_res.cpu()))
    return out


def test_nccl_epilogue_world_size_one():
    (out,) = run_ranks(_nccl_epilogue_rank, 1, backend="nccl", env=ENV, timeout_s=300)
    for kind, dtype, normed, new_res in out:
        make = small_integer_inputs if kind == "int" else random_inputs
        x, res, w = (make(r, 9, 6144, dtype) for r in (0, 100, 101))
        ref = all_reduce_residual_rmsnorm_ref([x], res, w[0])
        assert torch.equal(new_res, ref[1])
        if kind == "int":
            assert torch.equal(normed, ref[0])
        else:
            ref64 = all_reduce_residual_rmsnorm_ref([x], res, w[0], acc_dtype=torch.float64)[0]
            assert relative_error(normed, ref64) <= TOLERANCE[dtype]


# ---- one-shot / two-shot, W processes on one GPU -------------------------------------------------

# (tokens, kind, mode): varying sizes (M < W included), residual / no residual / plain allreduce.
CALLS = [(1, "int", "res"), (8, "rand", "res"), (3, "int", "none"), (64, "int", "res"), (5, "rand", "ar"),
         (129, "rand", "res"), (2, "int", "ar"), (300, "int", "res")]
HIDDEN = 2880  # not a power of two


def _inputs(kind, rank, i, m, h, dtype, device="cpu"):
    make = small_integer_inputs if kind == "int" else random_inputs
    return make(rank, m, h, dtype, seed=i, device=device)


def _collective_rank(rank, world_size, name, dtype, rounds):
    import torch.distributed as dist

    from tpfuse import Communicator

    torch.cuda.set_device(0)
    outs = []
    with Communicator(strategy=name, device="cuda", timeout_s=20.0) as comm:
        comm.prepare(hidden=HIDDEN, dtype=dtype, max_tokens=512)
        for rnd in range(rounds):
            for i, (m, kind, mode) in enumerate(CALLS):
                x = _inputs(kind, rank, i, m, HIDDEN, dtype, "cuda")
                res = _inputs(kind, 100, i, m, HIDDEN, dtype, "cuda")
                w = _inputs(kind, 101, i, 1, HIDDEN, dtype, "cuda")[0]
                _poison_cache(4 * m * HIDDEN * 4)
                if mode == "ar":
                    got = (comm.all_reduce(x),)
                else:
                    got = comm.all_reduce_residual_rmsnorm(x, res if mode == "res" else None, w)
                if rnd == rounds - 1:
                    outs.append(tuple(t.cpu() for t in got))
        comm.check()
        dist.barrier()
    return outs


def _check_against_reference(results, world_size, dtype):
    for i, (m, kind, mode) in enumerate(CALLS):
        xs = [_inputs(kind, r, i, m, HIDDEN, dtype) for r in range(world_size)]
        res = _inputs(kind, 100, i, m, HIDDEN, dtype) if mode == "res" else None
        w = _inputs(kind, 101, i, 1, HIDDEN, dtype)[0]
        if mode == "ar":
            ref, ref64 = (all_reduce_ref(xs),), (all_reduce_ref(xs, acc_dtype=torch.float64),)
        else:
            ref = all_reduce_residual_rmsnorm_ref(xs, res, w)
            ref64 = all_reduce_residual_rmsnorm_ref(xs, res, w, acc_dtype=torch.float64)
        for rank in range(world_size):
            for j, (g, r, r64) in enumerate(zip(results[rank][i], ref, ref64)):
                assert torch.equal(g.view(torch.uint8), results[0][i][j].view(torch.uint8)), f"rank {rank} differs from rank 0"
                if kind == "int" or mode == "ar" or j == 1:
                    assert torch.equal(g, r), f"call {i} ({m} {kind} {mode}) output {j} differs from the reference"
                else:
                    assert relative_error(g, r64) <= TOLERANCE[dtype]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_collective_processes_share_one_gpu(name, world_size):
    dtype = torch.bfloat16
    results = run_ranks(_collective_rank, world_size, args=(name, dtype, 3), env=ENV, timeout_s=400)
    _check_against_reference(results, world_size, dtype)


@pytest.mark.parametrize("name, dtype", [("oneshot", torch.float16), ("twoshot", torch.float32)])
def test_collective_other_dtypes(name, dtype):
    results = run_ranks(_collective_rank, 2, args=(name, dtype, 1), env=ENV, timeout_s=400)
    _check_against_reference(results, 2, dtype)


def _graph_rank(rank, world_size, name):
    import torch.distributed as dist

    from tpfuse import Communicator

    torch.cuda.set_device(0)
    m, h, dtype = 24, 4096, torch.bfloat16
    outs = []
    with Communicator(strategy=name, device="cuda", timeout_s=20.0) as comm:
        comm.prepare(hidden=h, dtype=dtype, max_tokens=64)
        x, res, w = (torch.zeros(m, h, dtype=dtype, device="cuda") for _ in range(3))
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            comm.all_reduce_residual_rmsnorm(x.fill_(1), res, w[0])  # eager warm-up on the capture's stream family
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            normed, new_res = comm.all_reduce_residual_rmsnorm(x, res, w[0])
        for step in range(6):
            x.copy_(small_integer_inputs(rank, m, h, dtype, seed=step))
            res.copy_(small_integer_inputs(100, m, h, dtype, seed=step))
            w.copy_(small_integer_inputs(101, m, h, dtype, seed=step))
            normed.fill_(float("nan"))
            new_res.fill_(float("nan"))
            graph.replay()
            outs.append((normed.cpu(), new_res.cpu()))
            if step % 2:  # eager calls interleaved with replays share the device-side state
                e = comm.all_reduce_residual_rmsnorm(x, res, w[0])
                outs.append((e[0].cpu(), e[1].cpu()))
        comm.check()
        dist.barrier()
    return outs


@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_cuda_graph_capture_and_replay(name):
    world_size = 2
    results = run_ranks(_graph_rank, world_size, args=(name,), env=ENV, timeout_s=400)
    m, h, dtype = 24, 4096, torch.bfloat16
    k = 0
    for step in range(6):
        xs = [small_integer_inputs(r, m, h, dtype, seed=step) for r in range(world_size)]
        ref = all_reduce_residual_rmsnorm_ref(xs, small_integer_inputs(100, m, h, dtype, seed=step),
                                              small_integer_inputs(101, m, h, dtype, seed=step)[0])
        for _ in range(2 if step % 2 else 1):
            for rank in range(world_size):
                assert torch.equal(results[rank][k][0], ref[0]) and torch.equal(results[rank][k][1], ref[1]), (step, rank)
            k += 1


def _absent_rank(rank, world_size, name, absent):
    import torch.distributed as dist

    from tpfuse import Communicator
    from tpfuse.strategies.workspace import PeerTimeoutError

    torch.cuda.set_device(0)
    outcome = None
    with Communicator(strategy=name, device="cuda", timeout_s=1.0) as comm:
        comm.prepare(hidden=1024, dtype=torch.bfloat16, max_tokens=16)
        if rank != absent:
            x = small_integer_inputs(rank, 4, 1024, torch.bfloat16, device="cuda")
            normed, _ = comm.all_reduce_residual_rmsnorm(x, x, x[0])
            try:
                comm.check()
            except PeerTimeoutError as exc:
                outcome = (exc.code, exc.ranks, str(exc), bool(torch.isnan(normed).all()))
        dist.barrier()
    return outcome  # leaving the with-block closed the Communicator on every rank


@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_absent_rank_times_out_with_its_name(name):
    from tpfuse.kernels.protocol import ERR_ABORTED, ERR_TIMEOUT

    results = run_ranks(_absent_rank, 3, args=(name, 2), env=ENV, timeout_s=300)
    timed_out = {rank for rank in (0, 1) if results[rank][0] == ERR_TIMEOUT}
    assert timed_out, "at least one survivor must report the absent rank itself"
    for rank in (0, 1):
        code, ranks, message, all_nan = results[rank]
        if code == ERR_TIMEOUT:
            assert 2 in ranks and rank not in ranks and "rank(s)" in message, message
        else:  # told by a survivor that gave up first: it names that survivor
            assert code == ERR_ABORTED and ranks and set(ranks) <= timed_out, message
        assert all_nan
    assert results[2] is None
