"""benchmarks/bench_quant.py on CPU: its torch baselines do the reference's work, without a GPU it
exits 2 with the reason (the timing itself needs a GPU), and its `--configs` values become
launch configurations the launcher accepts; with them benchmarks/device/quant_profile.py's
`launch` (the dry run, in the Triton interpreter, of what ncu profiles on the device) runs this
tree's launcher and each configuration, and refuses a malformed one."""

from __future__ import annotations

import json
import os
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


@pytest.mark.parametrize("text, hidden, kind, expected", [
    ("8:1:2048", 6144, "fp8_per_group", (8192, 8, 1, 2048, 0)),
    ("16:1", 7168, "nvfp4", (8192, 16, 1, 8192, 0)),
    ("4:1:p", 6144, "nvfp4", (4096, 4, 1, 4096, 0)),
    ("4:2:r40", 5120, "fp8_static", (8192, 4, 2, 8192, 40)),
])
def test_configs_become_launch_configurations_the_launcher_accepts(text, hidden, kind, expected):
    from tpfuse.kernels.epilogue import check_quant_config

    config = bench_quant.launch_tuple(bench_quant.parse_config(text), hidden, kind)
    assert config == expected  # ":p": rows of 6144 in two parts, BLOCK_H 4096 and 2048 columns
    assert check_quant_config(config, hidden, bench_quant.spec_for(kind, "cpu")) == expected


def test_launch_dry_run_labels_every_variant_it_launched(tmp_path):
    labels = tmp_path / "labels.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device" / "quant_profile.py"), "launch",
                           "--labels", str(labels), "--tokens", "2", "--hidden", "256", "--device", "cpu",
                           "--formats", "fp8_static", "fp8_per_group", "--configs", "4:1:128"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads(labels.read_text())
    assert (meta["tokens"], meta["hidden"]) == (2, 256)
    assert [(x["variant"], x["format"]) for x in meta["launches"]] == [
        ("epilogue", None), ("after", "fp8_static"), ("after[w=4,r=1,s=128]", "fp8_static"),
        ("after", "fp8_per_group"), ("after[w=4,r=1,s=128]", "fp8_per_group")]


def test_a_malformed_config_is_refused_with_the_form_it_takes(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device" / "quant_profile.py"), "launch",
                           "--labels", str(tmp_path / "labels.json"), "--configs", "3:1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--configs takes WARPS:ROWS" in proc.stderr and "['3:1']" in proc.stderr
    assert not (tmp_path / "labels.json").exists()
