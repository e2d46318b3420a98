"""A second `fusegate tune` reports only what it measured: result rows and the printed table hold this
run's buckets, never the cached rows of an earlier run stamped anew; the saved table keeps both."""

import json
import re

from fusegate.bench.results import read_rows
from fusegate.cli.main import main

BASE = ["tune", "--hidden", "64", "--world-size", "2", "--device", "cpu", "--op", "all_reduce_residual_rmsnorm",
        "--strategies", "reference,ring", "--rounds", "2", "--confirm-rounds", "2"]


def test_rerun_reports_only_its_own_buckets(tmp_path, capsys):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main([*BASE, *cache, "--max-tokens", "8", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert sorted(e["tokens"] for e in first["table"]["entries"]) == [1, 2, 4, 8]

    rows_file = tmp_path / "rows.jsonl"
    assert main([*BASE, *cache, "--max-tokens", "2", "--json", "--results", str(rows_file)]) == 0
    second = json.loads(capsys.readouterr().out)
    # The saved table still holds the first run's larger buckets ...
    assert sorted(e["tokens"] for e in second["table"]["entries"]) == [1, 2, 4, 8]
    # ... but the rows are this run's: buckets 1 and 2, each strategy's first and confirmation passes.
    rows = read_rows(rows_file)
    assert sorted({r["shape"]["tokens"] for r in rows}) == [1, 2]
    measured = {(e["tokens"], name, phase) for e in second["measured"]
                for phase, times in (("first", e["times_us"]), ("confirm", e["confirmed_us"])) for name in times}
    assert {(r["shape"]["tokens"], r["strategy"], r["extra"]["phase"]) for r in rows} == measured
    assert len(rows) == len(measured)

    assert main([*BASE, *cache, "--max-tokens", "2", "--no-save"]) == 0
    out = capsys.readouterr().out
    tokens = [int(m.group(1)) for m in re.finditer(r"^│ ar\+add\+rmsnorm\s+│\s+64\s+│\s+(\d+)\s+│", out, re.M)]
    assert tokens == [1, 2]
    assert re.search(r"^tune: 2 bucket\(s\) measured in [\d.]+ s, chosen: .+; dispatch table not saved \(--no-save\)$",
                     out, re.M)
