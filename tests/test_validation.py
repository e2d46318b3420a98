"""The input checks (`tpfuse.validation`): a quantization spec that does not fit the call is refused
naming the problem."""

import pytest
import torch

from tpfuse import quant as Q
from tpfuse.validation import check_quant


@pytest.mark.parametrize("quant, hidden, exc, message", [
    (Q.fp8_per_group(128), 6000, ValueError, "not a multiple of 128"),
    (Q.nvfp4(1.0), 6152, ValueError, "not a multiple of 16"),
    (Q.fp8_static(torch.ones(2)), 64, TypeError, "one element"),
    (Q.fp8_static(0.0), 64, ValueError, "finite number > 0"),
    ("fp8", 64, TypeError, "must be a tpfuse.QuantSpec"),
    (Q.QuantSpec("fp4", 16), 64, ValueError, "is not a format"),
    (Q.QuantSpec("nvfp4", 16, "row", scale=1.0), 64, ValueError, "layout 'row' is not a format"),
    (Q.QuantSpec("fp8_per_group", 24), 48, ValueError, "power of two"),
])
def test_check_quant_names_the_problem(quant, hidden, exc, message):
    with pytest.raises(exc, match=message):
        check_quant("op", quant, hidden, device=torch.device("cpu"))


def _cases():
    """Calls of the fused op, valid and not: each differs from a valid one in one thing."""
    x, res, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16), torch.ones(8)
    w16 = w.bfloat16()
    yield "valid", (x, res, w16, 1e-6)
    yield "no residual", (x, None, w16, 1e-6)
    yield "weight a Parameter", (x, res, torch.nn.Parameter(w16, requires_grad=False), 1e-6)
    yield "3-d input", (x.view(1, 3, 8), res.view(1, 3, 8), w16, 1e-6)
    yield "eps an int", (x, res, w16, 0)
    yield "eps negative", (x, res, w16, -1.0)
    yield "eps inf", (x, res, w16, float("inf"))
    yield "weight fp32", (x, res, w, 1e-6)
    yield "weight too short", (x, res, w16[:4], 1e-6)
    yield "residual fp16", (x, res.half(), w16, 1e-6)
    yield "residual other shape", (x, res[:2], w16, 1e-6)
    yield "x int", (x.to(torch.int32), res, w16, 1e-6)
    yield "x 0-d", (x[0, 0], res, w16, 1e-6)
    yield "hidden 0", (x[:, :0], res[:, :0], w16[:0], 1e-6)
    yield "x not a tensor", (x.tolist(), res, w16, 1e-6)


@pytest.mark.parametrize("name, call", list(_cases()), ids=[n for n, _ in _cases()])
def test_the_fast_check_accepts_only_what_the_full_checks_accept(name, call, monkeypatch):
    from tpfuse import validation

    cpu = torch.device("cpu")
    fast = validation._plain_residual_rmsnorm(*call, cpu)
    monkeypatch.setattr(validation, "_plain_residual_rmsnorm", lambda *args: False)  # the full checks alone
    try:
        validation.check_residual_rmsnorm(*call, device=cpu)
        full = True
    except (TypeError, ValueError):
        full = False
    assert full == (name in ("valid", "no residual", "weight a Parameter", "3-d input", "eps an int")), name
    assert not fast or full, name  # never accepts what the full checks refuse
    assert fast == (full and name != "eps an int"), name  # the common valid calls take the fast path
