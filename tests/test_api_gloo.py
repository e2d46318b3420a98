"""The public API over gloo in spawned processes, world sizes 1, 2 and 4, against the references."""

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
from tpfuse.spawn import RankFailure, run_ranks

H = 96


def _weight(dtype):
    return (1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(11))).to(dtype)


def _calls_rank(rank, world_size):
    from tpfuse import Communicator

    out = {}
    with Communicator() as comm:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = random_inputs(rank, 5, H, dtype)
            before = x.clone()
            res = random_inputs(100, 5, H, dtype)
            out[("fused", dtype)] = comm.all_reduce_residual_rmsnorm(x, res, _weight(dtype))
            out[("first_layer", dtype)] = comm.all_reduce_residual_rmsnorm(x, None, _weight(dtype))
            out[("ar", dtype)] = comm.all_reduce(x)
            out[("unchanged", dtype)] = torch.equal(x, before)
        xi = small_integer_inputs(rank, 7, H, torch.bfloat16)
        resi = small_integer_inputs(100, 7, H, torch.bfloat16)
        out["exact"] = comm.all_reduce_residual_rmsnorm(xi, resi, torch.full((H,), 2.0, dtype=torch.bfloat16))
        x3 = random_inputs(rank, 6, H, torch.float32).view(2, 3, H)
        out["3d"] = comm.all_reduce_residual_rmsnorm(x3, x3 * 0.5, _weight(torch.float32))
        # Non-contiguous input (a transposed view) is copied, and the result equals the contiguous call.
        xt = random_inputs(rank, H, 4, torch.float32).t()
        out["noncontig"] = (comm.all_reduce(xt), comm.all_reduce(xt.contiguous()))
        empty = torch.empty(0, H, dtype=torch.bfloat16)
        out["empty"] = comm.all_reduce_residual_rmsnorm(empty, empty, torch.ones(H, dtype=torch.bfloat16))
        out["empty_ar"] = comm.all_reduce(empty)
        out["choice"] = comm.strategy_for("all_reduce_residual_rmsnorm", 8, H, torch.bfloat16)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.gloo
def test_api_matches_reference_on_every_rank(world_size):
    results = run_ranks(_calls_rank, world_size, timeout_s=120)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        xs = [random_inputs(r, 5, H, dtype) for r in range(world_size)]
        res = random_inputs(100, 5, H, dtype)
        xs64 = [x.double() for x in xs]
        ref_normed, ref_res = all_reduce_residual_rmsnorm_ref(xs64, res.double(), _weight(dtype).double(), acc_dtype=torch.float64)
        exact_normed, exact_res = all_reduce_residual_rmsnorm_ref(xs, res, _weight(dtype))
        for rank, out in enumerate(results):
            normed, new_res = out[("fused", dtype)]
            assert normed.dtype == dtype and normed.shape == (5, H)
            assert relative_error(normed, ref_normed) <= TOLERANCE[dtype]
            assert relative_error(new_res, ref_res) <= TOLERANCE[dtype]
            # The reference strategy uses the reference epilogue: same bits as the fp32 reference
            # whenever gloo's fp32 sum order does not matter (always at world size <= 2).
            if world_size <= 2:
                assert torch.equal(normed, exact_normed) and torch.equal(new_res, exact_res)
            first_normed, first_res = out[("first_layer", dtype)]
            assert torch.equal(first_res, out[("ar", dtype)])
            assert relative_error(out[("ar", dtype)], all_reduce_ref(xs64, acc_dtype=torch.float64)) <= TOLERANCE[dtype]
            assert out[("unchanged", dtype)], "all_reduce must be out of place"
            # Identical bits on every rank.
            for key in (("fused", dtype), ("first_layer", dtype)):
                for got, want in zip(out[key], results[0][key]):
                    assert torch.equal(got, want)
            assert torch.equal(out[("ar", dtype)], results[0][("ar", dtype)])

    xi = [small_integer_inputs(r, 7, H, torch.bfloat16) for r in range(world_size)]
    want = all_reduce_residual_rmsnorm_ref(xi, small_integer_inputs(100, 7, H, torch.bfloat16), torch.full((H,), 2.0, dtype=torch.bfloat16))
    for out in results:
        assert torch.equal(out["exact"][0], want[0]) and torch.equal(out["exact"][1], want[1])
        normed3, res3 = out["3d"]
        assert normed3.shape == (2, 3, H) and res3.shape == (2, 3, H)
        assert torch.equal(out["noncontig"][0], out["noncontig"][1])
        assert out["empty"][0].shape == (0, H) and out["empty"][1].shape == (0, H) and out["empty_ar"].shape == (0, H)
        assert out["choice"].name == "reference"


def _bad_inputs_rank(rank, world_size):
    from tpfuse import Communicator

    comm = Communicator()
    x = torch.randn(4, 8)
    w = torch.ones(8)
    cases = {
        "residual_shape": lambda: comm.all_reduce_residual_rmsnorm(x, torch.randn(4, 7), w),
        "weight_shape": lambda: comm.all_reduce_residual_rmsnorm(x, x, torch.ones(7)),
        "zero_dim": lambda: comm.all_reduce(torch.tensor(1.0)),
        "int_dtype": lambda: comm.all_reduce(torch.ones(4, 8, dtype=torch.int32)),
        "residual_dtype": lambda: comm.all_reduce_residual_rmsnorm(x, x.double(), w),
        "weight_dtype": lambda: comm.all_reduce_residual_rmsnorm(x, x, w.half()),
        "negative_eps": lambda: comm.all_reduce_residual_rmsnorm(x, x, w, eps=-1e-6),
        "nan_eps": lambda: comm.all_reduce_residual_rmsnorm(x, x, w, eps=float("nan")),
        "not_tensor": lambda: comm.all_reduce([1.0, 2.0]),
        "meta_device": lambda: comm.all_reduce(torch.empty(4, 8, device="meta")),
        "unknown_strategy": lambda: Communicator(strategy="nope"),
    }
    errors = {}
    for name, fn in cases.items():
        try:
            fn()
            errors[name] = None
        except Exception as exc:
            errors[name] = (type(exc).__name__, str(exc))
    comm.close()
    try:
        comm.all_reduce(x)
        errors["after_close"] = None
    except Exception as exc:
        errors["after_close"] = (type(exc).__name__, str(exc))
    return errors


@pytest.mark.gloo
def test_bad_inputs_name_the_argument_and_the_fix():
    errors = run_ranks(_bad_inputs_rank, 1)[0]
    expect = {
        "residual_shape": ("ValueError", "residual has shape (4, 7) but x has (4, 8)"),
        "weight_shape": ("ValueError", "weight must have shape (8,)"),
        "zero_dim": ("ValueError", "x is a 0-dim tensor"),
        "int_dtype": ("TypeError", "x has dtype torch.int32"),
        "residual_dtype": ("TypeError", "cast with residual.to(x.dtype)"),
        "weight_dtype": ("TypeError", "cast with weight.to(x.dtype)"),
        "negative_eps": ("ValueError", "eps is -1e-06"),
        "nan_eps": ("ValueError", "must be a finite number"),
        "not_tensor": ("TypeError", "x must be a torch.Tensor"),
        "meta_device": ("ValueError", "move it with x.to('cpu')"),
        "unknown_strategy": ("ValueError", "use 'auto' or one of: reference"),
        "after_close": ("RuntimeError", "used after close()"),
    }
    for name, (kind, text) in expect.items():
        assert errors[name] is not None, f"{name}: no error raised"
        assert errors[name][0] == kind, (name, errors[name])
        assert text in errors[name][1], (name, errors[name])


def _debug_rank(rank, world_size):
    from tpfuse import Communicator

    comm = Communicator(debug=True)
    x = torch.randn(3 + rank, 8)  # rank 1 passes a different token count
    try:
        comm.all_reduce(x)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.gloo
def test_debug_mode_turns_a_shape_disagreement_into_an_error_naming_ranks():
    messages = run_ranks(_debug_rank, 2, timeout_s=60)
    for message in messages:
        assert message is not None
        assert "ranks disagree" in message and "rank 0: all_reduce (3, 8)" in message and "rank 1: all_reduce (4, 8)" in message


def _raising_rank(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    return rank


@pytest.mark.gloo
def test_launcher_reports_the_failing_rank():
    with pytest.raises(RankFailure) as info:
        run_ranks(_raising_rank, 2, timeout_s=60)
    assert list(info.value.failures) == [1] and "boom on rank 1" in info.value.failures[1]


def test_communicator_needs_an_initialised_process_group():
    from tpfuse import Communicator

    with pytest.raises(RuntimeError, match="init_process_group"):
        Communicator()
