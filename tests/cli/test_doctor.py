"""`tpfuse doctor`: the content of its tables and JSON, admission reasons, usage errors (exit 2),
the GPU path on a faked two-GPU probe, and --measure with and without a fabric module."""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import pytest

import tpfuse.probe
import tpfuse.strategies as strategies
from tpfuse.cli.doctor import problem_of
from tpfuse.cli.exits import UsageError
from tpfuse.cli.main import main
from tpfuse.probe.capabilities import (
    Capabilities,
    CpuInfo,
    FabricMeasurements,
    GpuInfo,
    LinkInfo,
    PackageStatus,
    PeerMeasurement,
    Versions,
)
from tpfuse.spec import Needs, Op, Verdict
from tpfuse.strategies.base import Strategy


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    # rich wraps table cells at the terminal width (80 when captured); wide keeps each reason on one line.
    monkeypatch.setenv("COLUMNS", "400")


@pytest.fixture
def needs_cuda_strategy(monkeypatch):
    """A registered strategy that needs CUDA and NCCL, importable by its registry path."""

    class NeedsCudaStrategy(Strategy):
        name = "needs_cuda"
        description = "test strategy that needs CUDA tensors on an NCCL group"
        needs = Needs(cuda=True, nccl=True, peer_access=True)

        def all_reduce(self, x):
            raise NotImplementedError

        def all_reduce_residual_rmsnorm(self, x, residual, weight, eps):
            raise NotImplementedError

    class BracketedReasonStrategy(NeedsCudaStrategy):
        name = "bracketed"
        needs = Needs()

        @classmethod
        def extra_admits(cls, problem, caps):
            return Verdict.no("needs the package 'flashinfer[cu13]'; pip install 'flashinfer-python[cu13]'")

    module = types.ModuleType("tpfuse_doctor_test_strategies")
    module.NeedsCudaStrategy = NeedsCudaStrategy
    module.BracketedReasonStrategy = BracketedReasonStrategy
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(strategies._REGISTRY, "needs_cuda", f"{module.__name__}:NeedsCudaStrategy")
    monkeypatch.setitem(strategies._REGISTRY, "bracketed", f"{module.__name__}:BracketedReasonStrategy")


def row_of(out: str, first_cell: str) -> str:
    """The one table row whose first cell is `first_cell`, with rich's box bars as "|"."""
    rows = [line.replace("│", "|") for line in out.splitlines()]
    rows = [line for line in rows if line.startswith("|") and line.split("|")[1].strip() == first_cell]
    assert len(rows) == 1, (first_cell, rows)
    return rows[0]


def test_tables_show_cpu_versions_and_every_strategy_with_its_reason(capsys, needs_cuda_strategy):
    import torch

    if torch.cuda.is_available():
        pytest.skip("describes the CPU-only machine: torch sees a CUDA GPU here")
    code = main(["doctor"])
    out = capsys.readouterr().out
    assert code == 0
    caps = tpfuse.probe.probe()
    assert f"CPU    │ {caps.cpu.model} ({caps.cpu.arch})" in out
    assert f"{caps.cpu.num_cores} logical" in out
    assert "no GPU: torch" in out
    for name, version in (("torch", torch.__version__), ("python", caps.versions.python), ("Triton", caps.versions.triton)):
        assert f"{name}" in out and version in out
    assert "world size 2 (gloo, cpu, peer access no)" in out
    assert "admitted" in row_of(out, "reference") and "not admitted" not in row_of(out, "reference")
    assert "all needs met" in row_of(out, "reference")
    needs = row_of(out, "needs_cuda")
    assert "not admitted" in needs and "needs CUDA tensors; this group runs on cpu" in needs
    # reasons are printed as text, not rich markup: the bracketed range survives
    assert "needs the package 'flashinfer[cu13]'; pip install 'flashinfer-python[cu13]'" in row_of(out, "bracketed")
    for name in strategies.strategy_names():
        row_of(out, name)  # every registered strategy has exactly one row
    flashinfer = row_of(out, "flashinfer")
    assert ("not installed (pip install flashinfer-python)" in flashinfer) == (caps.package("flashinfer").available is False)


def test_json_has_the_same_content_and_nothing_else_on_stdout(capsys, needs_cuda_strategy):
    code = main(["doctor", "--json", "--world-size", "3", "--hidden", "4096", "--dtype", "float16"])
    report = json.loads(capsys.readouterr().out)  # fails if anything but the object is on stdout
    assert code == 0
    assert set(report) == {"probe", "problem", "admission", "moe_runners", "engines", "fabric", "runtime_packages"}
    assert report["runtime_packages"]["numpy"]["installed"] is True
    assert report["probe"]["cpu"]["num_cores"] == os.cpu_count()
    assert report["problem"]["hidden"] == 4096 and report["problem"]["dtype"] == "float16"
    assert report["problem"]["facts"]["world_size"] == 3
    assert list(report["admission"]) == strategies.strategy_names()
    assert report["admission"]["reference"] == {"admitted": True, "reason": "all needs met"}
    if not report["probe"]["gpus"]:
        assert report["admission"]["needs_cuda"] == {"admitted": False, "reason": "needs CUDA tensors; this group runs on cpu"}
    moe = report["moe_runners"]
    assert set(moe) == {"available", "reason", "runners"} and (moe["available"] or moe["reason"].startswith("not available"))
    assert report["fabric"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "int8"], "--dtype 'int8' is not supported; use one of: float16, bfloat16, float32, float64"),
        (["--world-size", "0"], "--world-size 0 must be at least 1"),
        (["--hidden", "-1"], "--hidden -1 must be at least 1"),
        (["--op", "all_gather"], "--op 'all_gather' is not an op; use one of: all_reduce, all_reduce_residual_rmsnorm"),
    ],
)
def test_usage_errors_exit_2_and_name_the_fix(capsys, argv, message):
    code = main(["doctor", *argv])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.strip().startswith("tpfuse doctor: ") and message in captured.err
    assert captured.out == ""


def test_unparsable_flag_exits_2(capsys):
    assert main(["doctor", "--tokens", "eight"]) == 2
    assert "invalid int value: 'eight'" in capsys.readouterr().err


# ---- the GPU path, on a faked probe -----------------------------------------------------------


@pytest.fixture
def no_moe_section(monkeypatch):
    """On a faked GPU probe the real MoE runner report would try real CUDA; its section is stubbed."""
    import tpfuse.cli.doctor as doctor

    monkeypatch.setattr(doctor, "moe_runner_section", lambda caps: {"available": False, "reason": "stubbed", "runners": []})


def fake_gpu_caps(*, atomics: bool = True) -> Capabilities:
    gpus = tuple(
        GpuInfo(i, "NVIDIA H200", f"uuid-{i}", (9, 0), 132, 232448, 60 * 2**20, 141 * 2**30, 700.0, 5, 16,
                f"0000:{0x19 + i:02x}:00.0", 5, 16)
        for i in range(2)
    )
    links = (
        LinkInfo(0, 0, True, "same_device", native_atomics=True),
        LinkInfo(0, 1, True, "nvlink", 18, "node", atomics, "switch"),
        LinkInfo(1, 0, True, "nvlink", 18, "node", atomics, "switch"),
        LinkInfo(1, 1, True, "same_device", native_atomics=True),
    )
    return Capabilities(gpus, links, Versions("3.11.7", "0.1.0", "2.11.0+cu130", "13.0", "580.95.05", "2.27.5", "3.6.0", "13.0"),
                        (PackageStatus("triton", True, "3.6.0"),), CpuInfo("Intel Xeon", 64, 2**40, "x86_64", 64), "ok")


def args(**overrides):
    base = dict(world_size=None, hidden=6144, num_tokens=8, dtype="bfloat16", op="all_reduce_residual_rmsnorm", shared_gpu=False,
                device="auto")
    return argparse.Namespace(**{**base, **overrides})


def test_gpu_group_is_nccl_over_all_gpus_with_their_peer_facts():
    group = problem_of(args(), fake_gpu_caps(), Op.ALL_REDUCE_RESIDUAL_RMSNORM).facts
    assert (group.world_size, group.backend, group.device_type) == (2, "nccl", "cuda")
    assert group.devices == ("uuid-0", "uuid-1") and group.peer_access and group.native_atomics
    assert not problem_of(args(), fake_gpu_caps(atomics=False), Op.ALL_REDUCE).facts.native_atomics


def test_world_size_above_gpu_count_needs_shared_gpu():
    with pytest.raises(UsageError, match=r"3 ranks but 2 GPU\(s\); NCCL needs one GPU per rank. Pass --shared-gpu"):
        problem_of(args(world_size=3), fake_gpu_caps(), Op.ALL_REDUCE)
    group = problem_of(args(world_size=4, shared_gpu=True), fake_gpu_caps(), Op.ALL_REDUCE).facts
    assert (group.world_size, group.backend, group.device_type, group.peer_access, group.shares_device) == (
        4, "gloo", "cuda", True, True)
    assert group.devices == ("uuid-0",) * 4


def test_gpu_tables_and_admission_on_a_faked_gpu_probe(capsys, monkeypatch, needs_cuda_strategy, no_moe_section):
    monkeypatch.setattr(tpfuse.probe, "probe", lambda **kw: fake_gpu_caps())
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    gpu_row = row_of(out, "0")
    for cell in ("9.0", "132", "227 KiB", "60 MiB", "141 GiB", "700 W", "gen5 x16 (gen5 x16)", "0000:19:00.0"):
        assert f" {cell} " in gpu_row, (cell, gpu_row)
    pair = [line.replace("│", "|") for line in out.splitlines() if " 0 -> 1 " in line][0]
    assert "NVLink x18 (switch)" in pair and "node" in pair and pair.count(" yes ") == 2
    assert "world size 2 (nccl, cuda, peer access yes)" in out
    assert "all needs met" in row_of(out, "needs_cuda") and "not admitted" not in row_of(out, "needs_cuda")
    assert "580.95.05" in out and "2.27.5" in out


# ---- --measure ----------------------------------------------------------------------------------


def install_fabric(monkeypatch, measure):
    module = types.ModuleType("tpfuse.probe.fabric")
    module.measure_fabric = measure
    monkeypatch.setitem(sys.modules, "tpfuse.probe.fabric", module)


def test_measure_failure_is_reported_and_exit_is_still_0(capsys, monkeypatch):
    def measure(caps, *, progress):
        raise RuntimeError("measure_fabric: needs at least 2 GPUs, found 0; run on a machine with two or more GPUs")

    install_fabric(monkeypatch, measure)
    assert main(["doctor", "--measure"]) == 0
    assert "Fabric not measured: measure_fabric: needs at least 2 GPUs, found 0" in capsys.readouterr().out
    assert main(["doctor", "--measure", "--json"]) == 0
    fabric = json.loads(capsys.readouterr().out)["fabric"]
    assert fabric == {"measured": False, "reason": "measure_fabric: needs at least 2 GPUs, found 0; run on a machine with two or more GPUs"}


def test_measure_missing_module_is_a_reason(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tpfuse.probe.fabric", None)  # import raises ImportError
    assert main(["doctor", "--measure", "--json"]) == 0
    fabric = json.loads(capsys.readouterr().out)["fabric"]
    assert fabric["measured"] is False and fabric["reason"].startswith("fabric measurement not available")


def test_measure_result_table_and_json(capsys, monkeypatch, no_moe_section):
    calls = []

    def measure(caps, *, progress):
        progress("pair 0 -> 1", 1, 2)
        progress(0.75)
        calls.append(len(caps.gpus))
        pairs = (PeerMeasurement(0, 1, 52.5, 48.25, 2.5), PeerMeasurement(1, 0, 51.0, 47.0, 2.75))
        return FabricMeasurements(pairs, 0.42, "pull", method="copy kernel")

    install_fabric(monkeypatch, measure)
    monkeypatch.setattr(tpfuse.probe, "probe", lambda **kw: fake_gpu_caps())
    assert main(["doctor", "--measure"]) == 0
    out = capsys.readouterr().out
    fabric_rows = [line.replace("│", "|") for line in out.splitlines() if " 0 -> 1 " in line and "52.5" in line]
    assert calls == [2]
    assert len(fabric_rows) == 1 and " 48.2 " in fabric_rows[0] and " 2.50 " in fabric_rows[0]
    assert "all-to-all score 0.42" in out and "prefers pull" in out
    assert main(["doctor", "--measure", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fabric"] == {"measured": True, "reason": ""}
    assert report["probe"]["fabric"]["pairs"][0] == {"a": 0, "b": 1, "read_gbps": 52.5, "write_gbps": 48.25, "latency_us": 2.5}
    assert report["probe"]["fabric"]["prefers"] == "pull"


# ---- MoE runners ----------------------------------------------------------------------------------


def test_moe_runner_rows_are_shown_and_a_missing_module_is_said(capsys, monkeypatch):
    module = types.ModuleType("tpfuse.models.moe_runners")
    module.runner_report = lambda caps: [
        {"name": "grouped_mm", "admitted": True, "reason": "all needs met", "chosen": True, "why": "fastest measured"},
        {"name": "flashinfer_cutlass", "admitted": False, "reason": "needs the package 'flashinfer'", "chosen": False, "why": ""},
    ]
    monkeypatch.setitem(sys.modules, "tpfuse.models.moe_runners", module)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert " admitted " in row_of(out, "grouped_mm") and " fastest measured " in row_of(out, "grouped_mm")
    assert " not admitted " in row_of(out, "flashinfer_cutlass") and "needs the package 'flashinfer'" in row_of(out, "flashinfer_cutlass")
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["moe_runners"]["runners"][1]["name"] == "flashinfer_cutlass"
    monkeypatch.setitem(sys.modules, "tpfuse.models.moe_runners", None)
    assert main(["doctor"]) == 0
    assert "MoE runners: not available: " in capsys.readouterr().out


def test_a_missing_runtime_package_is_flagged_with_the_install_command_and_exit_2(capsys, monkeypatch):
    from tpfuse.cli import preflight

    monkeypatch.setitem(preflight.RUNTIME_PACKAGES, "tpfuse_no_such_package", "the ranks import it")
    assert main(["doctor"]) == 2
    out = capsys.readouterr().out
    assert "MISSING: tpfuse_no_such_package is not installed; the ranks import it" in out
    assert "Install it with `pip install tpfuse_no_such_package`." in out
    assert main(["doctor", "--json"]) == 2
    row = json.loads(capsys.readouterr().out)["runtime_packages"]["tpfuse_no_such_package"]
    assert row == {"installed": False, "needed_for": "the ranks import it"}
