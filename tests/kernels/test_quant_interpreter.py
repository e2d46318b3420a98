"""The Triton quantization helpers and the quantized epilogue in the interpreter, bit for bit.

Interpreter tier: kernels run in one spawned process with TRITON_INTERPRET=1 (set before any
kernel module is imported, see test_interpreter.py); everything is compared here against
`tpfuse.reference`. The helper cases are crafted fp32 rows (ties, zeros, the range edges and
beyond, e4m3 and fp32 subnormals, NaN and inf, all-zero rows), so the software e4m3 / e2m1
conversions are checked exactly where rounding is delicate.
"""

import pytest
import torch

from tpfuse import quant as Q
from tpfuse.reference import quantize_ref, random_inputs, residual_rmsnorm_quant_ref, small_integer_inputs
from tpfuse.spawn import run_ranks

pytestmark = pytest.mark.interpreter

INTERP = {"TRITON_INTERPRET": "1"}
H = 128


def _pack(t):
    """A tensor made safe to send between processes (float8 storages do not pickle): its bytes as
    uint8 when 1-byte, with its dtype and strides kept for the comparison."""
    if t is None or t.element_size() != 1:
        return t
    return ("bytes", str(t.dtype), t.shape, t.stride(), t.contiguous().view(torch.uint8).clone())


def _bits(t):
    if t is None:
        return None
    if isinstance(t, tuple):
        return t[4]
    t = t if t.dim() == 0 or t.stride(-1) == 1 else t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


def _meta(t):
    return (t[1], tuple(t[2]), tuple(t[3])) if isinstance(t, tuple) else (str(t.dtype), tuple(t.shape), t.stride())


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return _meta(a)[:2] == _meta(b)[:2] and torch.equal(_bits(a), _bits(b))


def crafted_rows() -> torch.Tensor:
    """Five fp32 rows of H values where quantization is delicate."""
    e4m3 = torch.arange(0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    ties = (e4m3[1:] + e4m3[:-1]) / 2  # every e4m3 midpoint (126 values)
    edge = torch.tensor([448.0, -448.0, 464.0, -464.0, 479.9, 500.0, 1e30, -float("inf"), float("inf"), -0.0,
                         2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-6, 2.0**-7 * 1.9375, 1e-40, -1e-40, 2.0**-126])
    e2m1_ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 7.0, 0.2500001, 0.0, -0.0, 1e-30, -6.5])
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(H, generator=gen) * torch.exp2(torch.randint(-20, 12, (H,), generator=gen).float())
    rows = torch.zeros(5, H)
    rows[1, :126], rows[1, 126:] = ties, torch.tensor([448.0, -1.0])
    rows[2, : edge.numel()] = edge
    rows[2, 64:80] = e2m1_ties  # an nvfp4 block with absmax 6: with global scale 1 its block scale is 1
    rows[3] = wide
    rows[4] = wide[torch.randperm(H, generator=gen)]
    rows[4, 5] = float("nan")
    return rows


SPECS = [
    Q.fp8_static(1.0), Q.fp8_static(torch.tensor([0.37])), Q.fp8_per_token(), Q.fp8_per_token(scale_ub=0.001),
    Q.fp8_per_group(128), Q.fp8_per_group(32, layout="col"), Q.fp8_per_group(16, scale_ub=0.5),
    Q.nvfp4(1.0, swizzled=False), Q.nvfp4(torch.tensor([1234.5]), swizzled=False), Q.nvfp4(7.0, swizzled=True),
]


def _helpers_rank(rank, world_size):
    from tpfuse.kernels.quant import quantize

    y = crafted_rows()
    full = [tuple(_pack(t) for t in quantize(y, spec)) for spec in SPECS]
    return full + [tuple(_pack(t) for t in quantize(y[:, :96].contiguous(), spec)) for spec in SPECS_96], _opchecks()


def _opchecks():
    """torch.library.opcheck of the quantized custom op: its fake (meta) outputs match the real
    ones in shape, stride and dtype, so torch.compile graphs see the right layouts."""
    from torch.library import opcheck

    import tpfuse.kernels.custom_ops  # noqa: F401  (registers the ops)

    s, r, w = (small_integer_inputs(i, 3, 64, torch.bfloat16) for i in range(3))
    cases = [("fp8_per_group", 16, "col", None, False, None), ("nvfp4", 16, "swizzled", None, True, torch.tensor([2.0])),
             ("fp8_static", 0, "row", None, False, torch.tensor([0.5])), ("fp8_per_token", 0, "row", 1.0, False, None)]
    return {c[0]: opcheck(torch.ops.tpfuse.residual_rmsnorm_quant.default, (s, r, w[0], 1e-6) + c) for c in cases}


# H = 96: rows shorter than their power-of-two block, so masked lanes and padded scale columns
# (align4(96 / 16) = 8 for the 128x4 layout) are exercised.
SPECS_96 = [Q.fp8_per_token(), Q.fp8_per_group(32, layout="col"), Q.nvfp4(3.0, swizzled=False), Q.nvfp4(3.0, swizzled=True)]


def test_helpers_match_reference_bit_for_bit():
    ((results, opchecks),) = run_ranks(_helpers_rank, 1, env=INTERP, timeout_s=300)
    for kind, checks in opchecks.items():
        assert set(checks.values()) == {"SUCCESS"}, (kind, checks)
    y = crafted_rows()
    inputs = [y] * len(SPECS) + [y[:, :96].contiguous()] * len(SPECS_96)
    for spec, y, (codes, scale) in zip(SPECS + SPECS_96, inputs, results):
        ref_codes, ref_scale = quantize_ref(y, spec)
        assert _same(codes, ref_codes), f"{spec.key}: codes differ at {(_bits(codes) != _bits(ref_codes)).nonzero()[:4].tolist()}"
        assert _same(scale, ref_scale), f"{spec.key}: scales differ"
        if spec.kind == "fp8_per_token":
            assert ref_scale[0].item() == 0.0  # the all-zero row
        if spec.kind == "fp8_per_group" and spec.layout == "col":
            assert _meta(scale)[2] == (1, 8)  # DeepGEMM's column-major, M padded to a multiple of 4


EPI_SPECS = [Q.fp8_static(0.05, with_normed=True), Q.fp8_per_token(), Q.fp8_per_group(64, layout="col"),
             Q.nvfp4(20.0, swizzled=False), Q.nvfp4(torch.tensor([3.0]), swizzled=True, with_normed=True)]
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _inputs(kind, dtype, m, with_res):
    make = random_inputs if kind == "rand" else small_integer_inputs
    h = 96 if kind == "int96" else H
    s = make(0, m, h, dtype, seed=m)
    res = make(1, m, h, dtype, seed=m) if with_res else None
    w = (1 + 0.1 * random_inputs(2, 1, h, torch.float32)[0]).to(dtype) if kind == "rand" else make(2, 1, h, dtype)[0]
    return s, res, w


def _cases():
    """(kind, dtype, M, with residual, spec index); the swizzled spec (128 programs for the
    padded scale rows, slow in the interpreter) runs once."""
    linear = [i for i, spec in enumerate(EPI_SPECS) if spec.layout != "swizzled"]
    swizzled = [i for i, spec in enumerate(EPI_SPECS) if spec.layout == "swizzled"]
    cases = [("int", dtype, 3, True, i) for dtype in DTYPES for i in linear]
    cases += [("int", torch.bfloat16, 3, True, i) for i in swizzled]
    cases += [("int", torch.bfloat16, 2, False, i) for i in linear[:2]]
    cases += [("int96", torch.bfloat16, 3, True, i) for i in linear if EPI_SPECS[i].group in (0, 16)]  # rows shorter than their block
    cases += [("rand", torch.bfloat16, 6, True, i) for i in linear]
    cases += [("int", torch.bfloat16, 0, True, i) for i in (1, swizzled[0])]  # zero tokens
    return cases


def _epilogue_rank(rank, world_size, cases):
    from tpfuse.kernels.custom_ops import residual_rmsnorm_quant_op
    from tpfuse.kernels.epilogue import residual_rmsnorm

    out = []
    for kind, dtype, m, with_res, i in cases:
        s, res, w = _inputs(kind, dtype, m, with_res)
        got = residual_rmsnorm(s, res, w, 1e-6, quant=EPI_SPECS[i])
        op = residual_rmsnorm_quant_op(s, res, w, 1e-6, EPI_SPECS[i]) if kind == "int" and dtype == torch.bfloat16 else None
        out.append((tuple(_pack(t) for t in got), None if op is None else tuple(_pack(t) for t in op)))
    return out


def _ordinal(codes, nibbles: bool):
    c = _bits(codes).to(torch.int32)
    if nibbles:
        c = torch.stack([c & 0xF, c >> 4], dim=-1)
        return torch.where(c >= 8, -(c - 8), c)
    return torch.where(c >= 0x80, -(c - 0x80), c)


@pytest.mark.slow
def test_quantized_epilogue_matches_reference():
    cases = _cases()
    (results,) = run_ranks(_epilogue_rank, 1, args=(cases,), env=INTERP, timeout_s=600)
    for (kind, dtype, m, with_res, i), (got, op) in zip(cases, results):
        spec = EPI_SPECS[i]
        s, res, w = _inputs(kind, dtype, m, with_res)
        ref = residual_rmsnorm_quant_ref(s, res, w, 1e-6, spec)
        label = f"{spec.key} {kind} {dtype} M={m} res={with_res}"
        got = Q.QuantOutput(*got)
        assert _same(got.residual, ref.residual), label  # the residual add is exact
        if op is not None:  # the torch.library op returns the launcher's bits and layouts
            assert all(_same(a, b) for a, b in zip(op, got)), label
        if kind != "rand":  # exact sum of squares: the fp32 rows equal the reference's, so every bit does
            assert all(_same(a, b) for a, b in zip(got, ref)), label
            continue
        # Random rows: the sum of squares is a tree here and sequential in torch, so a row's fp32
        # values may differ by an ulp; each scale then differs by at most a few fp32 ulps and each
        # code by at most one step of its grid.
        nib = spec.kind == "nvfp4"
        if nib:  # e4m3 block scales: at most one code apart
            assert (_ordinal(got.scale, False) - _ordinal(ref.scale, False)).abs().max() <= 1, label
        elif spec.kind != "fp8_static":
            assert torch.allclose(got[1], ref.scale, rtol=4 * 2.0**-23, atol=0), label
        if not nib or _same(got.scale, ref.scale):
            assert (_ordinal(got.out, nib) - _ordinal(ref.out, nib)).abs().max() <= 1, label
