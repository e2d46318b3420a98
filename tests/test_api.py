"""The Communicator's construction arguments and its per-shape call path, on one spawned gloo rank.

- Unknown keyword options, and a device torch does not know, are errors naming what to pass.
- prepare() after close() raises and creates nothing that a later close() would have to release.
- A steady-state call reuses its route: no new Problem, no choice, no admission per call; another
  shape gets its own route; results stay the reference's bits.
- An asynchronous failure that a strategy records (as a timed-out peer kernel does) surfaces at
  the next call and at check(), also through a cached route.
"""

import os

import pytest
import torch

from tpfuse.reference import all_reduce_ref, all_reduce_residual_rmsnorm_ref, small_integer_inputs
from tpfuse.spawn import run_ranks

pytestmark = pytest.mark.gloo

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
        out["routes"] = len(comm._routes)
    return out


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


def test_a_recorded_failure_surfaces_at_the_next_call_and_at_check():
    first, at_check, next_call, again = run_ranks(_sticky_rank, 1, timeout_s=120, env=STICKY)[0]
    x = small_integer_inputs(0, 2, H, torch.float32)
    want = all_reduce_residual_rmsnorm_ref([x], x, torch.ones(H))
    assert torch.equal(first[0], want[0]) and torch.equal(first[1], want[1])
    for message in (at_check, next_call, again):
        assert message is not None and "call 0 timed out on the device" in message
