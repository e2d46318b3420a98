"""Dispatch table schema 2 (`guarded` per entry) and the schema-1 files that must still load."""

from __future__ import annotations

import json

import pytest

from tpfuse.dispatch.table import (
    SCHEMA_VERSION,
    DispatchTable,
    Entry,
    canonical_digest,
    load,
    merged_with_saved,
    parse,
    save,
    table_path,
)
from tpfuse.tune.tuner import decide

FP = {"world_size": 2, "backend": "gloo", "device_type": "cpu", "num_hosts": 1, "shares_device": False,
      "peer_access": False, "cpu": ["test cpu", 2]}
VERSIONS = {"tpfuse": "0.0", "torch": "0.0", "driver": None, "cuda": None}
TIMES = {"reference": {"median": 10.0, "p20": 9.0, "p80": 11.0, "n": 5},
         "oneshot": {"median": 9.0, "p20": 8.0, "p80": 10.0, "n": 5}}
# The four reasons `decide` gives, and whether the guard weighed a fused candidate in each.
REASONS = {
    "fused oneshot beats unfused reference by 10.0% (margin 3%)": True,
    "kept unfused reference: fused oneshot is +1.0% faster, less than the 3% margin": True,
    "fastest candidate; no unfused strategy passed to compare against": True,
    "fastest unfused (10.0 us); no fused candidate": False,
}


def is_fused(name: str) -> bool:
    return name in ("oneshot", "twoshot")


def schema_1_text(reasons, *, choice="reference", best_unfused="reference") -> str:
    """A schema-1 file as tpfuse wrote it before `guarded` existed (no such field, valid digest)."""
    entries = [{"op": "all_reduce_residual_rmsnorm", "dtype": "bfloat16", "hidden": 64, "tokens": 2 ** i,
                "choice": choice, "reason": reason, "best_unfused": best_unfused, "times_us": TIMES,
                "confirmed_us": {}, "rejected": {}} for i, reason in enumerate(reasons)]
    raw = {"kind": "tpfuse-dispatch-table", "schema": 1, "created": "2026-01-01T00:00:00+00:00",
           "versions": VERSIONS, "fingerprint": FP, "fingerprint_digest": canonical_digest(FP),
           "settings": {"margin": 0.03}, "entries": entries}
    return json.dumps({**raw, "digest": canonical_digest(raw)})


def test_a_schema_1_file_loads_with_guarded_derived_from_each_reason(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(schema_1_text(REASONS))
    table, why = load(path, FP, VERSIONS)
    assert why == ""
    assert {e.reason: e.guarded for e in table.entries} == REASONS
    assert table.schema == SCHEMA_VERSION == 2  # held, and written again, as the current schema


def test_a_schema_1_table_saved_again_is_schema_2_with_the_derived_field(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(schema_1_text(REASONS))
    table, _ = load(path, FP, VERSIONS)
    save(table, path)
    raw = json.loads(path.read_text())
    assert raw["schema"] == 2 and [e["guarded"] for e in raw["entries"]] == list(REASONS.values())
    again, why = load(path, FP, VERSIONS)
    assert why == "" and again == table


def test_a_schema_1_file_under_a_former_strategy_name_loads_under_the_current_one(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(schema_1_text(["fastest unfused (5.0 us); no fused candidate"], choice="nccl_fused",
                                  best_unfused="nccl_fused"))
    table, why = load(path, FP, VERSIONS)
    assert why == ""
    (entry,) = table.entries
    assert (entry.choice, entry.best_unfused, entry.guarded) == ("nccl_epilogue", "nccl_epilogue", False)


def test_an_edited_schema_1_file_is_still_a_digest_mismatch(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(schema_1_text(REASONS).replace('"choice": "reference"', '"choice": "oneshot"', 1))
    table, why = load(path, FP, VERSIONS)
    assert table is None and "digest mismatch" in why


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
    (lambda raw: raw.update(schema=1), "entries[0]: unexpected field(s) 'guarded'"),
])
def test_schema_2_needs_a_boolean_guarded_and_schema_1_has_none(tmp_path, edit, reason):
    raw = json.loads(_table([_entry(1, True)]).to_json())
    edit(raw)
    raw["digest"] = canonical_digest({k: v for k, v in raw.items() if k != "digest"})
    with pytest.raises(ValueError, match="malformed field") as info:
        parse(json.dumps(raw))
    assert reason in str(info.value)


def test_a_later_schema_is_stale(tmp_path):
    path = save(DispatchTable(VERSIONS, FP, (_entry(1, False),), {}, "", schema=3), tmp_path / "t.json")
    table, why = load(path, FP, VERSIONS)
    assert table is None and "stale: schema 3, this tpfuse reads schema 1 and 2" in why


@pytest.mark.parametrize("medians", [
    {"reference": 100.0, "oneshot": 90.0}, {"reference": 100.0, "oneshot": 99.0}, {"oneshot": 5.0, "twoshot": 4.0},
    {"reference": 100.0, "ring": 90.0}, {"reference": 100.0, "ring": 90.0, "oneshot": 80.0},
])
def test_the_tuners_guarded_is_what_matching_its_reason_found(medians):
    """tune sets `guarded` when a fused candidate is among the deciding medians; readers of schema 1
    found the same entries by matching "fused" in decide's reason (without "no fused candidate")."""
    _, _, reason = decide(medians, 0.03, is_fused)
    matched = "fused" in reason and "no fused candidate" not in reason
    assert matched == any(is_fused(n) for n in medians)


def test_merged_with_saved_keeps_other_buckets_replaces_same_ones_or_starts_fresh(tmp_path):
    path = table_path(FP, tmp_path)
    measured = _table([_entry(2, True, "oneshot")])
    assert merged_with_saved(measured, path, VERSIONS) == measured  # nothing saved yet
    save(_table([_entry(1, False), _entry(2, False)]), path)
    merged = merged_with_saved(measured, path, VERSIONS)
    assert sorted((e.tokens, e.choice, e.guarded) for e in merged.entries) == [(1, "reference", False), (2, "oneshot", True)]
    assert merged_with_saved(measured, path, VERSIONS, fresh=True) == measured
    assert merged_with_saved(measured, path, {**VERSIONS, "torch": "9.9"}) == measured  # a stale table is replaced


@pytest.mark.parametrize("name", ["tune_cpu_table.json", "tune_shared_gpu_table.json"])
def test_the_schema_1_tables_kept_in_benchmarks_results_parse(name):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / name).read_text()
    raw = json.loads(text)
    assert raw["schema"] == 1
    table = parse(text)
    assert table.schema == 2
    assert [e.guarded for e in table.entries] == ["fused" in e["reason"] and "no fused candidate" not in e["reason"]
                                                  for e in raw["entries"]]
