"""`tpfuse verify` end to end on 2 spawned gloo ranks: exit 1 on REVERT with a result row for each
side of the A/B, strict JSON when nothing was measured, one reason and exit 2 for a strategy not
admitted here, and its usage errors."""

import json
import os
from pathlib import Path

import pytest

from support.tune_test_strategies import PLUGINS
from tpfuse.cli.main import main
from tpfuse.results import read_rows

TESTS_DIR = str(Path(__file__).resolve().parents[1])


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
    (["verify", "--strategy", "nope", "--hidden", "64"], "unknown strategy 'nope'"),
    (["verify", "--strategy", "reference", "--hidden", "64", "--rounds", "1"], "--rounds must be >= 2"),
])
def test_usage_errors_exit_2_and_say_the_fix(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
