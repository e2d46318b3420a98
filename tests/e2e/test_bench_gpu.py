"""`tpfuse bench e2e` and `tpfuse profile` on one CUDA GPU: CUDA graphs, NVML energy, kernel attribution."""

from __future__ import annotations

import json

import pytest

from tpfuse.cli.main import main

pytestmark = pytest.mark.gpu


def test_bench_e2e_cuda_graphs_and_energy(tmp_path, capsys):
    code = main(["bench", "e2e", "--preset", "tiny", "--batch", "1,16", "--steps", "5", "--min-seconds", "0.5",
                 "--prompt-len", "4", "--context", "16", "--json", "--results", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["device"] == "cuda" and out["notes"] == []
    for p in out["points"]:
        assert p["cuda_graphs"] is True
        assert sum(p["allreduces_per_step"].values()) == p["expected_allreduces_per_step"] == 4
        assert p["moe_runner"] != "loop"  # not capturable, so never admitted with graphs
        if p["energy_j"] is None:
            assert "NVML" in p["energy_note"]
        else:
            assert p["energy_j"] > 0 and p["j_per_token"] == pytest.approx(p["energy_j"] / (p["batch"] * p["steps"]))


def test_profile_cuda_attributes_kernels(tmp_path, capsys):
    code = main(["profile", "--preset", "tiny", "--batch", "8", "--steps", "2", "--prompt-len", "4", "--context", "16",
                 "--fusion", "off", "--json", "--results", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    stages = out["modes"][0]["stages"]
    for stage in ("attention", "moe_gemm", "other_gemm", "norm"):
        assert stages[stage]["time_us_per_step"] > 0 and stages[stage]["launches_per_step"] > 0, stage
