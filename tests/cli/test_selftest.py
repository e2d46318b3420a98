"""`tpfuse selftest`: real ranks, the table's content, and a failing strategy caught."""

import json
import os
from pathlib import Path

import pytest

from tpfuse.cli.main import main

TESTS_DIR = str(Path(__file__).resolve().parents[1])


@pytest.mark.gloo
def test_selftest_two_ranks_passes_and_prints_the_table(capsys):
    code = main(["selftest", "--world-size", "2", "--strategy", "reference", "--repeats", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "tpfuse selftest: world size 2, gloo" in out
    for text in ("reference", "ar+add+norm", "exact", "random", "4x6144", "4x8192", "bf16", "fp16", "fp32", "PASS"):
        assert text in out
    assert "21 passed, 0 failed" in out
    assert out.rstrip().splitlines()[-1].startswith("selftest PASSED: 21 passed, 0 failed (reference) on 2 gloo rank(s) in ")


@pytest.mark.gloo
def test_selftest_json_and_a_wrong_strategy_fails_with_exit_1(capsys, monkeypatch):
    monkeypatch.setenv("TPFUSE_STRATEGIES", "drops_last_rank=support.broken_strategy:DropsLastRankStrategy")
    monkeypatch.setenv("PYTHONPATH", TESTS_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = main(["selftest", "--world-size", "2", "--strategy", "drops_last_rank", "--strategy", "reference",
                 "--repeats", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["passed"] is False and report["world_size"] == 2
    by_strategy = {}
    for row in report["results"]:
        by_strategy.setdefault(row["strategy"], []).append(row)
    assert all(row["passed"] for row in by_strategy["reference"])
    broken = by_strategy["drops_last_rank"]
    assert broken and not any(row["passed"] for row in broken)
    assert all(row["error"] > 0 for row in broken)


def test_selftest_usage_errors_exit_2(capsys):
    assert main(["selftest", "--world-size", "0"]) == 2
    assert "--world-size must be >= 1" in capsys.readouterr().err
    assert main(["selftest", "--strategy", "nope"]) == 2
    assert "unknown strategy 'nope'" in capsys.readouterr().err
    assert main(["selftest", "--world-size", "100000"]) == 2
    assert "use --world-size" in capsys.readouterr().err


def _table_preferring_reference(cache_dir):
    """A saved dispatch table for 2 gloo CPU ranks here in which ring is 2x slower than reference on
    every selftest case: what `Communicator(strategy="ring")` warns about ("remove the override")."""
    from tpfuse.dispatch.table import DispatchTable, Entry, fingerprint, now_iso, save, table_path, versions_of
    from tpfuse.group import expected_group_facts
    from tpfuse.probe import probe
    from tpfuse.selftest import default_cases

    caps = probe()
    fp = fingerprint(expected_group_facts(caps, 2, backend="gloo", device_type="cpu"), caps)
    times = {"reference": {"median": 10.0, "p20": 9.0, "p80": 11.0, "n": 5},
             "ring": {"median": 20.0, "p20": 19.0, "p80": 21.0, "n": 5}}
    keys = sorted({(c.op, c.dtype, c.hidden, c.num_tokens) for c in default_cases()})
    entries = tuple(Entry(op, dtype, hidden, tokens, "reference", "fastest unfused (10.0 us); no fused candidate",
                          "reference", times) for op, dtype, hidden, tokens in keys)
    save(DispatchTable(versions_of(caps), fp, entries, {"margin": 0.03}, now_iso()), table_path(fp, cache_dir))


@pytest.mark.gloo
def test_selftest_of_a_named_strategy_does_not_warn_about_an_override_nobody_set(capfd, monkeypatch, tmp_path):
    _table_preferring_reference(tmp_path)
    monkeypatch.setenv("TPFUSE_CACHE_DIR", str(tmp_path))
    assert main(["selftest", "--strategy", "ring", "--repeats", "1"]) == 0
    err = capfd.readouterr().err
    assert "remove the override" not in err and "warning" not in err, err
