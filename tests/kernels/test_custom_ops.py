"""The torch.library ops (`tpfuse.kernels.custom_ops`) inside a torch.compile graph, on a GPU (the
collective op by strategy handle is checked in tests/kernels/test_oneshot.py's interpreter calls)."""

import pytest
import torch

from tpfuse.reference import random_inputs, residual_rmsnorm_ref


@pytest.mark.gpu
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
