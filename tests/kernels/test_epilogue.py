"""The fused residual-add + RMSNorm epilogue (`tpfuse.kernels.epilogue`) against the reference:
in the Triton interpreter (one spawned process, TRITON_INTERPRET set before any kernel import) and
on a GPU, every hidden size and dtype."""

import pytest
import torch

from support.peer import INTERP, nan_pair
from tpfuse.reference import (
    TOLERANCE,
    random_inputs,
    relative_error,
    residual_rmsnorm_ref,
    small_integer_inputs,
)
from tpfuse.spawn import run_ranks

HIDDENS = (2880, 4096, 5120, 6144, 7168, 8192, 16384, 100)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _epilogue_rank(rank, world_size, cases):
    from tpfuse.kernels.custom_ops import residual_rmsnorm_op
    from tpfuse.kernels.epilogue import residual_rmsnorm

    results = []
    for kind, dtype, m, h, with_res in cases:
        make = small_integer_inputs if kind == "int" else random_inputs
        s = make(0, m, h, dtype, seed=h)
        res = make(1, m, h, dtype, seed=h) if with_res else None
        w = (1 + 0.1 * random_inputs(2, 1, h, torch.float32, seed=h)[0]).to(dtype) if kind != "int" else make(2, 1, h, dtype)[0]
        out = residual_rmsnorm(s, res, w, 1e-6, out=nan_pair(s))
        op_out = residual_rmsnorm_op(s, res, w, 1e-6)
        results.append((s, res, w, out, op_out))
    return results


@pytest.mark.interpreter
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


# ---- GPU -----------------------------------------------------------------------------------------

def _poison_cache(nbytes: int) -> None:
    """Leave NaN in the caching allocator's free blocks, so fresh outputs start as NaN."""
    torch.empty(nbytes // 4 + 1, dtype=torch.float32, device="cuda").fill_(float("nan"))


# Every hidden size in bf16; the other dtypes on the awkward sizes (each case is a compile).
EPILOGUE_CASES = [(h, torch.bfloat16) for h in HIDDENS] + [(h, d) for h in (100, 2880, 16384) for d in (torch.float16, torch.float32)]


@pytest.mark.gpu
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
