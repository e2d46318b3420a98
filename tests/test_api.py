"""The public API, `tpfuse.Communicator`, in spawned gloo processes, against the references.

- Calls at world sizes 1, 2 and 4: both ops in every dtype, the first layer's (no residual), 3-D,
  non-contiguous and empty inputs; out of place; identical bits on every rank.
- Quantized output: every CPU strategy, every format, identical bits on every rank and equal to
  the reference (small-integer inputs: the sums are exact).
- Construction: unknown keyword options, and a device torch does not know, are errors naming what
  to pass; without an initialised process group it says so; with `cpu_group` (as engines pass
  theirs) the handshake runs on that group.
- A user's odd input: wrong shapes, dtypes, eps and devices name the argument and the fix; hidden
  size 0 is a ValueError naming the argument; inputs that require grad give detached outputs (the
  ops are inference-only); warnings point at the user's own line; debug mode turns a shape
  disagreement into an error naming the ranks.
- prepare() after close() raises and creates nothing that a later close() would have to release.
- A steady-state call reuses its route: no new Problem, no choice, no admission per call; another
  shape gets its own route; results stay the reference's bits.
- An asynchronous failure that a strategy records (as a timed-out peer kernel does) surfaces at
  the next call and at check(), also through a cached route.
"""

import os

import pytest
import torch

from support.quant_output import pack
from tpfuse import quant as Q
from tpfuse.reference import (
    TOLERANCE,
    all_reduce_ref,
    all_reduce_residual_rmsnorm_quant_ref,
    all_reduce_residual_rmsnorm_ref,
    random_inputs,
    relative_error,
    small_integer_inputs,
)
from tpfuse.spawn import run_ranks

H = 32
TESTS_DIR = os.path.dirname(__file__)
STICKY = {"TPFUSE_STRATEGIES": "fails_after_first_call=support.sticky_error_strategy:FailsAfterFirstCall",
          "PYTHONPATH": TESTS_DIR}


def _error(fn):
    try:
        fn()
    except Exception as exc:  # the type and message are what the tests check
        return type(exc).__name__, str(exc)
    return None


def _construction_rank(rank, world_size):
    from tpfuse import Communicator

    out = {
        "misspelt": _error(lambda: Communicator(timeuot_s=5)),
        "other_name": _error(lambda: Communicator(timeout=5)),
        "two": _error(lambda: Communicator(max_token=4, spin=1)),
        "tpu": _error(lambda: Communicator(device="tpu")),
        "xla": _error(lambda: Communicator(device="meta")),
    }
    with Communicator(timeout_s=5, max_tokens=4, max_programs=2) as comm:  # every known option is accepted
        out["known"] = comm.options
    comm = Communicator(strategy="reference")
    comm.all_reduce(torch.ones(2, H))
    comm.close()
    out["prepare_after_close"] = _error(lambda: comm.prepare(hidden=H, dtype=torch.float32, max_tokens=4))
    out["instances_after_prepare"] = len(comm._instances)
    out["call_after_close"] = _error(lambda: comm.all_reduce(torch.ones(2, H)))
    return out


@pytest.mark.gloo
def test_construction_refuses_unknown_options_and_devices_and_prepare_after_close():
    out = run_ranks(_construction_rank, 1, timeout_s=120)[0]
    kind, message = out["misspelt"]
    assert kind == "ValueError" and message.startswith("Communicator: unknown option 'timeuot_s' (did you mean "
                                                       "'timeout_s'?); the options are timeout_s, max_tokens, "
                                                       "max_programs"), message
    kind, message = out["other_name"]
    assert kind == "ValueError" and "unknown option 'timeout' (did you mean 'timeout_s'?)" in message, message
    kind, message = out["two"]
    assert kind == "ValueError" and "unknown options 'max_token' (did you mean 'max_tokens'?), 'spin'" in message
    kind, message = out["tpu"]
    assert kind == "ValueError", out["tpu"]
    assert message == ("Communicator: device 'tpu' is not a torch device; pass device='cuda' (the current GPU) or "
                       "device='cpu'"), message
    kind, message = out["xla"]
    assert kind == "ValueError" and message.startswith("Communicator: device 'meta' is not supported; pass "
                                                       "device='cuda'"), message
    assert out["known"] == {"timeout_s": 5, "max_tokens": 4, "max_programs": 2}
    kind, message = out["prepare_after_close"]
    assert kind == "RuntimeError" and message.startswith("Communicator.prepare: called after close()"), message
    assert out["instances_after_prepare"] == 0, "prepare() after close() created a strategy nobody releases"
    assert out["call_after_close"][0] == "RuntimeError" and "used after close()" in out["call_after_close"][1]


def _steady_rank(rank, world_size):
    from tpfuse import Communicator, api

    counts = {"route": 0, "admission": 0}
    route, admission = api.Communicator._route, api.admission

    def counting_route(self, *args, **kwargs):
        counts["route"] += 1
        return route(self, *args, **kwargs)

    def counting_admission(*args, **kwargs):
        counts["admission"] += 1
        return admission(*args, **kwargs)

    api.Communicator._route, api.admission = counting_route, counting_admission
    out = {"results": []}
    with Communicator(strategy="reference") as comm:
        w = small_integer_inputs(7, 1, H, torch.float32)[0]
        for i in range(4):
            x = small_integer_inputs(rank + i, 3, H, torch.float32)
            res = small_integer_inputs(100 + i, 3, H, torch.float32)
            out["results"].append((x, res, comm.all_reduce_residual_rmsnorm(x, res, w), comm.all_reduce(x)))
        out["after_steady"] = dict(counts)
        x3 = small_integer_inputs(rank, 6, H, torch.float32).view(2, 3, H)  # another shape: its own route
        out["3d"] = (x3, comm.all_reduce_residual_rmsnorm(x3, None, w))
        comm.all_reduce_residual_rmsnorm(x3, None, w)
        out["after_other_shape"] = dict(counts)
        out["routes"] = sum(len(routes) for routes in comm._routes.values())
    return out


@pytest.mark.gloo
def test_a_steady_call_reuses_its_route_and_keeps_the_reference_bits():
    out = run_ranks(_steady_rank, 1, timeout_s=120)[0]
    # one route per (op, shape): the fused op and all_reduce at 3 tokens, then the fused op at 6 tokens
    assert out["after_steady"] == {"route": 2, "admission": 2}, out["after_steady"]
    assert out["after_other_shape"] == {"route": 3, "admission": 3}, out["after_other_shape"]
    assert out["routes"] == 3
    w = small_integer_inputs(7, 1, H, torch.float32)[0]
    for x, res, (normed, new_res), summed in out["results"]:
        want = all_reduce_residual_rmsnorm_ref([x], res, w)
        assert torch.equal(normed, want[0]) and torch.equal(new_res, want[1])
        assert torch.equal(summed, all_reduce_ref([x]))
    x3, (normed, new_res) = out["3d"]
    want = all_reduce_residual_rmsnorm_ref([x3.view(6, H)], None, w)
    assert normed.shape == (2, 3, H) and torch.equal(normed.view(6, H), want[0]) and torch.equal(new_res.view(6, H),
                                                                                                 want[1])


def _sticky_rank(rank, world_size):
    from support.sticky_error_strategy import StickyDeviceError
    from tpfuse import Communicator

    out = []
    with Communicator(strategy="fails_after_first_call") as comm:
        x = small_integer_inputs(rank, 2, H, torch.float32)
        w = torch.ones(H)
        out.append(comm.all_reduce_residual_rmsnorm(x, x, w))  # records the failure, like a kernel's error word
        for call in (lambda: comm.check(), lambda: comm.all_reduce_residual_rmsnorm(x, x, w),
                     lambda: comm.all_reduce_residual_rmsnorm(x, x, w)):
            try:
                call()
                out.append(None)
            except StickyDeviceError as exc:
                out.append(str(exc))
    return out


@pytest.mark.gloo
def test_a_recorded_failure_surfaces_at_the_next_call_and_at_check():
    first, at_check, next_call, again = run_ranks(_sticky_rank, 1, timeout_s=120, env=STICKY)[0]
    x = small_integer_inputs(0, 2, H, torch.float32)
    want = all_reduce_residual_rmsnorm_ref([x], x, torch.ones(H))
    assert torch.equal(first[0], want[0]) and torch.equal(first[1], want[1])
    for message in (at_check, next_call, again):
        assert message is not None and "call 0 timed out on the device" in message


# ---- calls against the references ---------------------------------------------------------------

CALLS_H = 96


def _weight(dtype):
    return (1 + 0.1 * torch.randn(CALLS_H, generator=torch.Generator().manual_seed(11))).to(dtype)


def _calls_rank(rank, world_size):
    from tpfuse import Communicator

    out = {}
    with Communicator() as comm:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = random_inputs(rank, 5, CALLS_H, dtype)
            before = x.clone()
            res = random_inputs(100, 5, CALLS_H, dtype)
            out[("fused", dtype)] = comm.all_reduce_residual_rmsnorm(x, res, _weight(dtype))
            out[("first_layer", dtype)] = comm.all_reduce_residual_rmsnorm(x, None, _weight(dtype))
            out[("ar", dtype)] = comm.all_reduce(x)
            out[("unchanged", dtype)] = torch.equal(x, before)
        xi = small_integer_inputs(rank, 7, CALLS_H, torch.bfloat16)
        resi = small_integer_inputs(100, 7, CALLS_H, torch.bfloat16)
        out["exact"] = comm.all_reduce_residual_rmsnorm(xi, resi, torch.full((CALLS_H,), 2.0, dtype=torch.bfloat16))
        x3 = random_inputs(rank, 6, CALLS_H, torch.float32).view(2, 3, CALLS_H)
        out["3d"] = comm.all_reduce_residual_rmsnorm(x3, x3 * 0.5, _weight(torch.float32))
        # Non-contiguous input (a transposed view) is copied, and the result equals the contiguous call.
        xt = random_inputs(rank, CALLS_H, 4, torch.float32).t()
        out["noncontig"] = (comm.all_reduce(xt), comm.all_reduce(xt.contiguous()))
        empty = torch.empty(0, CALLS_H, dtype=torch.bfloat16)
        out["empty"] = comm.all_reduce_residual_rmsnorm(empty, empty, torch.ones(CALLS_H, dtype=torch.bfloat16))
        out["empty_ar"] = comm.all_reduce(empty)
        out["choice"] = comm.strategy_for("all_reduce_residual_rmsnorm", 8, CALLS_H, torch.bfloat16)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.gloo
def test_api_matches_reference_on_every_rank(world_size):
    results = run_ranks(_calls_rank, world_size, timeout_s=120)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        xs = [random_inputs(r, 5, CALLS_H, dtype) for r in range(world_size)]
        res = random_inputs(100, 5, CALLS_H, dtype)
        xs64 = [x.double() for x in xs]
        ref_normed, ref_res = all_reduce_residual_rmsnorm_ref(xs64, res.double(), _weight(dtype).double(),
                                                              acc_dtype=torch.float64)
        exact_normed, exact_res = all_reduce_residual_rmsnorm_ref(xs, res, _weight(dtype))
        for rank, out in enumerate(results):
            normed, new_res = out[("fused", dtype)]
            assert normed.dtype == dtype and normed.shape == (5, CALLS_H)
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

    xi = [small_integer_inputs(r, 7, CALLS_H, torch.bfloat16) for r in range(world_size)]
    want = all_reduce_residual_rmsnorm_ref(xi, small_integer_inputs(100, 7, CALLS_H, torch.bfloat16),
                                           torch.full((CALLS_H,), 2.0, dtype=torch.bfloat16))
    for out in results:
        assert torch.equal(out["exact"][0], want[0]) and torch.equal(out["exact"][1], want[1])
        normed3, res3 = out["3d"]
        assert normed3.shape == (2, 3, CALLS_H) and res3.shape == (2, 3, CALLS_H)
        assert torch.equal(out["noncontig"][0], out["noncontig"][1])
        assert (out["empty"][0].shape == (0, CALLS_H) and out["empty"][1].shape == (0, CALLS_H)
                and out["empty_ar"].shape == (0, CALLS_H))
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
        assert ("ranks disagree" in message and "rank 0: all_reduce (3, 8)" in message
                and "rank 1: all_reduce (4, 8)" in message)


def test_communicator_needs_an_initialised_process_group():
    from tpfuse import Communicator

    with pytest.raises(RuntimeError, match="init_process_group"):
        Communicator()


# ---- a user's odd input --------------------------------------------------------------------------

def _user_input_rank(rank, world_size):
    import warnings

    from tpfuse import Communicator

    out = {}
    with Communicator() as comm, warnings.catch_warnings(record=True) as caught:  # no table in the cache dir
        warnings.simplefilter("always")
        comm.all_reduce(torch.ones(2, H))
        out["warnings"] = [(w.category.__name__, w.filename, str(w.message)) for w in caught]
    with Communicator(strategy="reference") as comm:
        for name, call in (("ar", lambda: comm.all_reduce(torch.empty(3, 0))),
                           ("fused",
                            lambda: comm.all_reduce_residual_rmsnorm(torch.empty(3, 0), None, torch.empty(0)))):
            try:
                call()
                out[name] = None
            except Exception as exc:  # the type and message are what the test checks
                out[name] = (type(exc).__name__, str(exc))
        x = small_integer_inputs(rank, 4, H, torch.float32).requires_grad_()
        res = small_integer_inputs(100, 4, H, torch.float32).requires_grad_()
        weight = torch.full((H,), 2.0, requires_grad=True)
        normed, new_res = comm.all_reduce_residual_rmsnorm(x, res, weight)
        y = comm.all_reduce(x)
        out["requires_grad"] = (normed.requires_grad, new_res.requires_grad, y.requires_grad)
        out["values"] = (normed.detach(), new_res.detach(), y.detach())
        out["prepare"] = []
        for bad in (0, -3, 2.5, True):
            try:
                comm.prepare(hidden=H, dtype=torch.float32, max_tokens=bad)
                out["prepare"].append(None)
            except ValueError as exc:
                out["prepare"].append(str(exc))
    return out


@pytest.mark.gloo
def test_hidden_zero_and_grad_inputs(tmp_path):
    out = run_ranks(_user_input_rank, 1, timeout_s=120, env={"TPFUSE_CACHE_DIR": str(tmp_path)})[0]
    # The no-table warning names the caller's line (this file), not a line inside tpfuse.
    [(category, filename, message)] = out["warnings"]
    assert (category == "DispatchWarning" and filename == __file__
            and message.startswith("Communicator: no dispatch table"))
    for name, op in (("ar", "all_reduce"), ("fused", "all_reduce_residual_rmsnorm")):
        kind, message = out[name]
        assert kind == "ValueError"
        assert message.startswith(f"{op}: x has shape (3, 0): hidden size (the last dimension) 0")
        assert message.endswith("(zero tokens is fine: shape (0, hidden))")
    assert out["requires_grad"] == (False, False, False)
    x = small_integer_inputs(0, 4, H, torch.float32)
    res = small_integer_inputs(100, 4, H, torch.float32)
    ref_normed, ref_res = all_reduce_residual_rmsnorm_ref([x], res, torch.full((H,), 2.0))
    normed, new_res, y = out["values"]
    assert torch.equal(normed, ref_normed) and torch.equal(new_res, ref_res) and torch.equal(y, x)
    for bad, message in zip((0, -3, 2.5, True), out["prepare"]):
        assert message is not None and message.startswith(
            f"Communicator.prepare: max_tokens must be an integer >= 1, got {bad!r}"), message


# ---- quantized output ---------------------------------------------------------------------------

QUANT_H = 64
QUANT_M = 5


def _quant_specs():
    return [Q.fp8_static(0.125), Q.fp8_per_token(with_normed=True), Q.fp8_per_token(scale_ub=0.01),
            Q.fp8_per_group(32, layout="col"), Q.fp8_per_group(16), Q.nvfp4(torch.tensor([2.5]), swizzled=False),
            Q.nvfp4(40.0, swizzled=True)]


def _quant_inputs(rank):
    x = small_integer_inputs(rank, QUANT_M, QUANT_H, torch.bfloat16)
    return (x, small_integer_inputs(100, QUANT_M, QUANT_H, torch.bfloat16),
            small_integer_inputs(101, 1, QUANT_H, torch.bfloat16)[0])


def _quant_rank(rank, world_size, strategy):
    from tpfuse import Communicator

    results = {}
    with Communicator(strategy=strategy) as comm:
        x, res, w = _quant_inputs(rank)
        for i, spec in enumerate(_quant_specs()):
            results[i] = pack(comm.all_reduce_residual_rmsnorm(x, res, w, quant=spec))
        out = comm.all_reduce_residual_rmsnorm(x.view(1, QUANT_M, QUANT_H), None, w, quant=Q.fp8_per_token())
        results["3d"] = (tuple(out.out.shape), tuple(out.scale.shape), tuple(out.residual.shape))
        empty = comm.all_reduce_residual_rmsnorm(x[:0], res[:0], w, quant=Q.nvfp4(1.0))
        results["empty"] = (tuple(empty.out.shape), tuple(empty.scale.shape))
        try:
            Communicator(strategy="oneshot").all_reduce_residual_rmsnorm(x, res, w, quant=Q.fp8_per_token())
        except ValueError as exc:
            results["oneshot"] = str(exc)
    return results


# "auto" is the reference strategy on CPU (the conservative default)
@pytest.mark.gloo
@pytest.mark.parametrize("strategy, world_size", [("auto", 2), ("ring", 3)])
def test_quantized_output_on_every_rank(strategy, world_size):
    results = run_ranks(_quant_rank, world_size, args=(strategy,), timeout_s=180)
    xs = [_quant_inputs(r)[0] for r in range(world_size)]
    _, res, w = _quant_inputs(0)
    for i, spec in enumerate(_quant_specs()):
        ref = pack(all_reduce_residual_rmsnorm_quant_ref(xs, res, w, 1e-6, spec))
        for rank in range(world_size):
            got = results[rank][i]
            for name, g, r in zip(("out", "scale", "residual", "normed"), got, ref):
                assert (g is None) == (r is None), (spec.key, name)
                if g is not None:
                    assert g[:2] == r[:2] and torch.equal(g[3], r[3]), (
                        f"{strategy} rank {rank} {spec.key}: {name} differs")
    for rank in range(world_size):
        assert results[rank]["3d"] == ((1, QUANT_M, QUANT_H), (1, QUANT_M, 1), (1, QUANT_M, QUANT_H))
        assert results[rank]["empty"] == ((0, QUANT_H // 2), (0, 4))
        # every strategy implements quantized output; a forced one still says why it cannot run here
        assert "strategy 'oneshot' cannot run" in results[rank]["oneshot"] and "needs CUDA" in results[rank]["oneshot"]


# ---- the handshake on a CPU group ----------------------------------------------------------------

CPU_GROUP_H = 64


def _cpu_group_rank(rank, world_size):
    import torch.distributed as dist

    from tpfuse import Communicator

    data_group, cpu_group = dist.new_group([0, 1]), dist.new_group([0, 1], backend="gloo")
    seen = []
    original = dist.all_gather_object
    dist.all_gather_object = lambda out, obj, group=None: seen.append(group) or original(out, obj, group=group)
    try:
        with Communicator(data_group, cpu_group=cpu_group) as comm:
            handshakes = list(seen)
            x = small_integer_inputs(rank, 3, CPU_GROUP_H, torch.bfloat16)
            res = small_integer_inputs(100, 3, CPU_GROUP_H, torch.bfloat16)
            got = comm.all_reduce_residual_rmsnorm(x, res, torch.ones(CPU_GROUP_H, dtype=torch.bfloat16))
    finally:
        dist.all_gather_object = original
    return {"handshakes_on_cpu": bool(handshakes) and all(g is cpu_group for g in handshakes), "out": got}


@pytest.mark.gloo
def test_communicator_handshakes_on_cpu_group():
    results = run_ranks(_cpu_group_rank, 2, timeout_s=120)
    xs = [small_integer_inputs(r, 3, CPU_GROUP_H, torch.bfloat16) for r in range(2)]
    want = all_reduce_residual_rmsnorm_ref(xs, small_integer_inputs(100, 3, CPU_GROUP_H, torch.bfloat16),
                                           torch.ones(CPU_GROUP_H, dtype=torch.bfloat16))
    for out in results:
        assert out["handshakes_on_cpu"]
        assert torch.equal(out["out"][0], want[0]) and torch.equal(out["out"][1], want[1])
