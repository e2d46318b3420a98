"""A second `tpfuse tune` reports only what it measured: result rows and the printed table hold this
run's buckets, never the cached rows of an earlier run stamped anew; the saved table keeps both."""

import json
import re

import pytest

from tpfuse.cli.main import main
from tpfuse.results import read_rows

pytestmark = pytest.mark.gloo

BASE = ["tune", "--hidden", "64", "--world-size", "2", "--device", "cpu", "--op", "all_reduce_residual_rmsnorm",
        "--strategies", "reference,ring", "--rounds", "2", "--confirm-rounds", "2"]


def test_rerun_reports_only_its_own_buckets(tmp_path, capsys):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main([*BASE, *cache, "--max-tokens", "8", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert sorted(e["tokens"] for e in first["table"]["entries"]) == [1, 2, 4, 8]

    rows_file = tmp_path / "rows.jsonl"
    assert main([*BASE, *cache, "--max-tokens", "2", "--results", str(rows_file)]) == 0
    out = capsys.readouterr().out
    # The printed table: this run's buckets, in order; the summary says the saved table kept the others.
    tokens = [int(m.group(1)) for m in re.finditer(r"^│ ar\+add\+rmsnorm\s+│\s+64\s+│\s+(\d+)\s+│", out, re.M)]
    assert tokens == [1, 2]
    assert re.search(r"^tune: 2 bucket\(s\) measured in [\d.]+ s, chosen: .+; dispatch table saved to .+ \(with 2 "
                     r"bucket\(s\) kept from earlier runs\)$", out, re.M)
    # The rows: this run's buckets 1 and 2 only, each strategy's first pass, each row once.
    rows = read_rows(rows_file)
    keys = [(r["shape"]["tokens"], r["strategy"], r["extra"]["phase"]) for r in rows]
    assert sorted({k[0] for k in keys}) == [1, 2] and len(keys) == len(set(keys))
    assert {(t, name, "first") for t in (1, 2) for name in ("reference", "ring")} <= set(keys)
    assert all(r["command"] == rows[0]["command"] for r in rows)

