"""`--results` takes a .jsonl file or a directory, the same way in every command; rows are strict JSON."""

import json
from pathlib import Path

from tpfuse.results import append_rows, make_row, read_rows, results_file


def test_a_jsonl_path_is_used_as_is_and_a_directory_gets_the_command_file(tmp_path):
    assert results_file(tmp_path / "mine.jsonl", "e2e.jsonl") == tmp_path / "mine.jsonl"
    assert results_file(tmp_path, "e2e.jsonl") == tmp_path / "e2e.jsonl"
    assert results_file("benchmarks/results", "tune.jsonl") == Path("benchmarks/results/tune.jsonl")
    assert results_file(tmp_path / "rows.json", "e2e.jsonl") == tmp_path / "rows.json"  # a file, not a new directory
    (tmp_path / "runs.v2").mkdir()
    assert results_file(tmp_path / "runs.v2", "e2e.jsonl") == tmp_path / "runs.v2" / "e2e.jsonl"


def test_unmeasured_values_are_written_as_null_never_nan(tmp_path):
    rows = [make_row("op", "failed", {"tokens": 1}, "bfloat16", 1, [], "us", failed="RuntimeError: no GPU"),
            make_row("op", "nan", {"tokens": 1}, "bfloat16", 1, [float("nan")], "us", gbps=float("inf"),
                     parts=[1.0, float("nan")]),
            make_row("op", "measured", {"tokens": 1}, "bfloat16", 1, [3.0, 1.0, 2.0], "us")]
    path = append_rows(tmp_path / "rows.jsonl", rows)
    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=lambda name: (_ for _ in ()).throw(AssertionError(f"{name} in {line}")))
    failed, nan, measured = read_rows(path)
    assert (failed["median"], failed["p20"], failed["p80"]) == (None, None, None)
    assert failed["extra"]["failed"] == "RuntimeError: no GPU"
    assert nan["median"] is None and nan["extra"] == {"gbps": None, "parts": [1.0, None]}
    assert measured["median"] == 2.0
