"""benchmarks/device/quant_profile.py on CPU: `launch` runs this tree's launcher and each
`--configs` launch configuration in the Triton interpreter (the dry run of what ncu profiles on
the device), and bench_quant's `--configs` values become configurations the launcher accepts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
bench_quant = pytest.importorskip("bench_quant")


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
