"""benchmarks/bench_quant.py on CPU: its torch baselines do the reference's work, and without a
GPU it exits 2 with the reason (the timing itself needs a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tpfuse.reference import quantize_ref

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
bench_quant = pytest.importorskip("bench_quant")


@pytest.mark.parametrize("kind", bench_quant.FORMATS)
def test_torch_baseline_quantizers_match_the_reference(kind):
    spec = bench_quant.spec_for(kind, "cpu")
    y = torch.randn(130, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    codes, scales = bench_quant.torch_quant(kind, spec)(y)
    ref_codes, ref_scales = quantize_ref(y.float(), spec)
    as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    assert torch.equal(as_bytes(scales), as_bytes(ref_scales))
    differ = (as_bytes(codes) != as_bytes(ref_codes)).float().mean().item()
    # fp8: the same fp32 steps; nvfp4: bucketize sends e2m1 ties up instead of to even (rare)
    assert differ == 0.0 if kind != "nvfp4" else differ < 0.01, differ
    assert bench_quant.out_bytes(kind, 130, 512) == (as_bytes(codes).numel()
                                                     + (0 if kind == "fp8_static" else as_bytes(ref_scales).numel()))


def test_without_gpu_exits_2():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would benchmark")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_quant.py"), "--tokens", "1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


def test_summary_marks_unmeasured_figures_instead_of_printing_nan(capsys):
    summary = [("nvfp4", 1, 6144, {"fused": 2.30, "epilogue_only": 2.05}, 12_000, {}, {})]
    bench_quant._print_summary(summary, 3000.0, {"flashinfer": "not carried"})
    out = capsys.readouterr().out
    assert "nan" not in out.lower()
    line = next(x for x in out.splitlines() if x.strip().startswith("nvfp4"))
    assert "2.30" in line and "+0.25" in line and line.rstrip().endswith("-")
