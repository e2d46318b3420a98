"""The fused residual-add + RMSNorm epilogue (`tpfuse.kernels.epilogue`): its values against the
reference and its host side, one launch pre-bound per shape (`tpfuse.kernels.launcher`).

- interpreter and gpu: every hidden size and dtype against `tpfuse.reference` (the interpreter in
  one spawned process, TRITON_INTERPRET set before any kernel import); repeated calls (the cache's
  hit path) give the reference's bits.
- plain: with the launch stubbed (`StubbedLaunches`), a steady-state call hands the compiled
  kernel's launcher exactly what Triton's own launch of the same call does, per variant (residual
  or not, quantized output, an explicit config), and a call that Triton would launch otherwise
  (an unaligned view) takes Triton's launch.
- gpu: the pre-bound launch gives the bits of Triton's ordinary launch of the same kernel and meta
  and of `tpfuse.reference`, eagerly and replayed from a CUDA graph, and unaligned views still give
  correct results.
"""

import os

import pytest
import torch

import tpfuse.quant as Q
from support.peer import INTERP, nan_pair
from tpfuse.reference import (
    TOLERANCE,
    random_inputs,
    relative_error,
    residual_rmsnorm_quant_ref,
    residual_rmsnorm_ref,
    small_integer_inputs,
)
from tpfuse.spawn import run_ranks

compiled_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                   reason="TRITON_INTERPRET=1 makes interpreted kernels: nothing is pre-bound")


def _inputs(m, h, dtype, device="cpu", offset=0):
    """(s, residual, weight); s starts `offset` elements into its storage, on `device` itself (a
    copy to another device would be a fresh, aligned tensor)."""
    s = random_inputs(0, m * h + offset, 1, dtype, seed=h)[:, 0].to(device)[offset:].view(m, h)
    r = random_inputs(1, m, h, dtype, seed=h).to(device)
    w = (1 + 0.1 * random_inputs(2, 1, h, torch.float32, seed=h)[0]).to(dtype).to(device)
    return s, r, w


def _plain(call):
    call = list(call)
    for i in (7, 8):  # empty launch-hook chains (Triton >= 3.5) skip like None
        if call[i] is not None and not getattr(call[i], "calls", True):
            call[i] = None
    return call


def _same_call(a, b):
    a, b = _plain(a), _plain(b)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x is y if isinstance(x, torch.Tensor) else x == y, (x, y)


@compiled_only
def test_steady_calls_hand_the_launcher_what_triton_s_launch_does(monkeypatch):
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    from tpfuse.kernels import epilogue as E
    from tpfuse.kernels.launcher import StubbedLaunches

    ordinary = []
    original = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: ordinary.append(1) or original(self, *a, **k))
    m, h = 5, 96
    try:
        with StubbedLaunches(keep=64) as stub:
            E._LAUNCHES.clear()
            for with_res, config in ((True, None), (False, None), (True, (128, 2, 2))):
                s, r, w = _inputs(m, h, torch.float32)
                res = r if with_res else None
                E.residual_rmsnorm(s, res, w, 1e-6, config=config)  # binds: Triton's launch
                s, r, w = _inputs(m, h, torch.float32)  # new tensors, same shape
                res = r if with_res else None
                out = (torch.empty_like(s), torch.empty_like(s))
                before = len(ordinary)
                E.residual_rmsnorm(s, res, w, 2e-5, out=out, config=config)
                assert len(ordinary) == before, "the steady call went through Triton's launch"
                block, warps, rows = config or E.launch_config(h, 4, m)
                E.residual_rmsnorm_kernel[(-(-m // rows),)](
                    s, r if with_res else s, w, *out, m, h, 2e-5, BLOCK_H=block, ROWS=rows, HAS_RES=with_res,
                    SOFT_BF16=False, num_warps=warps)
                _same_call(stub.calls[-2], stub.calls[-1])
            assert len(E._LAUNCHES) == 3 and all(launch.prebound for launch in E._LAUNCHES.values())
            before = len(ordinary)
            s, r, w = _inputs(m, h, torch.float32, offset=1)  # an unaligned view: Triton's launch
            assert s.data_ptr() % 16
            E.residual_rmsnorm(s, r, w, 1e-6)
            assert len(ordinary) == before + 1
            spec = Q.fp8_per_token()  # quantized output: one more variant, its steady calls pre-bound too
            E.residual_rmsnorm(*_inputs(m, h, torch.float32), 1e-6, quant=spec)
            before = len(ordinary)
            E.residual_rmsnorm(*_inputs(m, h, torch.float32), 1e-6, quant=spec)
            assert len(ordinary) == before and len(E._LAUNCHES) == 4
    finally:
        E._LAUNCHES.clear()  # stub launches must not serve a later real call in this process


def _interpreted_rank(rank, world_size):
    from tpfuse.kernels.epilogue import launch_residual_rmsnorm, residual_rmsnorm

    results = []
    for m, h, dtype in ((3, 64, torch.bfloat16), (2, 40, torch.float32)):
        for i in range(3):  # the first call binds, later ones hit the per-shape cache
            s = small_integer_inputs(i, m, h, dtype, seed=h)
            r = small_integer_inputs(10 + i, m, h, dtype, seed=h)
            w = small_integer_inputs(20 + i, 1, h, dtype, seed=h)[0]
            nan = (torch.full_like(s, float("nan")), torch.full_like(s, float("nan")))
            results.append(((s, r, w), residual_rmsnorm(s, r, w, 1e-6, out=nan),
                            launch_residual_rmsnorm(s, None, w, 1e-6)))
    return results


@pytest.mark.interpreter
def test_cached_launches_match_the_reference_in_the_interpreter():
    (results,) = run_ranks(_interpreted_rank, 1, env={"TRITON_INTERPRET": "1"}, timeout_s=120)
    for (s, r, w), with_res, without in results:
        for got, want in zip(with_res, residual_rmsnorm_ref(s, r, w, 1e-6)):
            assert torch.equal(got, want)  # small integers: every sum exact
        for got, want in zip(without, residual_rmsnorm_ref(s, None, w, 1e-6)):
            assert torch.equal(got, want)


# ---- GPU ---------------------------------------------------------------------------------------

def _ordinary(s, res, w, eps):
    """Triton's ordinary launch of the kernel with the meta the launcher picks: the path before
    launches were pre-bound."""
    from tpfuse.kernels import epilogue as E

    m, h = s.shape
    block, warps, rows = E.launch_config(h, s.element_size(), m)
    normed, new_res = torch.full_like(s, float("nan")), torch.full_like(s, float("nan"))
    E.residual_rmsnorm_kernel[(-(-m // rows),)](s, res if res is not None else s, w, normed, new_res, m, h, eps,
                                                BLOCK_H=block, ROWS=rows, HAS_RES=res is not None, SOFT_BF16=False,
                                                num_warps=warps)
    return normed, new_res


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prebound_launch_gives_the_ordinary_launch_s_bits(m, dtype):
    from tpfuse.kernels import epilogue as E

    h = 6144
    for with_res in (True, False):
        for i in range(3):  # bind, then two pre-bound calls on new tensors
            s, r, w = _inputs(m, h, dtype, "cuda")
            s = s * (1 + i)
            res = r if with_res else None
            out = (torch.full_like(s, float("nan")), torch.full_like(s, float("nan")))
            got = E.residual_rmsnorm(s, res, w, 1e-6, out=out)
            want = _ordinary(s, res, w, 1e-6)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (m, dtype, with_res, i)
            ref_normed, ref_res = residual_rmsnorm_ref(s.cpu(), None if res is None else res.cpu(), w.cpu(), 1e-6)
            assert torch.equal(got[1].cpu(), ref_res)
            assert relative_error(got[0].cpu(), ref_normed) <= TOLERANCE[dtype]
        key = (m, h, dtype, with_res, torch.cuda.current_device(), None)
        assert E._LAUNCHES[key].prebound


@pytest.mark.gpu
def test_prebound_launch_replays_in_a_cuda_graph_and_unaligned_views_stay_correct():
    from tpfuse.kernels import epilogue as E

    m, h = 16, 6144
    s, r, w = _inputs(m, h, torch.bfloat16, "cuda")
    E.residual_rmsnorm(s, r, w, 1e-6)  # bind outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = E.residual_rmsnorm(s, r, w, 1e-6)
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(3):
        s.copy_(small_integer_inputs(i, m, h, torch.bfloat16).cuda())
        r.copy_(small_integer_inputs(10 + i, m, h, torch.bfloat16).cuda())
        captured[0].fill_(float("nan"))
        graph.replay()
        want = residual_rmsnorm_ref(s.cpu(), r.cpu(), w.cpu(), 1e-6)
        assert torch.equal(captured[1].cpu(), want[1]) and torch.equal(captured[0], _ordinary(s, r, w, 1e-6)[0])
    su, ru, wu = _inputs(m, h, torch.bfloat16, "cuda", offset=3)  # 6-byte offset: the unaligned variant
    assert su.data_ptr() % 16
    got = E.residual_rmsnorm(su, ru, wu, 1e-6)
    want = residual_rmsnorm_ref(su.cpu(), ru.cpu(), wu.cpu(), 1e-6)
    assert torch.equal(got[1].cpu(), want[1]) and relative_error(got[0].cpu(), want[0]) <= TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_prebound_quantized_launches_repeat_the_reference_quantizer():
    from tests.kernels.test_quant import MODEL_SPECS, _cpu, _on, _same

    from tpfuse.kernels.epilogue import residual_rmsnorm

    m, h = 37, 6144
    s, r = small_integer_inputs(0, m, h, torch.bfloat16), small_integer_inputs(1, m, h, torch.bfloat16)
    w = small_integer_inputs(2, 1, h, torch.bfloat16)[0]
    for spec in MODEL_SPECS:
        ref = residual_rmsnorm_quant_ref(s, r, w, 1e-6, spec)
        for i in range(3):  # bind, then two pre-bound calls with fresh outputs
            got = _cpu(residual_rmsnorm(s.cuda(), r.cuda(), w.cuda(), 1e-6, quant=_on(spec)))
            assert all(_same(a, b.contiguous() if b is not None else None) for a, b in zip(got, ref)), (spec.key, i)


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
        w = ((1 + 0.1 * random_inputs(2, 1, h, torch.float32, seed=h)[0]).to(dtype) if kind != "int"
             else make(2, 1, h, dtype)[0])
        out = residual_rmsnorm(s, res, w, 1e-6, out=nan_pair(s))
        op_out = residual_rmsnorm_op(s, res, w, 1e-6)
        results.append((s, res, w, out, op_out))
    return results


@pytest.mark.interpreter
def test_epilogue_matches_reference_in_interpreter():
    cases = [(kind, dtype, m, h, with_res)
             for kind in ("int", "rand") for dtype in DTYPES for (m, h) in ((3, 64), (2, 40))
             for with_res in (True, False)]
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
EPILOGUE_CASES = [(h, torch.bfloat16) for h in HIDDENS] + [(h, d) for h in (100, 2880, 16384)
                                                            for d in (torch.float16, torch.float32)]


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
