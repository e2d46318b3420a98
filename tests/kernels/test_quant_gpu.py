"""Quantized output on a GPU: the helpers (software and hardware e4m3), the epilogue at model
shapes, torch's own float8 conversion, FlashInfer's FP4 quantizer where it runs, CUDA-graph
capture, and nccl_epilogue on one NCCL rank. GPU tier (`gpu` marker): skipped without a CUDA GPU.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_quant_gpu.py
"""

import pytest
import torch
from tests.kernels.test_quant_interpreter import SPECS, _ordinal, _same, crafted_rows

from tpfuse import quant as Q
from tpfuse.reference import quantize_ref, random_inputs, residual_rmsnorm_quant_ref, small_integer_inputs

pytestmark = pytest.mark.gpu

MODEL_SPECS = [Q.fp8_static(0.02), Q.fp8_per_token(scale_ub=1.0), Q.fp8_per_group(128, layout="col"),
               Q.fp8_per_group(128), Q.nvfp4(200.0, swizzled=False), Q.nvfp4(200.0, swizzled=True, with_normed=True)]


def _on(spec, device="cuda"):
    scale = spec.scale.to(device) if isinstance(spec.scale, torch.Tensor) else spec.scale
    return Q.QuantSpec(spec.kind, spec.group, spec.layout, spec.scale_ub, spec.with_normed, scale)


def _cpu(result):
    return [None if t is None else (t.cpu() if t.stride(-1) == 1 or t.dim() < 2 else t.contiguous().cpu()) for t in result]


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
        assert _same(scale.contiguous().cpu() if scale.dim() > 1 else scale.cpu(), ref_scale.contiguous()), f"{spec.key}: scales differ"


def test_reference_e4m3_equals_torch_cuda_conversion():
    from tpfuse.reference import _e4m3_codes

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(1 << 20, generator=gen) * torch.exp2(torch.randint(-24, 10, (1 << 20,), generator=gen).float())).clamp(-448, 448)
    assert torch.equal(_e4m3_codes(x.double()), x.cuda().to(torch.float8_e4m3fn).view(torch.uint8).cpu())


@pytest.mark.parametrize("hidden", [6144, 7168])
def test_epilogue_at_model_shapes(hidden):
    from tpfuse.kernels.epilogue import residual_rmsnorm

    for spec in MODEL_SPECS:
        s, r = small_integer_inputs(0, 37, hidden, torch.bfloat16), small_integer_inputs(1, 37, hidden, torch.bfloat16)
        w = small_integer_inputs(2, 1, hidden, torch.bfloat16)[0]
        got = _cpu(residual_rmsnorm(s.cuda(), r.cuda(), w.cuda(), 1e-6, quant=_on(spec)))
        ref = residual_rmsnorm_quant_ref(s, r, w, 1e-6, spec)
        assert all(_same(a, b.contiguous() if b is not None else None) for a, b in zip(got, ref)), spec.key
        s, r = random_inputs(0, 256, hidden, torch.bfloat16), random_inputs(1, 256, hidden, torch.bfloat16)
        got = _cpu(residual_rmsnorm(s.cuda(), r.cuda(), w.cuda(), 1e-6, quant=_on(spec)))
        ref = residual_rmsnorm_quant_ref(s, r, w, 1e-6, spec)
        assert _same(got[2], ref.residual)
        nib = spec.kind == "nvfp4"
        if not nib or _same(got[1], ref.scale.contiguous()):  # see test_quant_interpreter: one code step at most
            assert (_ordinal(got[0], nib) - _ordinal(ref.out, nib)).abs().max() <= 1, spec.key


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
    return [None if t is None else t.contiguous().view(torch.uint8).cpu() if t.element_size() == 1 else t.contiguous().cpu()
            for t in result]


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
