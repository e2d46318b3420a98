"""`tpfuse diagnose` on CPU: analysis of a saved recording (--from), the PNG, usage errors, and the
no-NVML path (real: this machine has nvidia-ml-py but no driver; simulated: pynvml missing); and its
live path end to end against a real GPU and driver (skipped without a CUDA GPU)."""

from __future__ import annotations

import sys

import pytest

from diagnose.cli_helpers import run_cli, run_cli_json
from diagnose.synth import BUSY, IDLE, WAITING, make_recording
from tpfuse.diagnose import analysis
from tpfuse.diagnose.samples import save_recording

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def story_file(tmp_path):
    """Three GPUs: two waiting (the story's signature), one idle."""
    rec = make_recording({0: [(WAITING, 60)], 1: [(WAITING, 60)], 2: [(IDLE, 60)]}, seed=31)
    return rec, save_recording(rec, tmp_path / "story.json")


def test_from_json_report_matches_the_analysis(monkeypatch, capsys, story_file):
    rec, path = story_file
    code, doc, _ = run_cli_json(monkeypatch, capsys, "--from", str(path))
    assert code == 0
    assert set(doc) == {"source", "mode", "command", "pid", "exit_code", "interrupted", "interval_s", "duration_s",
                        "num_samples", "driver", "tick_ms_median", "notes", "gpus", "findings", "thresholds", "png",
                        "saved"}
    assert doc["source"] == str(path) and doc["num_samples"] == 180 and doc["driver"] == "580.159.04"
    expected = analysis.summarise(rec)
    assert [g["gpu"] for g in doc["gpus"]] == [0, 1, 2]
    for got, want in zip(doc["gpus"], expected):
        assert got["power_mean_w"] == pytest.approx(want.power_mean_w)
        assert got["waiting_share"] == want.waiting_share
        assert got["util_p95_pct"] == pytest.approx(want.util_p95_pct)
    assert [(f["kind"], f["gpus"]) for f in doc["findings"]] == [("waiting", [0]), ("waiting", [1]), ("idle", [2])]
    assert doc["thresholds"] == analysis.thresholds()


def test_from_table_names_gpus_numbers_and_findings(monkeypatch, capsys, story_file):
    rec, path = story_file
    code, out, _ = run_cli(monkeypatch, capsys, "--from", str(path))
    assert code == 0
    s0 = analysis.summarise(rec)[0]
    assert "NVIDIA H200" in out
    assert f"{s0.power_mean_w:.0f} / {s0.power_p95_w:.0f}" in out
    assert "WARN  waiting: GPU 0" in out and "WARN  waiting: GPU 1" in out
    assert "WARN  idle: GPU 2" in out
    assert "60 samples per GPU every 100 ms" in out


def test_png_written_and_recording_resaved(monkeypatch, capsys, story_file, tmp_path):
    rec, path = story_file
    png, again = tmp_path / "plot.png", tmp_path / "again.json"
    code, doc, _ = run_cli_json(monkeypatch, capsys, "--from", str(path), "--png", str(png), "--save", str(again))
    assert code == 0 and doc["png"] == str(png) and doc["saved"] == str(again)
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    from tpfuse.diagnose.samples import load_recording

    assert load_recording(again) == rec


def test_png_without_matplotlib_exits_2_before_anything_runs(monkeypatch, capsys, story_file, tmp_path):
    _, path = story_file
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, out, err = run_cli(monkeypatch, capsys, "--from", str(path), "--png", str(tmp_path / "p.png"))
    assert code == 2
    assert "tpfuse diagnose: --png needs matplotlib" in err
    assert "`pip install 'tpfuse[plot]'` (from a checkout: `pip install '.[plot]'`)" in err
    assert not (tmp_path / "p.png").exists() and out == ""


def test_failed_command_in_a_recording_exits_1(monkeypatch, capsys, tmp_path):
    import dataclasses

    rec = dataclasses.replace(make_recording({0: [(BUSY, 20)]}, seed=32), mode="command", command=("a",), exit_code=7)
    code, doc, err = run_cli_json(monkeypatch, capsys, "--from", str(save_recording(rec, tmp_path / "r.json")))
    assert code == 1 and doc["exit_code"] == 7 and "status 7" in err


@pytest.mark.parametrize("argv, match", [
    ((), "nothing to watch"),
    (("--from", "x.json", "--duration", "3"), "--from analyses a recording"),
    (("--pid", "1", "--", "true"), "not both"),
    (("--duration", "0"), "must be > 0"),
    (("--duration", "1", "--interval", "0.001"), "outside"),
    (("--pid", "999999999"), "no such process"),
])
def test_usage_errors_exit_2(monkeypatch, capsys, argv, match):
    code, _, err = run_cli(monkeypatch, capsys, *argv)
    assert code == 2
    assert err.startswith("tpfuse diagnose: ") and match in err


def test_unreadable_recording_exits_2(monkeypatch, capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    code, _, err = run_cli(monkeypatch, capsys, "--from", str(bad))
    assert code == 2 and "not a tpfuse diagnose recording" in err


def _nvml_initialises() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # ImportError or any NVMLError: NVML is not usable here
        return False


@pytest.mark.skipif(_nvml_initialises(), reason="NVML initialises here (a driver is present): no failure to test")
def test_no_driver_real_path_exits_2(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "--duration", "1")
    assert code == 2 and out == ""
    assert "tpfuse diagnose: NVML is not available (" in err
    assert "run on a machine with an NVIDIA driver" in err and "--from FILE" in err
    code, doc, _ = run_cli_json(monkeypatch, capsys, "--duration", "1")
    assert code == 2 and doc["exit_code"] == 2 and doc["error"].startswith("diagnose: NVML is not available")


def test_no_pynvml_exits_2_and_does_not_start_the_command(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    marker = tmp_path / "ran"
    code, out, err = run_cli(monkeypatch, capsys, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert code == 2 and out == ""
    assert "NVML is not available (pynvml import failed:" in err and "install nvidia-ml-py" in err
    assert not marker.exists()


def test_live_status_line_shows_each_gpu():
    from tpfuse.diagnose.report import status_text
    from tpfuse.diagnose.samples import Sample

    def sample(gpu, power, util):
        return Sample(t_s=1.0, gpu=gpu, power_w=power, power_limit_w=700.0, util_pct=util, mem_util_pct=3.0,
                      sm_clock_mhz=1980.0, mem_clock_mhz=3201.0, mem_used_bytes=1)

    line = status_text(12.34, 246, {1: sample(1, 612.4, 99.0), 0: sample(0, 247.6, 97.0)})
    assert line == "diagnose:   12.3 s, 246 samples | GPU0 248 W (35%) util 97% | GPU1 612 W (87%) util 99%"
    assert status_text(0.0, 0, {}) == "diagnose:    0.0 s, 0 samples"


@pytest.mark.gpu
def test_cli_duration_samples_every_gpu(monkeypatch, capfd):
    import pynvml

    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    code, doc, _ = run_cli_json(monkeypatch, capfd, "--duration", "1.0")
    assert code == 0 and doc["source"] == "nvml" and doc["driver"]
    assert [g["gpu"] for g in doc["gpus"]] == list(range(count))
    for g in doc["gpus"]:
        assert g["num_samples"] >= 5 and g["power_limit_w"] > 0 and g["power_mean_w"] > 0
