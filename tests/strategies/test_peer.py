"""The peer strategies (`tpfuse.strategies.peer`: `oneshot`, `twoshot`) end to end, and their
fail-stop guarantees: under every fault a call raises or returns correct data. Their admission from
capabilities, with the reasons, beside the unfused `nccl_epilogue` baseline (plain tier).

Interpreter tier: spawned CPU ranks (TRITON_INTERPRET=1; kernel imports only inside the ranks).
GPU tier: processes sharing one GPU over gloo, mapping each other's buffers through CUDA IPC
(symmetric memory with overlapping devices allowed), the production path except for the fabric.
Start MPS first for speed (benchmarks/device/peer_and_quant.sh does); without it the processes
time-slice the GPU, which the timeouts here allow. Every output is poisoned with NaN before each
call. Each fault case accepts only two outcomes per element: the correct value, or NaN with an
error from the call or from `check()`.
"""

import dataclasses
import time

import pytest
import torch

from support.caps import fake_caps
from support.peer import GPU_ENV, INTERP, check_quantized, cpu_strategy
from tpfuse.reference import (
    TOLERANCE,
    all_reduce_ref,
    all_reduce_residual_rmsnorm_ref,
    random_inputs,
    relative_error,
    small_integer_inputs,
)
from tpfuse.spawn import run_ranks
from tpfuse.spec import GroupFacts, Op, Problem
from tpfuse.strategies import admission, get_strategy

H = 1024


def _poison_cache(nbytes: int) -> None:
    """Leave NaN in the caching allocator's free blocks, so fresh outputs start as NaN."""
    torch.empty(nbytes // 4 + 1, dtype=torch.float32, device="cuda").fill_(float("nan"))


def test_pdl_option_is_checked_against_shared_gpus():
    from tpfuse.spec import GroupFacts
    from tpfuse.strategies.base import StrategyContext
    from tpfuse.strategies.oneshot import OneShotStrategy

    shared = GroupFacts(world_size=2, backend="gloo", device_type="cpu", devices=("gpu0", "gpu0"), shares_device=True)
    with pytest.raises(ValueError, match="deadlocks when ranks share a GPU"):
        OneShotStrategy(StrategyContext(None, 0, 2, shared, None, torch.device("cpu"), {"pdl": "early"}))
    with pytest.raises(ValueError, match="pdl='auto'"):
        OneShotStrategy(StrategyContext(None, 0, 2, shared, None, torch.device("cpu"), {"pdl": "sometimes"}))
    auto = OneShotStrategy(StrategyContext(None, 0, 2, shared, None, torch.device("cpu"), {}))
    assert auto.launch_options.pdl == 1 and auto.ranks_per_device == 2  # the end trigger where ranks share a GPU
    own = GroupFacts(world_size=2, backend="gloo", device_type="cpu", devices=("gpu0", "gpu1"))
    assert OneShotStrategy(StrategyContext(None, 0, 2, own, None, torch.device("cpu"), {})).launch_options.pdl == 2


# ---- timeouts ----------------------------------------------------------------------------------

def _poisoned(result) -> bool:
    """Whether a failed call's outputs are all NaN: the normed rows, or the quantized output's
    scales (and FP8 codes: e4m3 NaN is 0x7F / 0xFF)."""
    from tpfuse.quant import QuantOutput

    if not isinstance(result, QuantOutput):
        return bool(torch.isnan(result[0]).all())
    scale = result.scale.float()
    if result.out.dtype == torch.uint8:  # NVFP4: e2m1 has no NaN; the real blocks' scales are NaN
        m, k = result.residual.shape[0], result.residual.shape[1] // 16
        return bool(torch.isnan(scale[:m, :k]).all())
    return bool(torch.isnan(scale).all() and ((result.out.view(torch.uint8) & 0x7F) == 0x7F).all())


def _timeout_rank(rank, world_size, name, absent, quant=None):
    import torch.distributed as dist

    from tpfuse.strategies.workspace import PeerTimeoutError

    # One program per rank: the interpreter runs a rank's programs one after another, so with
    # several, a later program's pushes would wait behind an earlier program's timeout and the
    # peers would (correctly) name this rank too. On a GPU the programs run concurrently.
    strategy = cpu_strategy(name, rank, world_size, timeout_s=0.2, max_programs=1)
    strategy.prepare(hidden=32, dtype=torch.float32, max_tokens=4)
    outcome = None
    if rank != absent:
        x = small_integer_inputs(rank, 3, 32, torch.float32)
        result = strategy.all_reduce_residual_rmsnorm(x, x, torch.ones(32), 1e-6, quant=quant)
        try:
            strategy.check()
        except PeerTimeoutError as exc:
            outcome = (exc.code, exc.ranks, str(exc), _poisoned(result))
            try:  # the next call refuses to run on the broken workspace
                strategy.all_reduce_residual_rmsnorm(x, x, torch.ones(32), 1e-6)
            except PeerTimeoutError:
                outcome += ("next call refused",)
    dist.barrier()
    strategy.close()  # every rank, the absent one included, can still shut down
    return outcome


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("name, quant", [("oneshot", None), ("twoshot", None), ("oneshot", "fp8_per_token"),
                                         ("twoshot", "nvfp4")])
def test_absent_rank_times_out_with_its_name(name, quant):
    """Survivors name the absent rank, return NaN (quantized output: NaN scales) and refuse the next call."""
    from tpfuse import quant as Q
    from tpfuse.kernels.protocol import ERR_ABORTED, ERR_TIMEOUT

    spec = {None: None, "fp8_per_token": Q.fp8_per_token(), "nvfp4": Q.nvfp4(2.0, swizzled=False)}[quant]
    results = run_ranks(_timeout_rank, 3, args=(name, 2, spec), env=INTERP, timeout_s=120)
    timed_out = {rank for rank in (0, 1) if results[rank][0] == ERR_TIMEOUT}
    assert timed_out, "at least one survivor must report the absent rank itself"
    for rank in (0, 1):
        code, ranks, message, all_nan, refused = results[rank]
        if code == ERR_TIMEOUT:  # it waited the whole timeout: it names the absent rank
            assert 2 in ranks and rank not in ranks and "2" in message.split("rank(s) ")[1], message
            if name == "oneshot":  # one-shot waits on the absent rank only; two-shot may also name an owner
                assert ranks == [2], ranks
        else:  # a survivor that gave up first told this rank, which stopped without waiting it out
            assert code == ERR_ABORTED and ranks and set(ranks) <= timed_out, message
            assert "gave up waiting first" in message
        assert all_nan, "a failed call must not return plausible data"
        assert refused == "next call refused"
    assert results[2] is None


# ---- -0.0 payloads and calls that do not fit ---------------------------------------------------

def _zeros_and_overflow_rank(rank, world_size, name):
    strategy = cpu_strategy(name, rank, world_size, timeout_s=5.0)
    strategy.prepare(hidden=32, dtype=torch.float32, max_tokens=4)
    (ws,) = strategy._workspaces.values()
    x = small_integer_inputs(rank, 3, 32, torch.float32, seed=1)
    x[:, ::2] = -0.0  # the sentinel's bit pattern as data, on every rank
    res = small_integer_inputs(100, 3, 32, torch.float32, seed=1)
    res[:, 1::4] = -0.0
    w = small_integer_inputs(101, 1, 32, torch.float32, seed=1)[0]
    zeros = strategy.all_reduce_residual_rmsnorm(x, res, w, 1e-6)
    big = small_integer_inputs(rank, 9, 32, torch.float32, seed=2)  # 9 tokens > the prepared 4
    over = strategy.all_reduce_residual_rmsnorm(big, small_integer_inputs(100, 9, 32, torch.float32, seed=2), w, 1e-6)
    again = strategy.all_reduce_residual_rmsnorm(x, res, w, 1e-6)  # the workspace still serves small calls
    strategy.check()
    same_workspace = strategy._workspaces[torch.float32] is ws
    strategy.close()
    return zeros, over, again, same_workspace



def _bucket_rank(rank, world_size, name):
    from tpfuse.kernels.peer_launch import PeerLaunch

    compiled = []
    compile_ = PeerLaunch.compile
    PeerLaunch.compile = lambda self: compiled.append((self.num_tokens, self.has_norm)) or compile_(self)
    strategy = cpu_strategy(name, rank, world_size, timeout_s=5.0)
    strategy.prepare_buckets(hidden=32, dtype=torch.float32, max_tokens=16, buckets=(2,),
                             op=Op.ALL_REDUCE_RESIDUAL_RMSNORM)
    fused_only = sorted(set(compiled))
    compiled.clear()
    strategy.prepare_buckets(hidden=32, dtype=torch.float32, max_tokens=16, buckets=(2,))
    per_bucket = sorted(set(compiled))
    x = small_integer_inputs(rank, 16, 32, torch.float32)
    served = type(strategy._route(strategy._workspace(torch.float32, 16, 32), 16, 32, torch.float32, True, True,
                                  None, compile_now=False)).__name__
    got = strategy.all_reduce_residual_rmsnorm(x, x, torch.ones(32), 1e-6)  # compiles its variant at this call
    strategy.check()
    compiled.clear()
    strategy.prepare(hidden=32, dtype=torch.float32, max_tokens=16)
    everything = sorted(set(compiled))
    strategy.close()
    PeerLaunch.compile = compile_
    return fused_only, per_bucket, served, everything, got


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_a_bucket_prepares_its_own_variants_in_a_workspace_sized_for_every_bucket(name):
    """tune measures bucket by bucket within a budget: preparing one bucket compiles only its
    kernel variants (of the op it measures, when named), and the workspace still takes the largest
    bucket (served by the peer kernel, not the unfused path)."""
    results = run_ranks(_bucket_rank, 2, args=(name,), env=INTERP, timeout_s=300)
    xs = [small_integer_inputs(r, 16, 32, torch.float32) for r in range(2)]
    for rank, (fused_only, per_bucket, served, everything, got) in enumerate(results):
        assert fused_only == [(2, True)], fused_only  # the fused op's forms of 2 tokens: no plain all_reduce
        assert per_bucket == [(2, False), (2, True)], per_bucket  # every form of 2 tokens, nothing else
        assert {m for m, _ in everything} - {2}, everything  # prepare() compiles the variants of other sizes too
        assert served == "_Fused", served  # 16 tokens fit the workspace a 2-token bucket allocated
        want = all_reduce_residual_rmsnorm_ref(xs, xs[rank], torch.ones(32))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_negative_zero_payloads_and_calls_that_do_not_fit(name):
    results = run_ranks(_zeros_and_overflow_rank, 2, args=(name,), env=INTERP, timeout_s=300)
    xs = []
    for r in range(2):
        x = small_integer_inputs(r, 3, 32, torch.float32, seed=1)
        x[:, ::2] = -0.0
        xs.append(x)
    res = small_integer_inputs(100, 3, 32, torch.float32, seed=1)
    res[:, 1::4] = -0.0
    w = small_integer_inputs(101, 1, 32, torch.float32, seed=1)[0]
    ref = all_reduce_residual_rmsnorm_ref(xs, res, w)
    bigs = [small_integer_inputs(r, 9, 32, torch.float32, seed=2) for r in range(2)]
    ref_big = all_reduce_residual_rmsnorm_ref(bigs, small_integer_inputs(100, 9, 32, torch.float32, seed=2), w)
    for zeros, over, again, same_workspace in results:
        for got in (zeros, again):  # -0.0 data was delivered (no timeout), equal by value to the reference
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        assert torch.equal(over[0], ref_big[0]) and torch.equal(over[1], ref_big[1])  # served unfused
        assert same_workspace  # never reallocated


# ---- quantized output through the peer strategies ----------------------------------------------

def _quant_specs():
    from tpfuse import quant as Q

    return [Q.fp8_static(0.125), Q.fp8_per_token(with_normed=True), Q.fp8_per_group(16, layout="col"),
            Q.nvfp4(40.0, swizzled=True)]


def _quant_rank(rank, world_size, name):
    from support.quant_output import pack as _pack

    strategy = cpu_strategy(name, rank, world_size, timeout_s=5.0)
    strategy.prepare(hidden=64, dtype=torch.bfloat16, max_tokens=4)
    x = small_integer_inputs(rank, 3, 64, torch.bfloat16, seed=4)
    res, w = (small_integer_inputs(100, 3, 64, torch.bfloat16, seed=4),
              small_integer_inputs(101, 1, 64, torch.bfloat16, seed=4)[0])
    outs = [_pack(strategy.all_reduce_residual_rmsnorm(x, res, w, 1e-6, quant=spec)) for spec in _quant_specs()]
    # at this decode size every format, NVFP4's software e2m1 included, was served by the peer kernel
    assert {type(strategy._routes[k]).__name__ for k in strategy._routes if k[-1] is not None} == {"_Fused"}
    assert len([k for k in strategy._routes if k[-1] is not None]) == len(_quant_specs())
    # a plan of more items than programs quantizes after the peer allreduce, in the epilogue
    strategy.plan_programs = 1
    strategy._routes.clear()  # routes are per shape: decided again with the new plan_programs
    outs += [_pack(strategy.all_reduce_residual_rmsnorm(x, res, w, 1e-6, quant=spec)) for spec in _quant_specs()]
    assert {type(strategy._routes[k]).__name__ for k in strategy._routes if k[-1] is not None} == {"_QuantizeAfter"}
    assert len([k for k in strategy._routes if k[-1] is not None]) == len(_quant_specs())
    strategy.check()
    strategy.close()
    return outs


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_peer_strategies_quantized_output_equals_the_reference(name):
    results = run_ranks(_quant_rank, 2, args=(name,), env=INTERP, timeout_s=300)
    xs = [small_integer_inputs(r, 3, 64, torch.bfloat16, seed=4) for r in range(2)]
    res, w = (small_integer_inputs(100, 3, 64, torch.bfloat16, seed=4),
              small_integer_inputs(101, 1, 64, torch.bfloat16, seed=4)[0])
    specs = _quant_specs()
    check_quantized(name, results, xs, res, w, specs + specs)  # in the kernel, then after it


def test_chunks_that_cut_scale_blocks_are_refused_by_the_kernels():
    """A plan whose chunks do not hold whole scale blocks is not quantized in the peer kernel: the
    strategy quantizes after the allreduce instead (`quantizes_in_kernel`)."""
    from tpfuse import quant as Q
    from tpfuse.kernels.protocol import Plan, make_plan, quantizes_in_kernel

    plan = Plan(chunk=128, num_chunks=2, items=2, num_warps=1)
    assert quantizes_in_kernel(plan, Q.fp8_per_group(128)) and not quantizes_in_kernel(plan, Q.fp8_per_group(256))
    assert quantizes_in_kernel(plan, Q.nvfp4(1.0)) and not quantizes_in_kernel(Plan(32, 4, 4, 1), Q.nvfp4(1.0))
    assert (quantizes_in_kernel(Plan(16, 4, 4, 1), Q.fp8_per_token())
            and quantizes_in_kernel(Plan(16, 4, 4, 1), Q.fp8_static(1.0)))
    for tokens in (1, 16, 4096):  # real plans: chunks of at least 128 elements hold every group <= 128
        for itemsize in (2, 4):
            plan = make_plan(tokens, 7168, itemsize, 128)
            assert all(quantizes_in_kernel(plan, spec) for spec in (Q.fp8_per_group(128), Q.nvfp4(1.0))), plan


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
                assert torch.equal(g.view(torch.uint8), results[0][i][j].view(torch.uint8)), (
                    f"rank {rank} differs from rank 0")
                if kind == "int" or mode == "ar" or j == 1:
                    assert torch.equal(g, r), f"call {i} ({m} {kind} {mode}) output {j} differs from the reference"
                else:
                    assert relative_error(g, r64) <= TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_collective_processes_share_one_gpu(name, world_size):
    dtype = torch.bfloat16
    results = run_ranks(_collective_rank, world_size, args=(name, dtype, 3), env=GPU_ENV, timeout_s=400)
    _check_against_reference(results, world_size, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype", [("oneshot", torch.float16), ("twoshot", torch.float32)])
def test_collective_other_dtypes(name, dtype):
    results = run_ranks(_collective_rank, 2, args=(name, dtype, 1), env=GPU_ENV, timeout_s=400)
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


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_cuda_graph_capture_and_replay(name):
    world_size = 2
    results = run_ranks(_graph_rank, world_size, args=(name,), env=GPU_ENV, timeout_s=400)
    m, h, dtype = 24, 4096, torch.bfloat16
    k = 0
    for step in range(6):
        xs = [small_integer_inputs(r, m, h, dtype, seed=step) for r in range(world_size)]
        ref = all_reduce_residual_rmsnorm_ref(xs, small_integer_inputs(100, m, h, dtype, seed=step),
                                              small_integer_inputs(101, m, h, dtype, seed=step)[0])
        for _ in range(2 if step % 2 else 1):
            for rank in range(world_size):
                assert (torch.equal(results[rank][k][0], ref[0])
                        and torch.equal(results[rank][k][1], ref[1])), (step, rank)
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
            torch.cuda.synchronize()  # the failed kernel has finished (it waited out its timeout)
            try:  # the next eager call raises by itself: the kernel wrote the code to host-mapped memory
                comm.all_reduce_residual_rmsnorm(x, x, x[0])
                outcome = ("next call ran",)
            except PeerTimeoutError as exc:
                outcome = (exc.code, exc.ranks, str(exc), bool(torch.isnan(normed).all()))
            try:
                comm.check()
                outcome += ("check passed",)
            except PeerTimeoutError:
                outcome += ("check raised",)
        dist.barrier()
    return outcome  # leaving the with-block closed the Communicator on every rank


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_absent_rank_on_a_shared_gpu_times_out_with_its_name(name):
    """Survivors name the absent rank (or the survivor that gave up first) at their next eager
    call, without check(), and check() raises too."""
    from tpfuse.kernels.protocol import ERR_ABORTED, ERR_TIMEOUT

    results = run_ranks(_absent_rank, 3, args=(name, 2), env=GPU_ENV, timeout_s=300)
    timed_out = {rank for rank in (0, 1) if results[rank][0] == ERR_TIMEOUT}
    assert timed_out, "at least one survivor must report the absent rank itself"
    for rank in (0, 1):
        assert results[rank][0] != "next call ran", results[rank]
        code, ranks, message, all_nan, checked = results[rank]
        assert checked == "check raised"
        if code == ERR_TIMEOUT:
            assert 2 in ranks and rank not in ranks and "rank(s)" in message, message
        else:  # told by a survivor that gave up first: it names that survivor
            assert code == ERR_ABORTED and ranks and set(ranks) <= timed_out, message
        assert all_nan
    assert results[2] is None


# ---- faults on a shared GPU ------------------------------------------------------------------

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


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_straggler_after_timeout_gets_an_error_or_correct_data(name):
    results = run_ranks(_straggler_rank, 2, args=(name,), env=GPU_ENV, timeout_s=300)
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


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_rank_skewed_by_one_call_still_sums_matching_calls(name):
    results = run_ranks(_skew_rank, 3, args=(name,), env=GPU_ENV, timeout_s=300)
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


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_negative_zero_payloads_are_delivered(name):
    results = run_ranks(_negative_zero_rank, 2, args=(name,), env=GPU_ENV, timeout_s=300)
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


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_larger_eager_call_after_capture_takes_the_unfused_path(name):
    results = run_ranks(_after_capture_rank, 2, args=(name,), env=GPU_ENV, timeout_s=300)
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


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_two_streams_on_one_workspace_are_ordered(name):
    results = run_ranks(_two_streams_rank, 2, args=(name,), env=GPU_ENV, timeout_s=300)
    for i in range(8):
        want = sum(small_integer_inputs(r, 4, H, torch.bfloat16, seed=i).float() for r in range(2)).bfloat16()
        for rank in range(2):
            assert torch.equal(results[rank][i], want), (i, rank)


# ---- admission -----------------------------------------------------------------------------------

NAMES = ["nccl_epilogue", "oneshot", "twoshot"]
NCCL = GroupFacts(world_size=4, backend="nccl", device_type="cuda", devices=tuple(f"GPU-{i}" for i in range(4)),
                  peer_access=True)
SHARED = GroupFacts(world_size=2, backend="gloo", device_type="cuda", devices=("GPU-0", "GPU-0"), peer_access=True,
                    shares_device=True)
CPU = GroupFacts(world_size=2, backend="gloo", device_type="cpu", devices=("cpu", "cpu"))


def _problem(group, tokens=8, hidden=6144, dtype="bfloat16", op=Op.ALL_REDUCE_RESIDUAL_RMSNORM):
    return Problem(op, tokens, hidden, dtype, group)


def test_all_admitted_on_nccl_gpus_with_peer_access():
    verdicts = admission(_problem(NCCL), fake_caps(4), NAMES)
    assert all(v.ok for v in verdicts.values()), verdicts
    assert get_strategy("oneshot").fused and get_strategy("twoshot").fused
    assert not get_strategy("nccl_epilogue").fused  # two kernels: the unfused baseline


def test_ranks_sharing_one_gpu_over_gloo_admit_peer_strategies_only():
    verdicts = admission(_problem(SHARED), fake_caps(1), NAMES)
    assert verdicts["oneshot"].ok and verdicts["twoshot"].ok
    assert "needs the NCCL process-group backend" in verdicts["nccl_epilogue"].reason


@pytest.mark.parametrize(
    "group, caps, problem_kw, reason",
    [
        (CPU, fake_caps(0), {}, "needs CUDA tensors"),
        (dataclasses.replace(NCCL, peer_access=False), fake_caps(4), {}, "needs peer access"),
        (dataclasses.replace(NCCL, num_hosts=2), fake_caps(4), {}, "spans 2 hosts"),
        (NCCL, fake_caps(4), {"hidden": 6148}, "rows of 12296 bytes are not a multiple of 16"),
        (NCCL, fake_caps(4), {"hidden": 6146, "dtype": "float32"}, "hidden % 4 == 0 for float32"),
        (NCCL, fake_caps(4), {"hidden": 20480}, "exceeds 16384"),
        (NCCL, fake_caps(4), {"tokens": 4096, "hidden": 8192}, "exceeds the limit of 16777216 bytes"),
        (NCCL, fake_caps(4), {"dtype": "float64"}, "dtype float64 not supported"),
    ],
)
def test_peer_strategies_refuse_with_the_reason(group, caps, problem_kw, reason):
    for name in ("oneshot", "twoshot"):
        verdict = get_strategy(name).admits(_problem(group, **problem_kw), caps)
        assert not verdict.ok and reason in verdict.reason, (name, verdict.reason)


def test_plain_allreduce_is_admitted_too():
    for name in NAMES:
        assert get_strategy(name).admits(_problem(NCCL, op=Op.ALL_REDUCE), fake_caps(4)).ok
