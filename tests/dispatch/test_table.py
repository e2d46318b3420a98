"""The dispatch table file: round trip, lookup rules, and every way a file can be unusable."""

import json

import pytest

from tpfuse.dispatch.table import (
    SCHEMA_VERSION,
    DispatchTable,
    Entry,
    fingerprint,
    load,
    parse,
    save,
    table_path,
    token_buckets,
    versions_of,
)
from tpfuse.probe import probe
from tpfuse.spec import GroupFacts


@pytest.fixture(scope="module")
def here():
    caps = probe()
    facts = GroupFacts(world_size=2, backend="gloo", device_type="cpu", devices=("cpu", "cpu"))
    return fingerprint(facts, caps), versions_of(caps)


def _entry(tokens, choice="reference", hidden=64, op="all_reduce_residual_rmsnorm"):
    times = {"reference": {"median": 10.0 + tokens, "p20": 9.0, "p80": 12.0, "n": 5},
             "ring": {"median": 20.0 + tokens, "p20": 19.0, "p80": 22.0, "n": 5}}
    return Entry(op, "bfloat16", hidden, tokens, choice, "fastest", "reference", times, {}, {"x": "not admitted"})


def _table(here, entries=None):
    fp, versions = here
    entries = entries or tuple(_entry(t) for t in (1, 2, 4, 8))
    return DispatchTable(versions, fp, tuple(entries), {"margin": 0.03}, "2026-01-01T00:00:00+00:00")


def test_token_buckets():
    assert token_buckets(1) == [1]
    assert token_buckets(8) == [1, 2, 4, 8]
    assert token_buckets(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError, match="max_tokens"):
        token_buckets(0)


def test_round_trip_keeps_every_field_and_digest(here, tmp_path):
    table = _table(here)
    path = save(table, table_path(table.fingerprint, tmp_path))
    loaded, why = load(path, *here)
    assert why == "" and loaded == table and loaded.digest == table.digest
    raw = json.loads(path.read_text())
    assert raw["schema"] == SCHEMA_VERSION and set(raw["versions"]) >= {"tpfuse", "torch", "driver"}
    assert raw["entries"][0]["times_us"]["ring"]["median"] == 21.0
    assert path.name == f"dispatch-{table.fingerprint_digest[:16]}.json"


def test_lookup_rounds_up_to_the_next_bucket_and_never_extrapolates(here):
    table = _table(here, [_entry(1, "a"), _entry(2, "b"), _entry(4, "c"), _entry(8, "d"), _entry(4, "e", hidden=128)])
    assert [table.lookup("all_reduce_residual_rmsnorm", "bfloat16", 64, n).choice for n in (1, 2, 3, 4, 5, 8)] == list("abccdd")
    assert table.lookup("all_reduce_residual_rmsnorm", "bfloat16", 64, 9) is None  # beyond the largest bucket
    assert table.lookup("all_reduce_residual_rmsnorm", "bfloat16", 96, 1) is None  # hidden not tuned
    assert table.lookup("all_reduce_residual_rmsnorm", "float16", 64, 1) is None  # dtype not tuned
    assert table.lookup("all_reduce", "bfloat16", 64, 1) is None  # op not tuned
    assert table.lookup("all_reduce_residual_rmsnorm", "bfloat16", 128, 3).choice == "e"


def test_merge_replaces_same_buckets_and_keeps_others(here):
    old = _table(here, [_entry(1, "a"), _entry(2, "b")])
    new = _table(here, [_entry(2, "z"), _entry(2, "y", hidden=128)])
    merged = old.merged(new)
    assert sorted((e.hidden, e.tokens, e.choice) for e in merged.entries) == [(64, 1, "a"), (64, 2, "z"), (128, 2, "y")]


@pytest.mark.parametrize("damage, expect", [
    (lambda text: text[: len(text) // 2], "corrupt"),  # truncated
    (lambda text: "not json at all", "corrupt"),
    (lambda text: text.replace('"choice": "reference"', '"choice": "ring"', 1), "digest mismatch"),  # edited
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "entries"}), "corrupt"),
    (lambda text: json.dumps([1, 2]), "not a tpfuse dispatch table"),
])
def test_corrupt_files_are_reported_never_raised(here, tmp_path, damage, expect):
    path = save(_table(here), tmp_path / "t.json")
    path.write_text(damage(path.read_text()))
    table, why = load(path, *here)
    assert table is None and expect in why


def test_stale_and_foreign_tables_are_ignored(here, tmp_path):
    fp, versions = here
    path = save(_table(here), tmp_path / "t.json")
    for key in ("tpfuse", "torch", "driver"):
        table, why = load(path, fp, {**versions, key: "0.0-other"})
        assert table is None and why.endswith("running 0.0-other") and "stale" in why
    table, why = load(path, {**fp, "world_size": 4}, versions)
    assert table is None and "foreign" in why
    old = DispatchTable(versions, fp, (_entry(1),), {}, "", schema=SCHEMA_VERSION + 1)
    save(old, path)
    table, why = load(path, fp, versions)
    assert table is None and "schema" in why
    table, why = load(tmp_path / "missing.json", fp, versions)
    assert table is None and "no dispatch table" in why


def test_parse_rejects_a_file_whose_digest_does_not_match(here):
    text = _table(here).to_json()
    raw = json.loads(text)
    raw["entries"][0]["times_us"]["ring"]["median"] = 1.0
    with pytest.raises(ValueError, match="digest"):
        parse(json.dumps(raw))
