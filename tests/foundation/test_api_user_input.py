"""What a user's odd input gets from the API on one gloo rank: a ValueError naming the argument for
hidden size 0, and detached outputs (the ops are inference-only) for inputs that require grad."""

import torch

from fusegate.launch import run_ranks
from fusegate.reference import all_reduce_residual_rmsnorm_ref, small_integer_inputs

H = 32


def _rank(rank, world_size):
    from fusegate import Communicator

    out = {}
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
    return out


def test_hidden_zero_and_grad_inputs():
    out = run_ranks(_rank, 1, timeout_s=120)[0]
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
