"""The real Triton kernels on CPU through TRITON_INTERPRET=1, one spawned process per rank.

TRITON_INTERPRET must be set before a kernel module is imported, so every kernel import happens
inside the spawned workers (tpfuse.spawn.run_ranks sets the environment first) and this module imports
none. Peer buffers are shared-memory files mapped by every rank's process, the CPU stand-in for
CUDA IPC (tpfuse.strategies.workspace). x86 ordering is stronger than a GPU's: these tests check
the protocol's logic (slots, re-arming, extents, fixed order, timeouts), not memory ordering.
Shapes are tiny (H <= 96, M <= 9) because the interpreter runs every program in Python.
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

pytestmark = pytest.mark.interpreter

INTERP = {"TRITON_INTERPRET": "1"}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _nan_pair(like):
    return torch.full_like(like, float("nan")), torch.full_like(like, float("nan"))


# ---- epilogue ----------------------------------------------------------------------------------

def _epilogue_rank(rank, world_size, cases):
    from tpfuse.kernels.custom_ops import residual_rmsnorm_op
    from tpfuse.kernels.epilogue import residual_rmsnorm

    results = []
    for kind, dtype, m, h, with_res in cases:
        make = small_integer_inputs if kind == "int" else random_inputs
        s = make(0, m, h, dtype, seed=h)
        res = make(1, m, h, dtype, seed=h) if with_res else None
        w = (1 + 0.1 * random_inputs(2, 1, h, torch.float32, seed=h)[0]).to(dtype) if kind != "int" else make(2, 1, h, dtype)[0]
        out = residual_rmsnorm(s, res, w, 1e-6, out=_nan_pair(s))
        op_out = residual_rmsnorm_op(s, res, w, 1e-6)
        results.append((s, res, w, out, op_out))
    return results


def test_epilogue_matches_reference_in_interpreter():
    cases = [(kind, dtype, m, h, with_res)
             for kind in ("int", "rand") for dtype in DTYPES for (m, h) in ((3, 64), (2, 40)) for with_res in (True, False)]
    (results,) = run_ranks(_epilogue_rank, 1, args=(cases,), env=INTERP, timeout_s=120)
    for (kind, dtype, m, h, with_res), (s, res, w, (normed, new_res), op_out) in zip(cases, results):
        ref_normed, ref_new_res = residual_rmsnorm_ref(s, res, w, 1e-6)
        assert torch.equal(new_res, ref_new_res), (kind, dtype, h)  # the residual add is exact
        assert torch.equal(op_out[0], normed) and torch.equal(op_out[1], new_res)  # the custom op
        if kind == "int":
            assert torch.equal(normed, ref_normed), (dtype, h)  # exact sum of squares
        else:
            ref64 = residual_rmsnorm_ref(s, res, w, 1e-6, acc_dtype=torch.float64)[0]
            assert relative_error(normed, ref64) <= TOLERANCE[dtype], (dtype, h)


# ---- one-shot and two-shot ---------------------------------------------------------------------

def _strategy(name, rank, world_size, **options):
    import torch.distributed as dist

    from tpfuse.spec import GroupFacts
    from tpfuse.strategies import get_strategy
    from tpfuse.strategies.base import StrategyContext

    facts = GroupFacts(world_size=world_size, backend="gloo", device_type="cpu", devices=("cpu",) * world_size)
    ctx = StrategyContext(dist.group.WORLD, rank, world_size, facts, None, torch.device("cpu"), dict(options))
    return get_strategy(name)(ctx)


def _calls_rank(rank, world_size, name, dtype, h, calls):
    from tpfuse.kernels.oneshot import oneshot_launch
    from tpfuse.kernels.twoshot import twoshot_launch

    launch = oneshot_launch if name == "oneshot" else twoshot_launch
    strategy = _strategy(name, rank, world_size, timeout_s=5.0)
    strategy.prepare(hidden=h, dtype=dtype, max_tokens=max(m for m, _, _ in calls))
    (ws,) = strategy._workspaces.values()
    out = []
    for i, (m, kind, mode) in enumerate(calls):
        make = small_integer_inputs if kind == "int" else random_inputs
        x = make(rank, m, h, dtype, seed=i)
        res = make(100, m, h, dtype, seed=i) if mode == "res" else None
        w = make(101, 1, h, dtype, seed=i)[0]
        ws.before_call()
        got = launch(x, res, w, 1e-6, ws, timeout_s=5.0, max_programs=2, plan_programs=strategy.plan_programs,
                     has_norm=mode != "ar", out=_nan_pair(x))
        out.append(got)
    # the same first call once more through the torch.library op, which finds the strategy by handle
    from tpfuse.kernels.custom_ops import all_reduce_residual_rmsnorm_op

    m, kind, mode = calls[0]
    make = small_integer_inputs if kind == "int" else random_inputs
    x, res, w = make(rank, m, h, dtype, seed=0), make(100, m, h, dtype, seed=0), make(101, 1, h, dtype, seed=0)[0]
    op_out = all_reduce_residual_rmsnorm_op(x, res if mode == "res" else None, w, 1e-6, strategy.handle)
    strategy.check()
    strategy.close()
    return out, op_out


def _expected(world_size, dtype, h, i, m, kind, mode):
    make = small_integer_inputs if kind == "int" else random_inputs
    xs = [make(r, m, h, dtype, seed=i) for r in range(world_size)]
    res = make(100, m, h, dtype, seed=i) if mode == "res" else None
    w = make(101, 1, h, dtype, seed=i)[0]
    if mode == "ar":
        return (all_reduce_ref(xs),), (all_reduce_ref(xs, acc_dtype=torch.float64),)
    return all_reduce_residual_rmsnorm_ref(xs, res, w), all_reduce_residual_rmsnorm_ref(xs, res, w, acc_dtype=torch.float64)


def _check_calls(name, world_size, dtype, h, calls):
    results = run_ranks(_calls_rank, world_size, args=(name, dtype, h, calls), env=INTERP, timeout_s=300)
    for rank, (_, op_out) in enumerate(results):  # the custom op served the first call again, identically
        assert torch.equal(op_out[0], results[rank][0][0][0]) and torch.equal(op_out[1], results[rank][0][0][1])
    results = [calls_out for calls_out, _ in results]
    for i, (m, kind, mode) in enumerate(calls):
        ref, ref64 = _expected(world_size, dtype, h, i, m, kind, mode)
        for rank in range(world_size):
            got = results[rank][i][: len(ref)]
            for g, g0 in zip(got, results[0][i]):
                assert torch.equal(g.view(torch.uint8), g0.view(torch.uint8)), f"rank {rank} bits differ from rank 0 (call {i})"
            for j, (g, r, r64) in enumerate(zip(got, ref, ref64)):
                if kind == "int" or mode == "ar" or j == 1:
                    # the sum and new_residual are computed in fp32 in rank order 0..W-1, as the
                    # reference does: equal bits for every input; normed too on exact sums
                    assert torch.equal(g, r), f"{name} W={world_size} call {i} ({m}x{h} {kind} {mode}) output {j} differs"
                else:  # normed on random inputs: only the order of the sum of squares differs
                    assert relative_error(g, r64) <= TOLERANCE[dtype]


# Back-to-back calls with changing M (including M < W and the slot rotation several times over),
# changing inputs, with and without residual, and the plain allreduce.
CALLS = [(3, "int", "res"), (5, "rand", "res"), (1, "int", "none"), (4, "int", "ar"), (2, "rand", "res"), (7, "int", "res"), (1, "rand", "ar")]


@pytest.mark.slow
@pytest.mark.parametrize("name, dtype", [("oneshot", torch.bfloat16), ("twoshot", torch.bfloat16), ("oneshot", torch.float32)])
def test_two_ranks_back_to_back_calls(name, dtype):
    _check_calls(name, 2, dtype, 64, CALLS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_four_ranks(name):
    _check_calls(name, 4, torch.float16, 32, [(5, "int", "res"), (2, "rand", "res"), (9, "int", "ar"), (3, "int", "res")])


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
    strategy = _strategy(name, rank, world_size, timeout_s=0.2, max_programs=1)
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
    strategy = _strategy(name, rank, world_size, timeout_s=5.0)
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


# ---- rows split into several chunks (the norm's partials) --------------------------------------

def _forced_split(rank, world_size, name, h, chunk):
    """(launcher, strategy, its workspace, a plan of 3 rows cut into `chunk`-element items)."""
    from tpfuse.kernels.oneshot import oneshot_launch
    from tpfuse.kernels.protocol import Plan
    from tpfuse.kernels.twoshot import twoshot_launch

    strategy = _strategy(name, rank, world_size, timeout_s=5.0)
    strategy.prepare(hidden=h, dtype=torch.bfloat16, max_tokens=3)
    (ws,) = strategy._workspaces.values()
    num_chunks = -(-h // chunk)
    plan = Plan(chunk=chunk, num_chunks=num_chunks, items=3 * num_chunks, num_warps=1)
    return (oneshot_launch if name == "oneshot" else twoshot_launch), strategy, ws, plan


def _split_rank(rank, world_size, name, h, chunk):
    launch, strategy, ws, plan = _forced_split(rank, world_size, name, h, chunk)
    outs = []
    for i, kind in enumerate(("int", "rand", "int")):
        make = small_integer_inputs if kind == "int" else random_inputs
        x, res, w = make(rank, 3, h, torch.bfloat16, seed=i), make(100, 3, h, torch.bfloat16, seed=i), make(101, 1, h, torch.bfloat16, seed=i)[0]
        outs.append(launch(x, res, w, 1e-6, ws, timeout_s=5.0, max_programs=4, plan_programs=4, out=_nan_pair(x), plan=plan))
    strategy.check()
    strategy.close()
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_rows_split_over_chunks_match_the_reference(name):
    h, chunk = 40, 16  # three chunks a row, the last one partial
    results = run_ranks(_split_rank, 2, args=(name, h, chunk), env=INTERP, timeout_s=300)
    for i, kind in enumerate(("int", "rand", "int")):
        make = small_integer_inputs if kind == "int" else random_inputs
        xs = [make(r, 3, h, torch.bfloat16, seed=i) for r in range(2)]
        res, w = make(100, 3, h, torch.bfloat16, seed=i), make(101, 1, h, torch.bfloat16, seed=i)[0]
        ref = all_reduce_residual_rmsnorm_ref(xs, res, w)
        ref64 = all_reduce_residual_rmsnorm_ref(xs, res, w, acc_dtype=torch.float64)
        for rank in range(2):
            normed, new_res = results[rank][i]
            assert torch.equal(normed.view(torch.int16), results[0][i][0].view(torch.int16))
            assert torch.equal(new_res, ref[1])
            if kind == "int":
                assert torch.equal(normed, ref[0])
            else:
                assert relative_error(normed, ref64[0]) <= TOLERANCE[torch.bfloat16]


# ---- quantized output through the peer strategies ----------------------------------------------

def _quant_specs():
    from tpfuse import quant as Q

    return [Q.fp8_static(0.125), Q.fp8_per_token(with_normed=True), Q.fp8_per_group(16, layout="col"),
            Q.nvfp4(40.0, swizzled=True)]


def _quant_rank(rank, world_size, name):
    from tests.test_quant_gloo import _pack

    strategy = _strategy(name, rank, world_size, timeout_s=5.0)
    strategy.prepare(hidden=64, dtype=torch.bfloat16, max_tokens=4)
    x = small_integer_inputs(rank, 3, 64, torch.bfloat16, seed=4)
    res, w = small_integer_inputs(100, 3, 64, torch.bfloat16, seed=4), small_integer_inputs(101, 1, 64, torch.bfloat16, seed=4)[0]
    outs = [_pack(strategy.all_reduce_residual_rmsnorm(x, res, w, 1e-6, quant=spec)) for spec in _quant_specs()]
    # a plan of more items than programs quantizes after the peer allreduce, in the epilogue
    strategy.plan_programs = 1
    assert not strategy._quantizes_in_kernel(strategy._plan(3, 64, x.dtype), _quant_specs()[0])
    outs += [_pack(strategy.all_reduce_residual_rmsnorm(x, res, w, 1e-6, quant=spec)) for spec in _quant_specs()]
    strategy.check()
    strategy.close()
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_peer_strategies_quantized_output_equals_the_reference(name):
    results = run_ranks(_quant_rank, 2, args=(name,), env=INTERP, timeout_s=300)
    xs = [small_integer_inputs(r, 3, 64, torch.bfloat16, seed=4) for r in range(2)]
    res, w = small_integer_inputs(100, 3, 64, torch.bfloat16, seed=4), small_integer_inputs(101, 1, 64, torch.bfloat16, seed=4)[0]
    specs = _quant_specs()
    _check_quantized(name, results, xs, res, w, specs + specs)  # in the kernel, then after it


def _check_quantized(name, results, xs, res, w, specs):
    """Every rank's packed QuantOutputs (`tests.test_quant_gloo._pack`) equal the reference's, byte for byte."""
    from tests.test_quant_gloo import _pack

    from tpfuse.reference import all_reduce_residual_rmsnorm_quant_ref

    for i, spec in enumerate(specs):
        ref = _pack(all_reduce_residual_rmsnorm_quant_ref(xs, res, w, 1e-6, spec))
        for rank, result in enumerate(results):
            for part, g, r in zip(("out", "scale", "residual", "normed"), result[i], ref):
                assert (g is None) == (r is None), (spec.key, part)
                if g is not None:
                    assert g[:2] == r[:2] and torch.equal(g[3], r[3]), f"{name} rank {rank} {spec.key}: {part} differs"


def _split_quant_specs():
    from tpfuse import quant as Q

    return [Q.fp8_static(0.125), Q.fp8_per_token(with_normed=True), Q.fp8_per_token(scale_ub=0.004),
            Q.fp8_per_group(16, layout="col"), Q.fp8_per_group(32), Q.nvfp4(40.0, swizzled=True), Q.nvfp4(3.0)]


def _split_quant_rank(rank, world_size, name, h, chunk):
    from tests.test_quant_gloo import _pack

    launch, strategy, ws, plan = _forced_split(rank, world_size, name, h, chunk)
    x = small_integer_inputs(rank, 3, h, torch.bfloat16, seed=7)
    res, w = small_integer_inputs(100, 3, h, torch.bfloat16, seed=7), small_integer_inputs(101, 1, h, torch.bfloat16, seed=7)[0]
    outs = []
    inputs = [t.clone() for t in (x, res, w)]
    for spec in _split_quant_specs():
        normed = torch.full_like(x, float("nan"))  # poisoned: the kernel must write every element it returns
        got = launch(x, res, w, 1e-6, ws, timeout_s=5.0, max_programs=4, plan_programs=4, plan=plan, quant=spec,
                     out=(normed, None))
        outs.append(_pack(got))
        assert all(torch.equal(a, b) for a, b in zip(inputs, (x, res, w))), f"{spec.key} wrote into its inputs"
    # a plan whose chunks cut NVFP4's scale blocks is refused before any launch, with the fix
    from tpfuse import quant as Q
    from tpfuse.kernels.protocol import Plan

    try:
        launch(x, res, w, 1e-6, ws, timeout_s=5.0, max_programs=4, plan_programs=4, plan=Plan(32, -(-x.shape[1] // 32),
               3 * -(-x.shape[1] // 32), 1), quant=Q.nvfp4(1.0))
        outs.append("launched")
    except ValueError as exc:
        outs.append(str(exc))
    strategy.check()
    strategy.close()
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_split_rows_quantized_in_the_peer_kernel_equal_the_reference(name):
    """Rows of three 64-element chunks: per-token FP8 exchanges each row's absmax between its
    chunks, per-group and NVFP4 scale blocks fall inside chunks, swizzled padding is zeroed."""
    h, chunk = 192, 64
    results = run_ranks(_split_quant_rank, 2, args=(name, h, chunk), env=INTERP, timeout_s=600)
    xs = [small_integer_inputs(r, 3, h, torch.bfloat16, seed=7) for r in range(2)]
    res, w = small_integer_inputs(100, 3, h, torch.bfloat16, seed=7), small_integer_inputs(101, 1, h, torch.bfloat16, seed=7)[0]
    _check_quantized(name, results, xs, res, w, _split_quant_specs())
    for result in results:
        assert "do not hold whole nvfp4 scale blocks" in result[-1] and "residual_rmsnorm" in result[-1], result[-1]


def test_chunks_that_cut_scale_blocks_are_refused_by_the_kernels():
    """A plan whose chunks do not hold whole scale blocks is not quantized in the peer kernel: the
    strategy quantizes after the allreduce instead (`quantizes_in_kernel`)."""
    from tpfuse import quant as Q
    from tpfuse.kernels.protocol import Plan, make_plan, quantizes_in_kernel

    plan = Plan(chunk=128, num_chunks=2, items=2, num_warps=1)
    assert quantizes_in_kernel(plan, Q.fp8_per_group(128)) and not quantizes_in_kernel(plan, Q.fp8_per_group(256))
    assert quantizes_in_kernel(plan, Q.nvfp4(1.0)) and not quantizes_in_kernel(Plan(32, 4, 4, 1), Q.nvfp4(1.0))
    assert quantizes_in_kernel(Plan(16, 4, 4, 1), Q.fp8_per_token()) and quantizes_in_kernel(Plan(16, 4, 4, 1), Q.fp8_static(1.0))
    for tokens in (1, 16, 4096):  # real plans: chunks of at least 128 elements hold every group <= 128
        for itemsize in (2, 4):
            plan = make_plan(tokens, 7168, itemsize, 128)
            assert all(quantizes_in_kernel(plan, spec) for spec in (Q.fp8_per_group(128), Q.nvfp4(1.0))), plan
