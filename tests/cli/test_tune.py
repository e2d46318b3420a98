"""`tpfuse tune` and `tpfuse verify` end to end on 2 spawned gloo ranks, and their usage errors."""

import json
import os
from pathlib import Path

import pytest

from support.tune_test_strategies import PLUGINS
from tpfuse.cli.main import main
from tpfuse.dispatch.table import load, versions_of
from tpfuse.probe import probe
from tpfuse.results import read_rows

TESTS_DIR = str(Path(__file__).resolve().parents[1])


@pytest.mark.slow
@pytest.mark.gloo
def test_tune_writes_a_table_that_loads(tmp_path, capsys):
    rc = main(["tune", "--hidden", "64", "--max-tokens", "2", "--world-size", "2", "--op", "all_reduce_residual_rmsnorm",
               "--rounds", "5", "--confirm-rounds", "5", "--cache-dir", str(tmp_path), "--json",
               "--results", str(tmp_path / "rows.jsonl")])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 2 and report["backend"] == "gloo" and report["device"] == "cpu"
    path = report["path"]
    assert os.path.dirname(path) == str(tmp_path)
    entries = report["table"]["entries"]
    assert [(e["hidden"], e["tokens"]) for e in entries] == [(64, 1), (64, 2)]
    for e in entries:
        assert {"reference", "ring"} <= set(e["times_us"]) and e["choice"] in e["times_us"]
    table, why = load(path, report["table"]["fingerprint"], versions_of(probe()))
    assert why == "" and table.digest == report["table"]["digest"]
    # Every timed median is also a result row (first pass and confirmation).
    rows = read_rows(tmp_path / "rows.jsonl")
    expected = {(e["tokens"], n, "first", t["median"]) for e in entries for n, t in e["times_us"].items()}
    expected |= {(e["tokens"], n, "confirm", t["median"]) for e in entries for n, t in e["confirmed_us"].items()}
    assert {(r["shape"]["tokens"], r["strategy"], r["extra"]["phase"], r["median"]) for r in rows} == expected
    assert all(r["unit"] == "us" and r["world_size"] == 2 and r["p20"] <= r["median"] <= r["p80"] for r in rows)


@pytest.mark.slow
@pytest.mark.gloo
def test_verify_exits_1_on_revert(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TPFUSE_STRATEGIES", PLUGINS)
    rc = main(["verify", "--strategy", "slow_broadcast", "--baseline", "reference", "--hidden", "64",
               "--max-tokens", "1", "--world-size", "2", "--rounds", "15", "--json", "--results", str(tmp_path)])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and report["verdict"] == "REVERT"
    assert report["buckets"][0]["ratio"] > report["buckets"][0]["threshold"]
    # --results given a directory: the rows go to DIR/verify.jsonl, one per side of the A/B.
    rows = read_rows(tmp_path / "verify.jsonl")
    assert {(r["strategy"], r["extra"]["role"], r["extra"]["verdict"]) for r in rows} == {
        ("slow_broadcast", "candidate", "REVERT"), ("reference", "baseline", "REVERT")}


@pytest.mark.gloo
def test_verify_json_is_strict_when_nothing_was_measured(capsys, monkeypatch):
    # drops_last_rank is admitted but fails correctness: the bucket is REVERT with the reason and no
    # times, which --json prints as null (Python's json would otherwise write NaN, which is not JSON).
    monkeypatch.setenv("TPFUSE_STRATEGIES", "drops_last_rank=support.broken_strategy:DropsLastRankStrategy")
    monkeypatch.setenv("PYTHONPATH", TESTS_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rc = main(["verify", "--strategy", "drops_last_rank", "--baseline", "reference", "--hidden", "64",
               "--max-tokens", "1", "--world-size", "2", "--device", "cpu", "--rounds", "2", "--json"])
    out = capsys.readouterr().out
    assert rc == 1 and "NaN" not in out
    bucket = json.loads(out)["buckets"][0]
    assert bucket["ratio"] is None and bucket["candidate_us"] is None and bucket["verdict"] == "REVERT"


def test_verify_of_a_strategy_not_admitted_here_says_why_once_and_exits_2(capsys):
    rc = main(["verify", "--strategy", "oneshot", "--hidden", "64", "--max-tokens", "4", "--world-size", "2",
               "--device", "cpu", "--rounds", "2", "--json"])
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.err.count("needs CUDA tensors") == 1 and "REVERT" not in captured.err + captured.out
    assert captured.err.startswith("tpfuse verify: --strategy oneshot is not admitted on 2 gloo rank(s) on cpu")
    assert json.loads(captured.out)["exit_code"] == 2


@pytest.mark.parametrize("argv, message", [
    (["tune", "--max-tokens", "4"], "give --preset"),
    (["tune", "--hidden", "64", "--device", "cpu", "--shared-gpu"], "--shared-gpu needs --device cuda"),
    (["verify", "--strategy", "nope", "--hidden", "64"], "unknown strategy 'nope'"),
    (["verify", "--strategy", "reference", "--hidden", "64", "--rounds", "1"], "--rounds must be >= 2"),
    (["tune", "--hidden", "64", "--margin", "1.5"], "margin"),
    (["tune", "--hidden", "64", "--strategies", "reference,nope"], "unknown strategy nope in --strategies"),
])
def test_usage_errors_exit_2_and_say_the_fix(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_presets_give_the_hidden_sizes():
    import argparse

    from tpfuse.cli.args import hiddens

    args = argparse.Namespace(preset=["glm5", "qwen3-235b", "glm5"], hidden=[4096, 512], max_tokens=8)
    assert hiddens(args, "tune") == (6144, 4096, 512)
