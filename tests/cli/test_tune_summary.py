"""`tpfuse tune`'s summary: the reasons of the buckets the do-no-harm guard weighed, told from the
entry's `guarded` field (not from the words of its reason)."""

from __future__ import annotations

from tpfuse.cli.tune import _print_measured, _print_outcome
from tpfuse.dispatch.table import DispatchTable, Entry

TIMES = {"reference": {"median": 10.0, "p20": 9.0, "p80": 11.0, "n": 5}}


def _entry(tokens: int, reason: str, guarded: bool) -> Entry:
    return Entry("all_reduce", "float32", 64, tokens, "reference", reason, "reference", TIMES, {}, {}, guarded=guarded)


def test_the_summary_tells_the_reasons_of_guarded_buckets_only(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    table = DispatchTable({}, {}, (_entry(1, "kept unfused reference: weighed", True),
                                   _entry(2, "a reason naming fused strategies, not weighed", False)))
    _print_measured(table, 2, "gloo", "cpu")
    _print_outcome(table, None, None, 1.0)
    out = capsys.readouterr().out
    assert "all_reduce 1x64: kept unfused reference: weighed" in out
    assert "not weighed" not in out
    assert "tune: 2 bucket(s) measured in 1.0 s, chosen: reference; dispatch table not saved (--no-save)" in out
