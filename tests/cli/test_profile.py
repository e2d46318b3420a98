"""`tpfuse profile` end to end on CPU (gloo; JSON, rows, the PNG and the traces it prints) and on one
CUDA GPU (kernels attributed to stages); nothing written unasked and clean lines (tpfuse warnings
as one plain line, no Kineto status lines), GB/s that never reads 0, and the install commands when
matplotlib is missing."""

from __future__ import annotations

import json
import re

import pytest

from tpfuse.cli.main import main
from tpfuse.cli.profile import format_gbps
from tpfuse.results import read_rows

TINY = ["--preset", "tiny", "--prompt-len", "4", "--context", "16"]


@pytest.mark.slow
@pytest.mark.gloo
def test_profile_cpu_json_plot_rows(tmp_path, capsys):
    png = tmp_path / "stages.png"
    code = main(["profile", "--preset", "tiny", "--batch", "2", "--steps", "2", "--prompt-len", "4", "--context", "16",
                 "--json", "--plot", str(png), "--results", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["allreduce_count_ok"] is True
    assert [m["fusion"] for m in out["modes"]] == [True, False]
    for mode in out["modes"]:
        assert set(mode["stages"]) == {"attention", "moe_gemm", "other_gemm", "communication", "norm", "other"}
        assert sum(s["share"] for s in mode["stages"].values()) == pytest.approx(1.0)
        assert mode["stages"]["moe_gemm"]["launches_per_step"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = read_rows(tmp_path / "profile.jsonl")
    assert len(rows) == 12 and {r["shape"]["stage"] for r in rows} == set(out["modes"][0]["stages"])


@pytest.mark.gpu
def test_profile_cuda_attributes_kernels(tmp_path, capsys):
    code = main(["profile", "--preset", "tiny", "--batch", "8", "--steps", "2", "--prompt-len", "4", "--context", "16",
                 "--fusion", "off", "--json", "--results", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    stages = out["modes"][0]["stages"]
    for stage in ("attention", "moe_gemm", "other_gemm", "norm"):
        assert stages[stage]["time_us_per_step"] > 0 and stages[stage]["launches_per_step"] > 0, stage


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("fusion, names", [("both", ["t.fusion-on.json", "t.fusion-off.json"]),
                                           ("off", ["t.json"])])
def test_profile_writes_the_traces_it_prints(tmp_path, capsys, fusion, names):
    trace = tmp_path / "t.json"
    assert main(["profile", "--preset", "tiny", "--batch", "1", "--steps", "1", "--prompt-len", "4", "--context", "8",
                 "--fusion", fusion, "--trace", str(trace), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"] == [str(tmp_path / n) for n in names]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    for name in names:
        assert json.loads((tmp_path / name).read_text())["traceEvents"]


@pytest.mark.slow
@pytest.mark.gloo
def test_profile_writes_nothing_unasked_and_prints_clean_lines(empty_cwd, capfd):
    assert main(["profile", *TINY, "--batch", "2", "--steps", "2", "--fusion", "on"]) == 0
    out, err = capfd.readouterr()
    assert list(empty_cwd.iterdir()) == []
    assert "result rows not kept (pass --results PATH to keep them)" in out
    assert "USDT:" not in err and "STAGE:" not in err and "profiler_start" not in err
    warning = [line for line in err.splitlines() if "no dispatch table" in line]
    assert len(warning) == 1 and warning[0].startswith("tpfuse: warning: Communicator: no dispatch table at ")
    assert "api.py" not in err and "self._choose" not in err
    gbps = re.search(r"^│ attention .*│\s+(\S+) │$", out, re.M).group(1)
    assert float(gbps) > 0
    assert re.search(r"^profile: fusion on [\d.]+ us/step; allreduce count ok$", out, re.M)


def test_profile_plot_without_matplotlib_names_both_install_commands_quoted(capsys, monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it imports
    assert main(["profile", "--preset", "tiny", "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib; install matplotlib with `pip install 'tpfuse[plot]'` (from a checkout: " \
           "`pip install '.[plot]'`) or drop --plot" in err


@pytest.mark.parametrize("gbps, text", [(0.0637, "0.0637"), (1.5, "1.5"), (12.345, "12.3"), (3400.4, "3400"),
                                        (0.00042, "4.2e-04")])
def test_gbps_keeps_three_significant_digits(gbps, text):
    assert format_gbps(gbps) == text
