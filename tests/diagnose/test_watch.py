"""The live path on CPU, with a stand-in NVML (fake_nvml) whose readings are known: command, pid and
duration modes through the CLI, the child's exit code, the watched process tree's GPU memory,
unreadable fields, and the sampler's schedule."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from support import fake_nvml
from support.fake_nvml import FakeNvml
from tpfuse.diagnose.sampler import Sampler, open_nvml, process_tree

from .cli_helpers import run_cli, run_cli_json


@pytest.fixture
def nv(monkeypatch):
    fake = FakeNvml(2)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def check_readings(doc):
    for g in doc["gpus"]:
        i = g["gpu"]
        assert g["power_mean_w"] == fake_nvml.power_w(i) and g["power_limit_w"] == fake_nvml.limit_w(i)
        assert g["power_fraction_mean"] == pytest.approx(fake_nvml.power_w(i) / fake_nvml.limit_w(i))
        assert g["util_mean_pct"] == fake_nvml.util_pct(i)
        assert (g["sm_clock_mean_mhz"], g["sm_clock_max_mhz"]) == (1500, 1980)
        assert g["mem_used_max_bytes"] == (3 + i) * fake_nvml.GIB and g["name"] == "Fake GPU"


def test_command_mode_reports_the_child_exit_code_and_its_gpu_memory(nv, monkeypatch, capfd):
    child = "import sys, time; print('child says hi'); sys.stdout.flush(); time.sleep(0.6); sys.exit(3)"
    code, out, err = run_cli(monkeypatch, capfd, "--json", "--interval", "0.02", "--", sys.executable, "-c", child)
    import json

    doc = json.loads(out)  # the child's stdout went to stderr, so stdout is one JSON document
    assert "child says hi" in err
    assert code == 1 and doc["exit_code"] == 3 and "status 3" in err
    assert doc["mode"] == "command" and doc["command"] == [sys.executable, "-c", child]
    assert doc["source"] == "nvml" and doc["driver"] == fake_nvml.DRIVER and doc["interrupted"] is False
    check_readings(doc)
    assert doc["gpus"][0]["target_mem_max_bytes"] == fake_nvml.PROC_MEM_BYTES
    assert doc["gpus"][1]["target_mem_max_bytes"] == 0
    per_gpu = [g["num_samples"] for g in doc["gpus"]]
    assert per_gpu[0] == per_gpu[1] and 10 <= per_gpu[0] <= 0.6 / 0.02 + 40  # slow start-up on 2 cores
    assert (nv.init_calls, nv.shutdown_calls) == (1, 1)


def test_duration_mode_samples_on_schedule(nv, monkeypatch, capfd):
    code, doc, _ = run_cli_json(monkeypatch, capfd, "--duration", "0.5", "--interval", "0.02")
    assert code == 0 and doc["mode"] == "duration" and doc["exit_code"] is None
    n = doc["gpus"][0]["num_samples"]
    # 0.5 s / 20 ms = 25 ticks (+1 at t=0); ticks skipped on a loaded machine are noted, not burst.
    skipped = sum(int(x.split()[0]) for x in doc["notes"] if "ticks skipped" in x)
    assert 24 <= n + skipped <= 27
    assert 0.5 <= doc["duration_s"] < 1.5
    check_readings(doc)
    assert doc["gpus"][0]["target_mem_max_bytes"] is None  # no process watched


def test_pid_mode_ends_when_the_process_exits(nv, monkeypatch, capfd):
    proc = subprocess.Popen(["sleep", "0.5"])
    start = time.monotonic()
    code, doc, _ = run_cli_json(monkeypatch, capfd, "--pid", str(proc.pid), "--interval", "0.05")
    assert time.monotonic() - start < 5  # the exited (zombie) child counts as gone
    proc.wait()
    assert code == 0 and doc["mode"] == "pid" and doc["pid"] == proc.pid and doc["interrupted"] is False
    assert doc["gpus"][0]["target_mem_max_bytes"] == fake_nvml.PROC_MEM_BYTES


def test_pid_mode_with_duration_leaves_the_process_running(nv, monkeypatch, capfd):
    proc = subprocess.Popen(["sleep", "30"])
    try:
        code, doc, _ = run_cli_json(monkeypatch, capfd, "--pid", str(proc.pid), "--duration", "0.3")
        assert code == 0 and doc["interrupted"] is True
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_duration_stops_a_longer_command(nv, monkeypatch, capfd):
    start = time.monotonic()
    code, doc, _ = run_cli_json(monkeypatch, capfd, "--duration", "0.4", "--", "sleep", "30")
    assert time.monotonic() - start < 10
    assert code == 1 and doc["interrupted"] is True and doc["exit_code"] == -15  # SIGTERM


def test_table_and_live_status(nv, monkeypatch, capfd):
    code, out, _ = run_cli(monkeypatch, capfd, "--duration", "0.3", "--interval", "0.05")
    assert code == 0
    assert "Fake GPU" in out and "200 / 200" in out and "250 / 250" in out
    assert "uneven" not in out  # 29% of 700 W vs 42% of 600.5 W: a spread of 0.13, under 0.15


def test_unstartable_command_exits_2(nv, monkeypatch, capfd):
    code, _, err = run_cli(monkeypatch, capfd, "--", "/nonexistent/tpfuse-test-binary")
    assert code == 2 and "cannot start '/nonexistent/tpfuse-test-binary'" in err
    assert (nv.init_calls, nv.shutdown_calls) == (1, 1)


def test_unsupported_reading_is_none_and_noted(monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(1, power_supported=False))
    code, doc, _ = run_cli_json(monkeypatch, capfd, "--duration", "0.2", "--interval", "0.05")
    assert code == 0
    assert doc["gpus"][0]["power_mean_w"] is None and doc["gpus"][0]["util_mean_pct"] == 90
    assert "NVML could not read power: Not Supported" in doc["notes"]


def test_no_gpu_exits_2(monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(0))
    code, _, err = run_cli(monkeypatch, capfd, "--duration", "1")
    assert code == 2 and "NVML sees no NVIDIA GPU" in err


def test_sampler_rejects_bad_interval(nv):
    nvml = open_nvml()
    try:
        with pytest.raises(ValueError, match="interval 0.001 s is outside"):
            Sampler(nvml, interval_s=0.001)
    finally:
        nvml.close()


def test_process_tree_includes_grandchildren():
    proc = subprocess.Popen(["sh", "-c", "sleep 5 & sleep 5 & wait"])
    try:
        deadline = time.monotonic() + 5
        tree = process_tree(proc.pid)
        while len(tree) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
            tree = process_tree(proc.pid)
        assert proc.pid in tree and len(tree) == 3
        assert os.getpid() not in tree  # the parent is not part of the child's tree
    finally:
        proc.kill()
        proc.wait()
