"""`--results` takes a .jsonl file or a directory, the same way in every command."""

from pathlib import Path

from tpfuse.results import results_file


def test_a_jsonl_path_is_used_as_is_and_a_directory_gets_the_command_file(tmp_path):
    assert results_file(tmp_path / "mine.jsonl", "e2e.jsonl") == tmp_path / "mine.jsonl"
    assert results_file(tmp_path, "e2e.jsonl") == tmp_path / "e2e.jsonl"
    assert results_file("benchmarks/results", "tune.jsonl") == Path("benchmarks/results/tune.jsonl")
    assert results_file(tmp_path / "rows.json", "e2e.jsonl") == tmp_path / "rows.json"  # a file, not a new directory
    (tmp_path / "runs.v2").mkdir()
    assert results_file(tmp_path / "runs.v2", "e2e.jsonl") == tmp_path / "runs.v2" / "e2e.jsonl"
