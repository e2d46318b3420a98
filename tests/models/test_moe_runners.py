"""MoE runners against the float64 reference (on CPU, and in bf16 on one CUDA GPU); admission
reasons; measured choice; runner_report."""

from __future__ import annotations

import pytest
import torch

from tpfuse.models import moe_runners
from tpfuse.models.moe_runners import RUNNERS, RunnerProblem, admission, choose, moe_experts_ref, runner_report
from tpfuse.probe import probe

# Norm-wise relative error against float64, by dtype: the expert GEMMs round their outputs to the
# dtype twice (gate/up, down) plus the SwiGLU product; fp32 u = 6e-8, bf16 u = 2^-9 = 2e-3.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _problem(num_local=4, *, tokens=9, top_k=3, num_experts=8, first=4, hidden=32, inter=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_local, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_local, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    ids = torch.rand(tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices
    ids[0] = torch.tensor([first, first + 1, 0])  # a token with two local experts and one remote
    ids[:, 0][ids[:, 0] == first + 3] = 1  # (keeps routing varied; some local experts may get no tokens)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return x, ids, weights, w13, w2, first


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(RUNNERS))
def test_runner_matches_reference(name, dtype):
    args = _problem(dtype=dtype)
    verdict = admission(RunnerProblem("cpu", str(dtype).removeprefix("torch."), 32, 16, 4, False))[name]
    if not verdict.ok:
        # The only expected refusal on CPU: torch has no float64 grouped GEMM; the probe call says so.
        assert name == "grouped_mm" and dtype == torch.float64 and "probe call failed" in verdict.reason, verdict.reason
        return
    out = RUNNERS[name](*args)
    ref = moe_experts_ref(*args)
    assert torch.isfinite(out).all()
    assert float((out.double() - ref).norm() / ref.norm()) < TOL[dtype]


def test_runner_ignores_remote_experts():
    x, ids, weights, w13, w2, first = _problem()
    ids[:] = 0  # every pair routed to expert 0, which another rank owns
    for runner in RUNNERS.values():
        assert torch.equal(runner(x, ids, weights, w13, w2, first), torch.zeros(x.shape))


def test_admission_reasons_on_cpu():
    verdicts = admission(RunnerProblem("cpu", "float64", 32, 16, 4, capture=True))
    assert not verdicts["loop"].ok and "CUDA graph" in verdicts["loop"].reason
    assert verdicts["dense"].ok
    assert not verdicts["grouped_mm"].ok and "probe call failed" in verdicts["grouped_mm"].reason
    assert admission(RunnerProblem("cpu", "float32", 32, 16, 4, capture=False))["grouped_mm"].ok


def test_missing_torch_op_is_refused(monkeypatch):
    monkeypatch.delattr(torch, "_grouped_mm")
    moe_runners._probe_cache.clear()
    verdict = admission(RunnerProblem("cpu", "float32", 32, 16, 4, False))["grouped_mm"]
    assert not verdict.ok and "no torch._grouped_mm" in verdict.reason


def test_choose_picks_fastest_admitted_and_explains():
    from tpfuse.spec import Verdict

    verdicts = {"loop": Verdict.no("x"), "dense": Verdict.yes(), "grouped_mm": Verdict.yes()}
    choice = choose(verdicts, {"loop": 1.0, "dense": 30.0, "grouped_mm": 20.0})
    assert choice.name == "grouped_mm" and choice.source == "measured"
    assert "20 us" in choice.reason and "dense 30 us" in choice.reason
    with pytest.raises(ValueError, match="loop: x"):
        choose({"loop": Verdict.no("x")}, {"loop": 1.0})


def test_runner_report_rows():
    caps = probe()
    rows = runner_report(caps, dtype="float32", hidden=32, expert_inter=16)
    assert [r["name"] for r in rows] == list(RUNNERS)
    assert sum(r["chosen"] for r in rows) == 1
    chosen = next(r for r in rows if r["chosen"])
    assert chosen["admitted"] and "not measured" in chosen["why"]
    measured = runner_report(caps, dtype="float32", hidden=32, expert_inter=16, timings_us={"loop": 5.0, "dense": 9.0})
    assert next(r for r in measured if r["chosen"])["name"] == "loop"


@pytest.mark.gpu
def test_runners_on_cuda_match_reference():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 256, generator=gen)
    w13 = torch.randn(4, 2 * 128, 256, generator=gen) * 256**-0.5
    w2 = torch.randn(4, 256, 128, generator=gen) * 128**-0.5
    ids = torch.rand(40, 16, generator=gen).topk(4, dim=-1).indices
    weights = torch.rand(40, 4, generator=gen) + 0.1
    verdicts = admission(RunnerProblem("cuda", "bfloat16", 256, 128, 4, capture=True), device="cuda")
    assert not verdicts["loop"].ok and verdicts["dense"].ok
    args = [t.cuda() for t in (x.bfloat16(), ids, weights, w13.bfloat16(), w2.bfloat16())]
    ref = moe_experts_ref(*[t.cpu() for t in args], 4)
    for name, verdict in verdicts.items():
        if verdict.ok:
            out = RUNNERS[name](*args, 4)
            # two bf16 GEMM roundings and the SwiGLU product (u = 2^-9): same bound as the CPU test
            assert float((out.double().cpu() - ref).norm() / ref.norm()) < 2e-2, name
