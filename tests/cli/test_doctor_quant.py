"""`tpfuse doctor --quant FORMAT`: every strategy's admission for quantized output with the
conversion path in the reason, on a faked H200 probe; a bad --quant is a usage error (exit 2)."""

from __future__ import annotations

import json

import pytest
from tests.cli.test_doctor import fake_gpu_caps, no_moe_section, wide_console  # noqa: F401  (fixtures)

import tpfuse.probe
from tpfuse.cli.main import main


@pytest.mark.parametrize("kind", ["fp8_per_group", "nvfp4"])
def test_quant_admission_reasons(capsys, monkeypatch, no_moe_section, kind):  # noqa: F811
    monkeypatch.setattr(tpfuse.probe, "probe", lambda **kw: fake_gpu_caps())
    assert main(["doctor", "--quant", kind, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["problem"]["quant"] == kind
    admission = report["admission"]
    fused = admission["nccl_epilogue"]
    assert fused["admitted"] and "hardware cvt" in fused["reason"] and "compute capability 9.0" in fused["reason"]
    if kind == "nvfp4":
        assert "e2m1 by the software conversion" in fused["reason"]
    for name in ("oneshot", "twoshot"):  # the peer allreduce, then the quantizing epilogue
        peer = admission[name]
        assert peer["admitted"] and "quantized output in the peer kernel" in peer["reason"] and "hardware cvt" in peer["reason"]
    assert admission["nccl_eager"]["admitted"]
    assert main(["doctor", "--quant", kind]) == 0  # the table names the format
    assert f"{kind} output" in capsys.readouterr().out


def test_bad_quant_is_a_usage_error(capsys):
    assert main(["doctor", "--quant", "int4", "--json"]) == 2
    assert "--quant 'int4'" in capsys.readouterr().err
