"""Dispatch table schema 2 (`guarded` per entry); a table of any other schema is stale, never converted."""

from __future__ import annotations

import json

import pytest

from tpfuse.dispatch.table import (
    SCHEMA_VERSION,
    DispatchTable,
    Entry,
    StaleTableError,
    canonical_digest,
    load,
    parse,
    save,
    save_merged,
    table_path,
)

FP = {"world_size": 2, "backend": "gloo", "device_type": "cpu", "num_hosts": 1, "shares_device": False,
      "peer_access": False, "cpu": ["test cpu", 2]}
VERSIONS = {"tpfuse": "0.0", "torch": "0.0", "driver": None, "cuda": None}
TIMES = {"reference": {"median": 10.0, "p20": 9.0, "p80": 11.0, "n": 5},
         "oneshot": {"median": 9.0, "p20": 8.0, "p80": 10.0, "n": 5}}
def is_fused(name: str) -> bool:
    return name in ("oneshot", "twoshot")


def schema_1_text() -> str:
    """A schema-1 file as tpfuse once wrote it (no `guarded` field, valid digest)."""
    entry = {"op": "all_reduce_residual_rmsnorm", "dtype": "bfloat16", "hidden": 64, "tokens": 1,
             "choice": "reference", "reason": "fastest unfused (10.0 us); no fused candidate",
             "best_unfused": "reference", "times_us": TIMES, "confirmed_us": {}, "rejected": {}}
    raw = {"kind": "tpfuse-dispatch-table", "schema": 1, "created": "2026-01-01T00:00:00+00:00",
           "versions": VERSIONS, "fingerprint": FP, "fingerprint_digest": canonical_digest(FP),
           "settings": {"margin": 0.03}, "entries": [entry]}
    return json.dumps({**raw, "digest": canonical_digest(raw)})


def test_a_schema_1_file_is_stale_and_ignored_with_the_reason(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(schema_1_text())
    table, why = load(path, FP, VERSIONS)
    assert table is None and why.endswith("stale: schema 1, this tpfuse reads schema 2")
    with pytest.raises(StaleTableError):
        parse(schema_1_text())


def _entry(tokens: int, guarded: bool, choice: str = "reference") -> Entry:
    return Entry("all_reduce_residual_rmsnorm", "bfloat16", 64, tokens, choice, "r", "reference", TIMES, {}, {},
                 guarded=guarded)


def _table(entries) -> DispatchTable:
    return DispatchTable(VERSIONS, FP, tuple(entries), {"margin": 0.03}, "2026-01-01T00:00:00+00:00")


def test_schema_2_round_trip_keeps_guarded(tmp_path):
    table = _table([_entry(1, True), _entry(2, False)])
    path = save(table, tmp_path / "t.json")
    assert [e["guarded"] for e in json.loads(path.read_text())["entries"]] == [True, False]
    loaded, why = load(path, FP, VERSIONS)
    assert why == "" and loaded == table and loaded.digest == table.digest


@pytest.mark.parametrize("edit, reason", [
    (lambda raw: raw["entries"][0].pop("guarded"), "entries[0]: missing field(s) guarded"),
    (lambda raw: raw["entries"][0].update(guarded="yes"), "entries[0].guarded: expected true or false, got 'yes'"),
    (lambda raw: raw["entries"][0].update(guarded=1), "entries[0].guarded: expected true or false, got 1"),
])
def test_schema_2_needs_a_boolean_guarded(tmp_path, edit, reason):
    raw = json.loads(_table([_entry(1, True)]).to_json())
    edit(raw)
    raw["digest"] = canonical_digest({k: v for k, v in raw.items() if k != "digest"})
    with pytest.raises(ValueError, match="malformed field") as info:
        parse(json.dumps(raw))
    assert reason in str(info.value)


def test_a_later_schema_is_stale(tmp_path):
    path = save(DispatchTable(VERSIONS, FP, (_entry(1, False),), {}, "", schema=3), tmp_path / "t.json")
    table, why = load(path, FP, VERSIONS)
    assert table is None and "stale: schema 3, this tpfuse reads schema 2" in why


def test_save_merged_keeps_other_buckets_replaces_same_ones_or_starts_fresh(tmp_path):
    path = table_path(FP, tmp_path)
    measured = _table([_entry(2, True, "oneshot")])
    assert save_merged(measured, path).table == measured  # nothing saved yet
    save(_table([_entry(1, False), _entry(2, False)]), path)
    saved = save_merged(measured, path)
    assert sorted((e.tokens, e.choice, e.guarded) for e in saved.table.entries) == [(1, "reference", False),
                                                                                     (2, "oneshot", True)]
    assert saved.kept is None and load(path, FP, VERSIONS)[0] == saved.table
    assert save_merged(measured, path, fresh=True).table == measured


@pytest.mark.parametrize("name", ["tune_cpu_table.json", "tune_shared_gpu_table.json"])
def test_the_tables_kept_in_benchmarks_results_are_current(name):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / name).read_text()
    table = parse(text)
    assert table.schema == SCHEMA_VERSION and table.to_json() == text
