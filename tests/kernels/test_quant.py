"""The Triton quantization helpers (`tpfuse.kernels.quant`) and the quantized epilogue, bit for bit
against `tpfuse.reference`, in three tiers:

- interpreter: kernels in one spawned process with TRITON_INTERPRET=1 (set before any kernel
  module is imported, see test_interpreter.py). The helper cases are crafted fp32 rows (ties,
  zeros, the range edges and beyond, e4m3 and fp32 subnormals, NaN and inf, all-zero rows), so
  the software e4m3 / e2m1 conversions are checked exactly where rounding is delicate.
- plain: the kernel compiles for GPUs this machine does not have (Triton's frontend and NVIDIA
  backend lower it to PTX on CPU): the software conversion needs no e4m3 / e2m1 instruction (so
  SM80 runs it), the hardware path on sm_90 is cvt.rn.satfinite, the codes leave in vector stores.
- gpu: the helpers (software and hardware e4m3), the epilogue at model shapes, torch's own float8
  conversion, FlashInfer's FP4 quantizer where it runs, CUDA-graph capture, nccl_epilogue on one
  NCCL rank and the peer strategies with two ranks sharing one GPU; skipped without a CUDA GPU.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_quant.py -m gpu
"""

import re

import pytest
import torch

from tpfuse import quant as Q
from tpfuse.reference import quantize_ref, random_inputs, residual_rmsnorm_quant_ref, small_integer_inputs
from tpfuse.spawn import run_ranks

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
    return (t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32) if t.element_size() == 4
            else t.view(torch.int16))


def _meta(t):
    return (t[1], tuple(t[2]), tuple(t[3])) if isinstance(t, tuple) else (str(t.dtype), tuple(t.shape), t.stride())


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return _meta(a)[:2] == _meta(b)[:2] and torch.equal(_bits(a), _bits(b))


def crafted_rows() -> torch.Tensor:
    """Six fp32 rows of H values where quantization is delicate (row 5: NaNs of both signs and
    with payloads among finite values, which each e4m3 and e2m1 code must map to the one NaN code)."""
    e4m3 = torch.arange(0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    ties = (e4m3[1:] + e4m3[:-1]) / 2  # every e4m3 midpoint (126 values)
    edge = torch.tensor([448.0, -448.0, 464.0, -464.0, 479.9, 500.0, 1e30, -float("inf"), float("inf"), -0.0,
                         2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-6, 2.0**-7 * 1.9375, 1e-40, -1e-40, 2.0**-126])
    e2m1_ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 7.0, 0.2500001, 0.0, -0.0, 1e-30,
                              -6.5])
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(H, generator=gen) * torch.exp2(torch.randint(-20, 12, (H,), generator=gen).float())
    rows = torch.zeros(6, H)
    rows[1, :126], rows[1, 126:] = ties, torch.tensor([448.0, -1.0])
    rows[2, : edge.numel()] = edge
    rows[2, 64:80] = e2m1_ties  # an nvfp4 block with absmax 6: with global scale 1 its block scale is 1
    rows[3] = wide
    rows[4] = wide[torch.randperm(H, generator=gen)]
    rows[4, 5] = float("nan")
    rows[5] = -wide
    nans = torch.tensor([0xFFC00000, 0xFF800001, 0x7F800001, 0xFFFFFFFF, 0x7FC00000], dtype=torch.int64)
    rows[5, 3:3 + 5 * 17:17] = nans.to(torch.int32).view(torch.float32)
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
    cases = [("fp8_per_group", 16, "col", None, False, None),
             ("nvfp4", 16, "swizzled", None, True, torch.tensor([2.0])),
             ("fp8_static", 0, "row", None, False, torch.tensor([0.5])), ("fp8_per_token", 0, "row", 1.0, False, None)]
    return {c[0]: opcheck(torch.ops.tpfuse.residual_rmsnorm_quant.default, (s, r, w[0], 1e-6) + c) for c in cases}


# H = 96: rows shorter than their power-of-two block, so masked lanes and padded scale columns
# (align4(96 / 16) = 8 for the 128x4 layout) are exercised.
SPECS_96 = [Q.fp8_per_token(), Q.fp8_per_group(32, layout="col"), Q.nvfp4(3.0, swizzled=False),
            Q.nvfp4(3.0, swizzled=True)]


@pytest.mark.interpreter
def test_helpers_match_reference_bit_for_bit():
    ((results, opchecks),) = run_ranks(_helpers_rank, 1, env=INTERP, timeout_s=300)
    for kind, checks in opchecks.items():
        assert set(checks.values()) == {"SUCCESS"}, (kind, checks)
    y = crafted_rows()
    inputs = [y] * len(SPECS) + [y[:, :96].contiguous()] * len(SPECS_96)
    for spec, y, (codes, scale) in zip(SPECS + SPECS_96, inputs, results):
        ref_codes, ref_scale = quantize_ref(y, spec)
        assert _same(codes, ref_codes), (f"{spec.key}: codes differ at "
                                         f"{(_bits(codes) != _bits(ref_codes)).nonzero()[:4].tolist()}")
        assert _same(scale, ref_scale), f"{spec.key}: scales differ"
        if spec.kind == "fp8_per_token":
            assert ref_scale[0].item() == 0.0  # the all-zero row
        if spec.kind == "fp8_per_group" and spec.layout == "col":
            assert _meta(scale)[2] == (1, 8)  # DeepGEMM's column-major, M padded to a multiple of 4


EPI_SPECS = [Q.fp8_static(0.05, with_normed=True), Q.fp8_per_token(), Q.fp8_per_group(64, layout="col"),
             Q.nvfp4(20.0, swizzled=False), Q.nvfp4(torch.tensor([3.0]), swizzled=True, with_normed=True)]
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# rows of 192 = 128 + 64 and 320 = 256 + 64 columns (the kinds "int192", "rand192", "int320"), held
# whole in those two parts (a BLOCK_H below H: `tpfuse.kernels.epilogue.row_parts`)
WIDTHS = {"int96": 96, "int192": 192, "rand192": 192, "int320": 320}


def _inputs(kind, dtype, m, with_res):
    make = random_inputs if kind.startswith("rand") else small_integer_inputs
    h = WIDTHS.get(kind, H)
    s = make(0, m, h, dtype, seed=m)
    res = make(1, m, h, dtype, seed=m) if with_res else None
    w = ((1 + 0.1 * random_inputs(2, 1, h, torch.float32)[0]).to(dtype) if kind.startswith("rand")
         else make(2, 1, h, dtype)[0])
    return s, res, w


# Rows cut into 64-column slices, one program each (the launch `quant_launch_config` may choose at
# decode sizes): H = 128 in two whole slices, H = 96 in a whole one and a masked one.
SPLIT = (128, 4, 1, 64)
PARTS = {"int320": (256, 4, 1), "rand192": (128, 4, 1), "int192": (128, 2, 2)}  # rows whole, in two parts


def _cases():
    """(kind, dtype, M, with residual, spec index, launch config or None); the swizzled spec (128
    programs for the padded scale rows, slow in the interpreter) runs once a launch."""
    linear = [i for i, spec in enumerate(EPI_SPECS) if spec.layout != "swizzled"]
    swizzled = [i for i, spec in enumerate(EPI_SPECS) if spec.layout == "swizzled"]
    cases = [("int", dtype, 3, True, i, None) for dtype in DTYPES for i in linear]
    cases += [("int", torch.bfloat16, 3, True, i, None) for i in swizzled]
    cases += [("int", torch.bfloat16, 2, False, i, None) for i in linear[:2]]
    # rows shorter than their block
    cases += [("int96", torch.bfloat16, 3, True, i, None) for i in linear if EPI_SPECS[i].group in (0, 16)]
    cases += [("rand", torch.bfloat16, 6, True, i, None) for i in linear]
    cases += [("int", torch.bfloat16, 0, True, i, None) for i in (1, swizzled[0])]  # zero tokens
    cases += [("int", torch.bfloat16, 3, True, i, SPLIT) for i in linear + swizzled]
    cases += [("int96", torch.bfloat16, 3, True, i, SPLIT) for i in linear if EPI_SPECS[i].group in (0, 16)]
    cases += [("rand", torch.bfloat16, 6, True, i, SPLIT) for i in linear]
    cases += [("int", torch.bfloat16, 2, False, 1, SPLIT)]
    cases += [(kind, torch.bfloat16, 5 if kind == "int192" else 3, True, i, PARTS[kind])
              for kind in ("int320", "int192") for i in linear + swizzled]
    cases += [("rand192", torch.bfloat16, 6, True, i, PARTS["rand192"]) for i in linear]
    return cases


def _epilogue_rank(rank, world_size, cases):
    from tpfuse.kernels.custom_ops import residual_rmsnorm_quant_op
    from tpfuse.kernels.epilogue import residual_rmsnorm

    out = []
    for kind, dtype, m, with_res, i, config in cases:
        s, res, w = _inputs(kind, dtype, m, with_res)
        got = residual_rmsnorm(s, res, w, 1e-6, quant=EPI_SPECS[i], config=config)
        op = (residual_rmsnorm_quant_op(s, res, w, 1e-6, EPI_SPECS[i])
              if kind == "int" and dtype == torch.bfloat16 and config is None else None)
        out.append((tuple(_pack(t) for t in got), None if op is None else tuple(_pack(t) for t in op)))
    return out


def _ordinal(codes, nibbles: bool):
    c = _bits(codes).to(torch.int32)
    if nibbles:
        c = torch.stack([c & 0xF, c >> 4], dim=-1)
        return torch.where(c >= 8, -(c - 8), c)
    return torch.where(c >= 0x80, -(c - 0x80), c)


@pytest.mark.interpreter
@pytest.mark.slow
def test_quantized_epilogue_matches_reference():
    cases = _cases()
    (results,) = run_ranks(_epilogue_rank, 1, args=(cases,), env=INTERP, timeout_s=600)
    for (kind, dtype, m, with_res, i, config), (got, op) in zip(cases, results):
        spec = EPI_SPECS[i]
        s, res, w = _inputs(kind, dtype, m, with_res)
        ref = residual_rmsnorm_quant_ref(s, res, w, 1e-6, spec)
        label = f"{spec.key} {kind} {dtype} M={m} res={with_res} config={config}"
        got = Q.QuantOutput(*got)
        assert _same(got.residual, ref.residual), label  # the residual add is exact
        if op is not None:  # the torch.library op returns the launcher's bits and layouts
            assert all(_same(a, b) for a, b in zip(op, got)), label
        if not kind.startswith("rand"):  # exact sum of squares: the fp32 rows equal the reference's, so every bit does
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


def _degenerate_rows():
    """eps = 0 rows whose inverse RMS is inf: squares that underflow fp32 (row 0, with zeros among
    them, so y holds +-inf and NaN) and an all-zero row (y all NaN)."""
    tiny = torch.tensor([2.0**-80, 0.0, -2.0**-80, 2.0**-81], dtype=torch.bfloat16).repeat(2, H // 4)
    tiny[1] = 0
    return tiny


def _degenerate_rank(rank, world_size):
    from tpfuse.kernels.epilogue import residual_rmsnorm

    w = small_integer_inputs(2, 1, H, torch.bfloat16)[0]
    return [tuple(_pack(t) for t in residual_rmsnorm(_degenerate_rows(), None, w, 0.0, quant=Q.fp8_per_token(),
                                                     config=config)) for config in (None, SPLIT)]


@pytest.mark.interpreter
def test_degenerate_rows_quantize_as_the_reference():
    """Per-token FP8 of a row with an infinite inverse RMS: its absmax is inv * max |h * w| (inf,
    or NaN for the all-zero row) in the whole-row and the sliced kernel, as the reference says."""
    (results,) = run_ranks(_degenerate_rank, 1, env=INTERP, timeout_s=300)
    w = small_integer_inputs(2, 1, H, torch.bfloat16)[0]
    ref = residual_rmsnorm_quant_ref(_degenerate_rows(), None, w, 0.0, Q.fp8_per_token())
    assert ref.scale[0].item() == float("inf") and ref.scale[1].isnan().all()
    for config, got in zip((None, SPLIT), results):
        assert all(_same(a, b) for a, b in zip(Q.QuantOutput(*got), ref)), f"config={config}"


# ---- GPU tier ------------------------------------------------------------------------------------

MODEL_SPECS = [Q.fp8_static(0.02), Q.fp8_per_token(scale_ub=1.0), Q.fp8_per_group(128, layout="col"),
               Q.fp8_per_group(128), Q.nvfp4(200.0, swizzled=False), Q.nvfp4(200.0, swizzled=True, with_normed=True)]


def _on(spec, device="cuda"):
    scale = spec.scale.to(device) if isinstance(spec.scale, torch.Tensor) else spec.scale
    return Q.QuantSpec(spec.kind, spec.group, spec.layout, spec.scale_ub, spec.with_normed, scale)


def _cpu(result):
    return [None if t is None else (t.cpu() if t.stride(-1) == 1 or t.dim() < 2 else t.contiguous().cpu())
            for t in result]


@pytest.mark.gpu
@pytest.mark.parametrize("hw_fp8, hw_fp4", [(False, False), (True, False), (True, True)])
def test_helpers_on_gpu_match_reference(hw_fp8, hw_fp4):
    from tpfuse.kernels.device import hardware_fp4, hardware_fp8
    from tpfuse.kernels.quant import quantize

    if hw_fp8 and not hardware_fp8("cuda"):
        pytest.skip("this GPU has no e4m3 cvt (compute capability below 8.9)")
    if hw_fp4 and not hardware_fp4("cuda"):
        pytest.skip("this GPU has no e2m1 cvt (compute capability below 10.0)")
    y = crafted_rows()
    for spec in SPECS:
        codes, scale = quantize(y.cuda(), _on(spec), hw_fp8=hw_fp8, hw_fp4=hw_fp4)
        ref_codes, ref_scale = quantize_ref(y, spec)
        assert _same(codes.cpu(), ref_codes), f"{spec.key} hw_fp8={hw_fp8}: codes differ"
        assert _same(scale.contiguous().cpu() if scale.dim() > 1 else scale.cpu(), ref_scale.contiguous()), (
            f"{spec.key}: scales differ")


@pytest.mark.gpu
def test_reference_e4m3_equals_torch_cuda_conversion():
    from tpfuse.reference import _e4m3_codes

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(1 << 20, generator=gen)
         * torch.exp2(torch.randint(-24, 10, (1 << 20,), generator=gen).float())).clamp(-448, 448)
    assert torch.equal(_e4m3_codes(x.double()), x.cuda().to(torch.float8_e4m3fn).view(torch.uint8).cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("hidden, config", [(6144, None), (7168, None), (6144, (8192, 16, 1, 2048)),
                                            (7168, (8192, 4, 1, 1024)), (6144, (8192, 8, 1, 512)),
                                            (6144, (4096, 4, 1)), (5120, (4096, 8, 2)),
                                            (6144, (4096, 4, 1, 4096, 128)), (7168, (8192, 4, 1, 8192, 96))])
def test_epilogue_at_model_shapes(hidden, config):
    """Whole rows, rows cut into slices, one program each, and whole rows held in two parts
    (BLOCK_H 4096: 6144 = 4096 + 2048, 5120 = 4096 + 1024), with the registers a thread may use
    capped (96 at 7168: ptxas spills); config None: the launcher's own
    (per-group FP8 cuts rows at 5, 37 and 64 tokens, into slices of 1024, 2048 and 4096 columns
    at hidden 6144; at 256 tokens NVFP4 holds rows of 6144 in two parts with 128 registers a
    thread, per-group FP8 in two parts with 8 warps)."""
    from tpfuse.kernels.epilogue import residual_rmsnorm

    for spec in MODEL_SPECS:
        w = small_integer_inputs(2, 1, hidden, torch.bfloat16)[0]
        for m in (64, 37, 5):
            s, r = (small_integer_inputs(i, m, hidden, torch.bfloat16) for i in (0, 1))
            got = _cpu(residual_rmsnorm(s.cuda(), r.cuda(), w.cuda(), 1e-6, quant=_on(spec), config=config))
            ref = residual_rmsnorm_quant_ref(s, r, w, 1e-6, spec)
            assert all(_same(a, b.contiguous() if b is not None else None) for a, b in zip(got, ref)), (spec.key, m)
        s, r = random_inputs(0, 256, hidden, torch.bfloat16), random_inputs(1, 256, hidden, torch.bfloat16)
        got = _cpu(residual_rmsnorm(s.cuda(), r.cuda(), w.cuda(), 1e-6, quant=_on(spec), config=config))
        ref = residual_rmsnorm_quant_ref(s, r, w, 1e-6, spec)
        assert _same(got[2], ref.residual)
        nib = spec.kind == "nvfp4"
        # see test_quantized_epilogue_matches_reference: one code step at most
        if not nib or _same(got[1], ref.scale.contiguous()):
            assert (_ordinal(got[0], nib) - _ordinal(ref.out, nib)).abs().max() <= 1, spec.key


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager():
    from tpfuse.kernels.epilogue import residual_rmsnorm

    s, r = random_inputs(0, 64, 6144, torch.bfloat16).cuda(), random_inputs(1, 64, 6144, torch.bfloat16).cuda()
    w = torch.ones(6144, dtype=torch.bfloat16, device="cuda")
    for spec in (Q.fp8_per_token(), Q.nvfp4(torch.tensor([100.0], device="cuda"), swizzled=True)):
        eager = residual_rmsnorm(s, r, w, 1e-6, quant=spec)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = residual_rmsnorm(s, r, w, 1e-6, quant=spec)
        for t in captured[:3]:
            t.view(torch.uint8).fill_(0xFF) if t.element_size() == 1 else t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(_same(a, b) for a, b in zip(captured[:3], eager[:3])), spec.key


@pytest.mark.gpu
def test_flashinfer_fp4_quantize_agrees():
    try:
        from flashinfer import fp4_quantize
    except Exception as exc:
        pytest.skip(f"flashinfer not importable: {type(exc).__name__}: {exc}")
    if torch.cuda.get_device_capability() < (10, 0):
        pytest.skip("FlashInfer's fp4_quantize converts only on sm_100 and newer (cvt_warp_fp16_to_fp4 is "
                    "compiled for __CUDA_ARCH__ >= 1000 and returns zeros below)")
    x = random_inputs(0, 256, 7168, torch.bfloat16)
    gs = torch.tensor([448.0 * 6 / x.abs().max().item()])
    fi_codes, fi_sf = fp4_quantize(x.cuda(), gs.cuda(), 16, False, True)
    codes, sf = quantize_ref(x.float(), Q.nvfp4(gs, swizzled=True))
    assert torch.equal(fi_sf.view(torch.uint8).reshape(-1).cpu(), sf.view(torch.uint8).reshape(-1))
    differ = (fi_codes.view(torch.uint8).cpu() != codes).float().mean().item()
    assert differ == 0.0, f"{differ:.2e} of the code bytes differ from FlashInfer's"


def _nccl_rank(rank, world_size):
    from tpfuse import Communicator

    out = []
    with Communicator(strategy="nccl_epilogue") as comm:
        x = small_integer_inputs(rank, 9, 6144, torch.bfloat16).cuda()
        w = small_integer_inputs(5, 1, 6144, torch.bfloat16)[0].cuda()
        for spec in MODEL_SPECS:
            out.append(_host(comm.all_reduce_residual_rmsnorm(x, x, w, quant=_on(spec))))
        # CUDA graph: warm up on a side stream, capture, poison the outputs, replay
        spec = _on(Q.nvfp4(torch.tensor([200.0]), swizzled=True))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            comm.all_reduce_residual_rmsnorm(x, x, w, quant=spec)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = comm.all_reduce_residual_rmsnorm(x, x, w, quant=spec)
        for t in captured[:3]:
            t.view(torch.uint8).fill_(0xFF)
        graph.replay()
        torch.cuda.synchronize()
        out.append(_host(captured))
    return out


def _host(result):
    return [None if t is None
            else t.contiguous().view(torch.uint8).cpu() if t.element_size() == 1 else t.contiguous().cpu()
            for t in result]


@pytest.mark.gpu
def test_nccl_epilogue_on_one_rank():
    from tpfuse.spawn import run_ranks

    (got,) = run_ranks(_nccl_rank, 1, backend="nccl", timeout_s=300)
    x = small_integer_inputs(0, 9, 6144, torch.bfloat16)
    w = small_integer_inputs(5, 1, 6144, torch.bfloat16)[0]
    graph_spec = Q.nvfp4(torch.tensor([200.0]), swizzled=True)
    assert len(got) == len(MODEL_SPECS) + 1
    for spec, out in zip(MODEL_SPECS + [graph_spec], got):
        ref = residual_rmsnorm_quant_ref(x, x, w, 1e-6, spec)
        for g, r in zip(out, ref):
            if r is None:
                assert g is None
                continue
            r = r.contiguous()
            assert torch.equal(g, r.view(torch.uint8) if r.element_size() == 1 else r), spec.key


# (tokens, hidden): 9 x 1024 rows of one chunk; 1 x 6144 a row split over programs that each
# hold one item (the kernels' one-pass path); 16 x 6144 split rows, several items per program.
# Small integers keep every sum of squares exact in fp32, so every bit is the reference's.
SHARED_SHAPES = ((9, 1024), (1, 6144), (16, 6144))


def _shared_inputs(rank, m, h):
    return (small_integer_inputs(rank, m, h, torch.bfloat16), small_integer_inputs(50, m, h, torch.bfloat16),
            small_integer_inputs(51, 1, h, torch.bfloat16)[0])


def _shared_gpu_rank(rank, world_size, strategy):
    from tpfuse import Communicator

    torch.cuda.set_device(0)
    out = []
    with Communicator(strategy=strategy, device="cuda") as comm:
        for m, h in SHARED_SHAPES:
            x, res, w = (t.cuda() for t in _shared_inputs(rank, m, h))
            out.append([_host(comm.all_reduce_residual_rmsnorm(x, res, w, quant=_on(spec))) for spec in MODEL_SPECS])
        comm.check()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["reference", "ring", "oneshot", "twoshot"])
def test_ranks_sharing_one_gpu_get_the_reference_bits(strategy):
    """CUDA tensors over gloo, two ranks on one GPU: the reference quantizer on the device, and the
    peer strategies quantizing inside their kernel (split rows exchange per-token absmax)."""
    from tpfuse.reference import all_reduce_residual_rmsnorm_quant_ref
    from tpfuse.spawn import run_ranks

    results = run_ranks(_shared_gpu_rank, 2, args=(strategy,), env=SHARED_ENV, timeout_s=300)
    for k, (m, h) in enumerate(SHARED_SHAPES):
        xs = [_shared_inputs(r, m, h)[0] for r in range(2)]
        _, res, w = _shared_inputs(0, m, h)
        for i, spec in enumerate(MODEL_SPECS):
            ref = _host(all_reduce_residual_rmsnorm_quant_ref(xs, res, w, 1e-6, spec))
            for rank in range(2):
                for g, r in zip(results[rank][k][i], ref):
                    assert (g is None and r is None) or torch.equal(g, r), (strategy, rank, (m, h), spec.key)


SHARED_ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
              "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


def _quant_graph_rank(rank, world_size, strategy):
    import torch.distributed as dist

    from tpfuse import Communicator

    torch.cuda.set_device(0)
    m, h = 16, 6144
    spec = Q.fp8_per_token(scale_ub=1.0)
    outs = []
    with Communicator(strategy=strategy, device="cuda", timeout_s=20.0) as comm:
        comm.prepare(hidden=h, dtype=torch.bfloat16, max_tokens=64)
        x, res = (torch.zeros(m, h, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        w = torch.zeros(h, dtype=torch.bfloat16, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            comm.all_reduce_residual_rmsnorm(x.fill_(1), res, w.fill_(1), quant=spec)  # compiles the variant
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            q = comm.all_reduce_residual_rmsnorm(x, res, w, quant=spec)
        for step in range(3):
            x.copy_(small_integer_inputs(rank, m, h, torch.bfloat16, seed=step))
            res.copy_(small_integer_inputs(50, m, h, torch.bfloat16, seed=step))
            w.copy_(small_integer_inputs(51, 1, h, torch.bfloat16, seed=step)[0])
            q.out.view(torch.uint8).fill_(0x7F), q.scale.fill_(float("nan"))
            graph.replay()
            outs.append(_host(q))
        comm.check()
        dist.barrier()
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["oneshot", "twoshot"])
def test_quantized_peer_calls_replay_in_a_cuda_graph(strategy):
    from tpfuse.reference import all_reduce_residual_rmsnorm_quant_ref
    from tpfuse.spawn import run_ranks

    m, h = 16, 6144
    results = run_ranks(_quant_graph_rank, 2, args=(strategy,), env=SHARED_ENV, timeout_s=300)
    for step in range(3):
        xs = [small_integer_inputs(r, m, h, torch.bfloat16, seed=step) for r in range(2)]
        res = small_integer_inputs(50, m, h, torch.bfloat16, seed=step)
        w = small_integer_inputs(51, 1, h, torch.bfloat16, seed=step)[0]
        ref = _host(all_reduce_residual_rmsnorm_quant_ref(xs, res, w, 1e-6, Q.fp8_per_token(scale_ub=1.0)))
        for rank in range(2):
            for g, r in zip(results[rank][step], ref):
                assert (g is None and r is None) or torch.equal(g, r), (strategy, rank, step)


# ---- PTX on CPU (plain tier) ---------------------------------------------------------------------

SIG = {"s_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "newres_ptr": "*bf16", "M": "i32",
       "H": "i32", "eps": "fp32", "q_ptr": "*u8", "q_row_stride": "i32", "sc_ptr": "*fp32", "s_row_stride": "i32",
       "s_col_stride": "i32", "param_ptr": "*fp32", "scale_ub": "fp32", "BLOCK_H": "constexpr", "ROWS": "constexpr",
       "SLICE": "constexpr", "HAS_RES": "constexpr", "SOFT_BF16": "constexpr", "WITH_NORMED": "constexpr",
       "KIND": "constexpr", "GROUP": "constexpr", "SWIZZLED": "constexpr", "HAS_UB": "constexpr", "HW_CVT": "constexpr",
       "P1": "constexpr"}
ALIGNED = ("s_ptr", "res_ptr", "w_ptr", "out_ptr", "newres_ptr", "H", "q_ptr", "q_row_stride", "sc_ptr", "param_ptr")


def _ptx(cc: int, kind: int, group: int, swizzled: bool, hw: int, cut: int = 8192, warps: int = 16,
         parts: tuple = (8192, 0)) -> str:
    """PTX of the quantized epilogue kernel for format KIND on sm_`cc` (KIND 0: the unquantized
    epilogue kernel), rows of 8192 columns quantized `cut` columns a program of `warps` warps, or
    rows held in two parts of (BLOCK_H, P1) columns."""
    pytest.importorskip("triton")
    from support.ptx import lower_to_ptx
    from tpfuse.kernels.epilogue import residual_rmsnorm_kernel, residual_rmsnorm_quant_kernel

    sig = dict(SIG, sc_ptr="*u8" if kind == 4 else "*fp32")
    constexprs = {"BLOCK_H": parts[0], "ROWS": 1, "SLICE": min(cut, parts[0]), "HAS_RES": True, "SOFT_BF16": False,
                  "WITH_NORMED": False, "KIND": kind, "GROUP": group, "SWIZZLED": swizzled, "HAS_UB": False,
                  "HW_CVT": hw, "P1": parts[1]}
    kernel = residual_rmsnorm_quant_kernel
    if kind == 0:
        kernel = residual_rmsnorm_kernel
        constexprs = {k: constexprs[k] for k in ("BLOCK_H", "ROWS", "HAS_RES", "SOFT_BF16")}
        sig = {**dict(list(SIG.items())[:8]), **{k: "constexpr" for k in constexprs}}
    return lower_to_ptx(kernel, sig, constexprs, ALIGNED, cc, num_warps=warps)


def test_software_and_hardware_paths_lower_as_admitted():
    sm80 = _ptx(80, 2, 16, False, 4)  # fp8 per token, software
    assert not re.search(r"cvt\.[a-z.]*e4m3", sm80) and "st.global.v4.b32" in sm80
    sm90 = _ptx(90, 3, 128, False, 5)  # fp8 per group, hardware cvt
    assert set(re.findall(r"cvt\.[a-z0-9.]*e4m3[a-z0-9.]*", sm90)) == {"cvt.rn.satfinite.e4m3x2.f32"}
    # static FP8 on sm_90: the cvt saturates by itself and NaN codes are fixed on packed words, so
    # no per-element clamp or select is left (32 min/max and 16 selects before)
    static = _ptx(90, 1, 16, False, 5)
    assert not re.search(r"\b(min|max)\.f32", static) and len(re.findall(r"\bselp\.", static)) <= 2
    fp4 = _ptx(90, 4, 16, True, 5)  # nvfp4 on sm_90: e2m1 in software, block scales by the e4m3 cvt
    assert not re.search(r"e2m1", fp4) and "st.global.v4.b32" in fp4


def test_codes_leave_without_a_shared_memory_layout_change():
    """The 16-bit new residual and the codes are stored from one register layout: the only
    barriers are the reductions' (the norm's sum of squares, per-token FP8's row absmax; a
    per-block absmax stays within a warp). A flat uint8 code store made Triton move each row through shared
    memory to a 16-a-thread layout: two barriers more a row; so did Triton's own store of the
    per-block scales."""
    barriers = {kind: len(re.findall(r"bar\.sync", _ptx(90, kind, group, kind == 4, 5)))
                for kind, group in ((0, 16), (1, 16), (2, 16), (3, 128), (4, 16))}
    norm = barriers.pop(0)  # the unquantized kernel: the sum of squares alone
    # per-block scales are stored from the layout they were reduced into (store_scales): no
    # shared-memory move of the scales either; per-token FP8 adds its row absmax reduction
    assert barriers[1] == barriers[3] == barriers[4] == norm and barriers[2] <= norm + 2, (norm, barriers)
    # 8 codes a thread in one 64-bit store; the mask built on the 2-D offsets keeps the store
    # vectorised (a reshaped 1-D mask gave 8 single-byte stores with Triton 3.6)
    assert set(re.findall(r"st\.global[.\w]*", _ptx(90, 1, 16, False, 5))) == {"st.global.v2.b32", "st.global.v4.b32"}


def test_a_row_in_two_parts_converts_no_masked_lane():
    """NVFP4 rows of 6144 = 4096 + 2048 held in two parts: fewer e2m1 conversions a thread than
    one masked block of 8192 (its software conversion ends each code with a NaN select), and
    ptxas takes the kernel."""
    from support.ptx import assemble

    masked, parts = (_ptx(90, 4, 16, True, 5, warps=4, parts=p) for p in ((8192, 0), (4096, 2048)))
    selects = [len(re.findall(r"\bselp\.b32", ptx)) for ptx in (masked, parts)]
    assert selects[1] <= selects[0] * 3 // 4, selects  # 6144 of 8192 lanes
    assemble(parts)


@pytest.mark.parametrize("cc", [100, 120])  # B200-class and RTX PRO 6000-class (Triton targets sm_100a / sm_120a)
def test_hardware_e2m1_path_assembles_for_blackwell(cc):
    ptx = _ptx(cc, 4, 16, True, 7)
    assert "cvt.rn.satfinite.e2m1x2.f32" in ptx
    from support.ptx import assemble

    assemble(ptx)


def _column_major_padding_rank(rank, world_size):
    import tpfuse.kernels.custom_ops  # noqa: F401  (registers the ops)
    from support.quant_output import poisoned_empty

    out = {}
    with poisoned_empty():
        for m in (1, 2, 3, 4, 5, 7):
            s, r, w = (small_integer_inputs(i, m, 64, torch.bfloat16) for i in range(3))
            codes, scales, _, _ = torch.ops.tpfuse.residual_rmsnorm_quant(s, r, w[0], 1e-6, "fp8_per_group", 16, "col",
                                                                          None, False, None)
            out[m] = scales.clone()
    return out


@pytest.mark.interpreter
def test_column_major_group_scales_leave_no_padding_byte_unwritten():
    """DeepGEMM's column-major per-group scales are returned as their whole (H/G, align4(M))
    storage: the padding rows M .. align4(M) - 1 are zeros, not whatever the allocator held, and
    the rows of real tokens are the reference's scales."""
    (out,) = run_ranks(_column_major_padding_rank, 1, env=INTERP, timeout_s=300)
    for m, scales in out.items():
        assert scales.shape == (4, -(-m // 4) * 4), (m, scales.shape)
        assert torch.equal(scales[:, m:], torch.zeros(4, scales.shape[1] - m)), (m, scales)
        s, r, w = (small_integer_inputs(i, m, 64, torch.bfloat16) for i in range(3))
        want = residual_rmsnorm_quant_ref(s, r, w[0], 1e-6, Q.fp8_per_group(16, layout="col"))
        assert torch.equal(scales[:, :m], want.scale.t()), m


def _swizzled_padding_rank(rank, world_size):
    import tpfuse.kernels.custom_ops  # noqa: F401  (registers the ops)
    from support.quant_output import poisoned_empty
    from tpfuse.kernels.quant import quantize

    out = {}
    with poisoned_empty():
        for m, h in ((1, 48), (3, 96), (127, 96), (128, 48), (129, 256), (130, 1040)):
            s, r, w = (small_integer_inputs(i, m, h, torch.bfloat16) for i in range(3))
            _, epilogue_scales, _, _ = torch.ops.tpfuse.residual_rmsnorm_quant(s, r, w[0], 1e-6, "nvfp4", 16,
                                                                                "swizzled", None, False,
                                                                                torch.tensor([30.0]))
            _, quantizer_scales = quantize(s.float(), Q.nvfp4(30.0, swizzled=True))
            out[m, h] = [t.view(torch.uint8).clone() for t in (epilogue_scales, quantizer_scales)]
    return out


@pytest.mark.interpreter
def test_swizzled_nvfp4_padding_is_zeroed_whatever_the_allocator_held():
    """The 128x4-swizzled NVFP4 scales of the padding rows (M .. align128(M) - 1, a tile's words
    zeroed a chunk at a time) are zeros in buffers that held 0xAB, with one, several and no
    padding rows, one and several scale-word columns and several chunks of words (h = 1040: 17
    words a row over 130 rows); the real rows are the reference's, in the epilogue and in the
    standalone quantizer."""
    (out,) = run_ranks(_swizzled_padding_rank, 1, env=INTERP, timeout_s=300)
    for (m, h), (epilogue_scales, quantizer_scales) in out.items():
        s, r, w = (small_integer_inputs(i, m, h, torch.bfloat16) for i in range(3))
        want = residual_rmsnorm_quant_ref(s, r, w[0], 1e-6, Q.nvfp4(30.0, swizzled=True)).scale.view(torch.uint8)
        assert want.shape == (-(-m // 128) * 128, -(-h // 64) * 4), (m, h, want.shape)
        assert torch.equal(epilogue_scales, want), (m, h)
        _, want_q = quantize_ref(s.float(), Q.nvfp4(30.0, swizzled=True))
        assert torch.equal(quantizer_scales, want_q.view(torch.uint8)), (m, h)
        assert (m % 128 == 0) or not torch.equal(want, torch.zeros_like(want)), "no real scale to tell apart"


# ---- launch configurations (plain tier) ----------------------------------------------------------

def test_rows_are_cut_only_where_every_slice_holds_whole_scale_blocks():
    """The launcher's rule: slices for per-group FP8 and NVFP4 at decode sizes (the measured
    choices at hidden 6144 and 7168), each a launch `check_quant_config` accepts, with a grid of
    at most SLICE_PROGRAMS programs; whole rows for static and per-token FP8 and at prefill."""
    from tpfuse.kernels.epilogue import SLICE_PROGRAMS, check_quant_config, quant_launch_config

    measured = {(6144, 1, "fp8_per_group"): (8, 1024), (6144, 32, "fp8_per_group"): (16, 2048),
                (6144, 64, "fp8_per_group"): (16, 4096), (7168, 32, "fp8_per_group"): (16, 2048),
                (6144, 16, "nvfp4"): (4, 1024), (6144, 32, "nvfp4"): (8, 2048), (6144, 64, "nvfp4"): (8, 4096),
                (7168, 32, "nvfp4"): (16, 8192), (6144, 1, "fp8_per_token"): (4, 8192),
                (6144, 64, "fp8_per_token"): (16, 8192)}
    for (hidden, tokens, kind), (warps, cut) in measured.items():
        assert quant_launch_config(hidden, 2, tokens, kind, group=16 if kind == "nvfp4" else 128) == \
            (8192, warps, 1, cut, 0), (hidden, tokens, kind)
    specs = {"fp8_static": Q.fp8_static(1.0), "fp8_per_token": Q.fp8_per_token(), "fp8_per_group": Q.fp8_per_group(128),
             "nvfp4": Q.nvfp4(1.0)}
    for hidden in (96, 2048, 6144, 7168, 16384):
        for kind, spec in specs.items():
            for tokens in (1, 16, 17, 32, 64, 128, 4096):
                config = quant_launch_config(hidden, 2, tokens, kind, group=spec.group)
                assert check_quant_config(config, hidden, spec) == config  # a launch the kernel can run
                block, _, rows, cut, _ = config
                if cut < block:
                    assert kind in ("fp8_per_group", "nvfp4") and rows == 1, (hidden, kind, tokens, config)
                    assert tokens * -(-hidden // cut) <= SLICE_PROGRAMS, (hidden, kind, tokens, config)
                if tokens >= 256:
                    assert cut == block, (hidden, kind, tokens, config)


@pytest.mark.parametrize("config, says", [((8192, 8, 1, 96), "power of two"), ((8192, 8, 1, 64), "from 128"),
                                          ((8192, 8, 2, 1024), "rows 1"), ((6000, 8, 1), "BLOCK_H a power of two"),
                                          ((2048, 8, 1), "smaller power of two"), ((4096, 8, 1, 1024), "no slice"),
                                          ((8192, 3, 1), "num_warps"), ((8192, 8), "config must be"),
                                          ((8192, 8, 1, 8192, 8), "registers a thread"),
                                          ((8192, 8, 1, 8192, 128, 1), "config must be")])
def test_a_launch_config_the_kernel_cannot_run_is_refused_with_the_fix(config, says):
    from tpfuse.kernels.epilogue import check_quant_config

    with pytest.raises(ValueError, match=says) as info:
        check_quant_config(config, 6144, Q.fp8_per_group(128))
    assert "omit" in str(info.value)
    assert check_quant_config((8192, 8, 1), 6144, Q.fp8_per_group(128)) == (8192, 8, 1, 8192, 0)
    assert check_quant_config((8192, 8, 1, 8192, 128), 6144, Q.fp8_per_group(128)) == (8192, 8, 1, 8192, 128)
    with pytest.raises(ValueError, match="from 64"):  # every format: slices of at least 64 columns
        check_quant_config((8192, 8, 1, 32), 6144, Q.fp8_static(1.0))
    with pytest.raises(ValueError, match="at least 128"):  # a part narrower than a scale block
        check_quant_config((4096, 4, 1), 4096 + 64, Q.fp8_per_group(128))


def test_rows_held_in_two_parts_are_a_power_of_two_and_a_smaller_one():
    from tpfuse.kernels.epilogue import quant_launch_config, row_parts

    assert row_parts(6144, 4096) == 2048 and row_parts(5120, 4096) == 1024
    for hidden, block in ((7168, 4096), (4096, 4096), (8192, 2048), (6144, 3072)):  # 3 parts, none, ...
        with pytest.raises(ValueError, match="BLOCK_H of"):
            row_parts(hidden, block)
    # the launcher holds prefill rows in two parts where the smaller is at least one code run a
    # thread (4 warps: 1024 columns): NVFP4 and per-group FP8 rows filling up to 3/4 of their masked
    # block; where a thread of 4 warps would hold more than 40 columns (6144: 48) per-group FP8
    # takes 8 warps and NVFP4 caps a thread at 128 registers (measured); static and per-token FP8
    # and three-part rows keep one masked block
    assert quant_launch_config(6144, 2, 4096, "nvfp4", group=16) == (4096, 4, 1, 4096, 128)
    assert quant_launch_config(7168, 2, 4096, "nvfp4", group=16) == (8192, 4, 1, 8192, 0)
    assert quant_launch_config(5120, 2, 4096, "nvfp4", group=16) == (4096, 4, 1, 4096, 0)
    assert quant_launch_config(5120, 2, 4096, "fp8_per_group", group=128) == (4096, 4, 1, 4096, 0)
    assert quant_launch_config(6144, 2, 4096, "fp8_per_group", group=128) == (4096, 8, 1, 4096, 0)
    assert quant_launch_config(7168, 2, 4096, "fp8_per_group", group=128) == (8192, 4, 1, 8192, 0)
    assert quant_launch_config(5120, 2, 4096, "fp8_per_token") == (8192, 4, 1, 8192, 0)
    assert quant_launch_config(2560, 2, 4096, "nvfp4", group=16) == (4096, 4, 1, 4096, 0)  # 512 < 1024: masked
    assert quant_launch_config(6144, 2, 255, "nvfp4", group=16)[0] == 8192
