"""What a user's odd input gets from the API on one gloo rank: a ValueError naming the argument for
hidden size 0, detached outputs (the ops are inference-only) for inputs that require grad, and
warnings that point at the user's own line."""

import pytest
import torch

from tpfuse.reference import all_reduce_residual_rmsnorm_ref, small_integer_inputs
from tpfuse.spawn import run_ranks

pytestmark = pytest.mark.gloo

H = 32


def _rank(rank, world_size):
    import warnings

    from tpfuse import Communicator

    out = {}
    with Communicator() as comm, warnings.catch_warnings(record=True) as caught:  # no table in the cache dir
        warnings.simplefilter("always")
        comm.all_reduce(torch.ones(2, H))
        out["warnings"] = [(w.category.__name__, w.filename, str(w.message)) for w in caught]
    with Communicator(strategy="reference") as comm:
        for name, call in (("ar", lambda: comm.all_reduce(torch.empty(3, 0))),
                           ("fused", lambda: comm.all_reduce_residual_rmsnorm(torch.empty(3, 0), None, torch.empty(0)))):
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


def test_hidden_zero_and_grad_inputs(tmp_path):
    out = run_ranks(_rank, 1, timeout_s=120, env={"TPFUSE_CACHE_DIR": str(tmp_path)})[0]
    # The no-table warning names the caller's line (this file), not a line inside tpfuse.
    [(category, filename, message)] = out["warnings"]
    assert category == "DispatchWarning" and filename == __file__ and message.startswith("Communicator: no dispatch table")
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
        assert message is not None and message.startswith(f"Communicator.prepare: max_tokens must be an integer >= 1, got {bad!r}"), message
