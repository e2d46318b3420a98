"""`benchmarks/bench_allreduce_norm.py --device cpu` for real: 2 gloo CPU ranks, tiny sizes.

The script runs in a subprocess, as a user runs it (its ranks are spawned from its __main__). A
test-only strategy that is wrong on rank 1 (tests/support/tune_test_strategies.py, registered through
TPFUSE_STRATEGIES) must be rejected by the correctness check on every rank and never timed. Its
arguments, read in-process: the CLI's rank flags, and ranks it cannot run refused with the fix.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpfuse.results import read_rows

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_allreduce_norm.py"
HIDDENS, BUCKETS, PEER_GBPS = (32, 48), (1, 2, 3), 10.0
TIMED = {"tpfuse/reference", "tpfuse/ring"}
GPU_ONLY = {"tpfuse/nccl_epilogue", "tpfuse/nccl_eager", "tpfuse/oneshot", "tpfuse/twoshot"}
THIRD_PARTY = {"symm_mem_oneshot+epilogue", "symm_mem_twoshot+epilogue", "flashinfer_trtllm"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "sweep.jsonl"
    env = dict(os.environ, TPFUSE_STRATEGIES="wrong_on_rank_one=support.tune_test_strategies:WrongOnRankOne",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--hidden", ",".join(map(str, HIDDENS)), "--max-tokens", "3",
         "--trials", "3", "--warmup", "1", "--peer-gbps", str(PEER_GBPS), "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_rows(out), proc.stdout


@pytest.mark.gloo
def test_every_bucket_has_the_cpu_providers(smoke):
    rows, _ = smoke
    got = sorted((r["shape"]["hidden"], r["shape"]["tokens"], r["strategy"]) for r in rows)
    assert got == sorted((h, t, p) for h in HIDDENS for t in BUCKETS for p in TIMED)
    for r in rows:
        assert r["op"] == "all_reduce_residual_rmsnorm" and r["unit"] == "us" and r["dtype"] == "bfloat16"
        assert r["world_size"] == 2 and 0 < r["p20"] <= r["median"] <= r["p80"]
        assert r["extra"]["mode"] == "cpu-smoke" and r["extra"]["functional_only"] is True
        # every timed provider here is a tpfuse strategy: held to bit-exactness
        assert r["extra"]["check"].startswith("bit-exact")


@pytest.mark.gloo
def test_ratios_and_floor_recomputed(smoke):
    rows, _ = smoke
    # nccl_eager is not admitted on gloo CPU ranks: the ratio baseline is the reference strategy
    base = {(r["shape"]["hidden"], r["shape"]["tokens"]): r["median"]
            for r in rows if r["strategy"] == "tpfuse/reference"}
    for r in rows:
        h, t = r["shape"]["hidden"], r["shape"]["tokens"]
        assert r["extra"]["ratio_baseline"] == "tpfuse/reference"
        assert r["extra"]["ratio_vs_baseline"] == pytest.approx(r["median"] / base[(h, t)], rel=1e-12)
        # floor by hand: 2.5 us + 2(W-1)/W x T x H x 2 bytes over 10 GB/s, W = 2
        floor = 2.5 + t * h * 2 / (PEER_GBPS * 1e9) * 1e6
        assert r["extra"]["floor_us"] == pytest.approx(floor, rel=1e-12)
        assert r["extra"]["ratio_vs_floor"] == pytest.approx(r["median"] / floor, rel=1e-12)


@pytest.mark.gloo
def test_not_timed_providers_have_reasons(smoke):
    rows, _ = smoke
    for r in rows:
        not_timed = r["extra"]["not_timed"]
        assert set(not_timed) == GPU_ONLY | THIRD_PARTY | {"tpfuse/wrong_on_rank_one"}
        for name in GPU_ONLY:
            assert not_timed[name].startswith("not admitted: needs CUDA tensors")
        for name in THIRD_PARTY:
            assert "needs one GPU per rank over NCCL" in not_timed[name]
        wrong = not_timed["tpfuse/wrong_on_rank_one"]
        assert wrong.startswith("rank 1: failed the correctness check: not bit-exact") and "rank 0" not in wrong
    assert not any(r["strategy"] == "tpfuse/wrong_on_rank_one" for r in rows)


@pytest.mark.gloo
def test_table_printed_last(smoke):
    _, stdout = smoke
    lines = stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("hidden tokens"))
    body = lines[header + 1: header + 1 + len(HIDDENS) * len(BUCKETS)]
    assert [tuple(map(int, line.split()[:2])) for line in body] == [(h, t) for h in HIDDENS for t in BUCKETS]
    assert all(" x1.00 " in line for line in body)  # the reference against itself
    assert any(line.startswith("cells: median us per call, x = ratio to tpfuse/reference") for line in lines)
    assert any(line.startswith("not timed: tpfuse/oneshot") for line in lines[header:])


def _sweep_module():
    spec = importlib.util.spec_from_file_location("bench_allreduce_norm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_sweep_takes_the_same_rank_flags(capsys):
    sweep = _sweep_module()
    args = sweep.parse_args(["--world-size", "3", "--device", "cuda", "--shared-gpu"])
    assert (args.world_size, args.device, args.shared_gpu, args.timeout) == (3, "cuda", True, 3600.0)
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        sweep.parse_args(["--cpu-smoke"])  # the former flag is gone


def test_the_sweep_refuses_ranks_it_cannot_run_with_the_fix(capsys):
    assert _sweep_module().main(["--device", "cpu", "--shared-gpu"]) == 2
    assert capsys.readouterr().err.strip() == ("bench_allreduce_norm: --shared-gpu needs --device cuda (or auto on a "
                                               "GPU machine)")
