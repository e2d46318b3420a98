"""The dispatch table file: round trip, lookup rules, schema 2 (a table of any other schema is
stale, never converted), merged saves, and every way a file can be unusable.

An unusable table is ignored with the reason, never raised, on every rank alike (the gloo side is in
test_agree.py). Typed validation at load: a wrong-typed field is refused even when the digest was
recomputed to match (the file then passes every other check), and bytes that are not UTF-8 are a
reason too. A cache directory that cannot be written is a `CacheDirError` naming the fix, and a
save leaves no temporary file behind.
"""

import json
import os
import subprocess
import sys

import pytest

from tpfuse.dispatch.table import (
    MAX_TABLE_BYTES,
    SCHEMA_VERSION,
    CacheDirError,
    DispatchTable,
    Entry,
    StaleTableError,
    canonical_digest,
    check_writable,
    fingerprint,
    load,
    parse,
    save,
    save_merged,
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
    assert ([table.lookup("all_reduce_residual_rmsnorm", "bfloat16", 64, n).choice for n in (1, 2, 3, 4, 5, 8)]
            == list("abccdd"))
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


# ---- tables that cannot be used ------------------------------------------------------------------

def _two_bucket_table(fp, versions) -> DispatchTable:
    times = {"reference": {"median": 10.0, "p20": 9.0, "p80": 12.0, "n": 5},
             "ring": {"median": 20.0, "p20": 19.0, "p80": 22.0, "n": 5}}
    entries = tuple(Entry("all_reduce", "float32", 16, t, "reference", "fastest", "reference", times, {},
                          {"x": "not admitted"}) for t in (1, 8))
    return DispatchTable(versions, fp, entries, {"margin": 0.03, "rounds": 5, "confirm_rounds": 5},
                         "2026-01-01T00:00:00+00:00")


def _resigned(raw: dict) -> str:
    """`raw` with its digest recomputed, as a careful editor (or a buggy writer) would leave it."""
    raw = dict(raw)
    raw["digest"] = canonical_digest({k: v for k, v in raw.items() if k != "digest"})
    return json.dumps(raw)


def _set(path: str, value):
    def edit(raw):
        node, keys = raw, path.split(".")
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(keys[-1]) if isinstance(node, list) else keys[-1]] = value
        return raw
    return edit


WRONG_TYPED = [
    ("entries.0.tokens", _set("entries.0.tokens", "8"), "entries[0].tokens: expected an integer >= 1"),
    ("entries.0.hidden", _set("entries.0.hidden", 0), "entries[0].hidden: expected an integer >= 1"),
    ("entries.1.tokens", _set("entries.1.tokens", True), "entries[1].tokens: expected an integer"),
    ("entries.0.choice", _set("entries.0.choice", 3), "entries[0].choice: expected a non-empty string"),
    ("entries.0.op", _set("entries.0.op", "all_gather"), "entries[0].op: expected one of"),
    ("entries.0.best_unfused", _set("entries.0.best_unfused", ["ring"]), "entries[0].best_unfused"),
    ("median", _set("entries.0.times_us.ring.median", "fast"),
     "entries[0].times_us.ring.median: expected a finite number"),
    ("negative", _set("entries.0.times_us.ring.p20", -1.0), "entries[0].times_us.ring.p20"),
    ("n", _set("entries.0.times_us.ring.n", 2.5), "entries[0].times_us.ring.n: expected an integer"),
    ("times_us", _set("entries.0.times_us", [1, 2]), "entries[0].times_us: expected an object"),
    ("rejected", _set("entries.0.rejected.x", 7), "entries[0].rejected.x: expected a string"),
    ("entry fields", _set("entries.0.extra", 1), "entries[0]: unexpected field(s) 'extra'"),
    ("entries", _set("entries", {"a": 1}), "entries: expected a list"),
    ("duplicate", lambda raw: {**raw, "entries": raw["entries"] + raw["entries"][:1]}, "the same bucket"),
    ("margin", _set("settings.margin", "3%"), "settings.margin: expected a finite number in [0, 1)"),
    ("margin range", _set("settings.margin", 1.5), "settings.margin"),
    ("rounds", _set("settings.rounds", None), "settings.rounds"),
    ("versions", _set("versions", ["torch"]), "versions: expected an object"),
    ("version", _set("versions.torch", 2), "versions.torch: expected a string"),
    ("created", _set("created", 20260101), "created: expected a string"),
    ("schema", _set("schema", "1"), "schema: expected an integer"),
    ("fingerprint", _set("fingerprint", "cpu"), "fingerprint: expected an object"),
    ("missing", lambda raw: {k: v for k, v in raw.items() if k != "settings"}, "missing field(s) settings"),
]


@pytest.mark.parametrize("name,edit,reason", WRONG_TYPED, ids=[w[0] for w in WRONG_TYPED])
def test_wrong_typed_fields_are_refused_at_load_even_with_a_recomputed_digest(here, tmp_path, name, edit, reason):
    path = save(_two_bucket_table(*here), tmp_path / "t.json")
    path.write_text(_resigned(edit(json.loads(path.read_text()))))
    table, why = load(path, *here)
    assert table is None, name
    assert why.startswith(f"corrupt dispatch table {path}: malformed field: ") and reason in why, why


def test_a_valid_table_still_loads(here, tmp_path):
    table = _two_bucket_table(*here)
    path = save(table, tmp_path / "t.json")
    path.write_text(_resigned(json.loads(path.read_text())))  # re-signing alone changes nothing
    loaded, why = load(path, *here)
    assert why == "" and loaded == table
    assert loaded.lookup("all_reduce", "float32", 16, 3).tokens == 8


@pytest.mark.parametrize("damage,reason", [
    (lambda data: data.replace(b'"fastest"', b'"fast\xe9st"', 1), "not UTF-8 text (byte 0xe9 at offset"),
    (lambda data: b"\xff\xfe" + data, "not UTF-8 text (byte 0xff at offset 0)"),
    (lambda data: data.replace(b"10.0", b"NaN", 1), "NaN is not a number JSON allows"),
    (lambda data: data.replace(b"10.0", b"Infinity", 1), "Infinity is not a number JSON allows"),
    (lambda data: b"[" * 200_000, "nested too deeply"),
    (lambda data: data.replace(b'"n": 5', b'"n": ' + b"9" * 5000, 1), "not valid JSON"),
    (lambda data: b"", "not valid JSON"),
])
def test_undecodable_bytes_are_a_reason_never_an_exception(here, tmp_path, damage, reason):
    path = save(_two_bucket_table(*here), tmp_path / "t.json")
    path.write_bytes(damage(path.read_bytes()))
    table, why = load(path, *here)
    assert table is None and why.startswith(f"corrupt dispatch table {path}: ") and reason in why, why


def test_what_is_not_a_table_file_is_not_read(here, tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # opening it would block until a writer came
    assert load(fifo, *here) == (None, f"ignoring {fifo}: not a regular file")
    assert load(tmp_path, *here) == (None, f"ignoring {tmp_path}: not a regular file")
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_TABLE_BYTES + 1)  # sparse: no memory, no disk
    table, why = load(big, *here)
    assert table is None and f"more than a table's {MAX_TABLE_BYTES}" in why


def _one_bucket(fp, versions, tokens: int) -> DispatchTable:
    times = {"reference": {"median": 10.0, "p20": 9.0, "p80": 12.0, "n": 5}}
    entry = Entry("all_reduce", "float32", 16, tokens, "reference", "fastest", "reference", times, {}, {})
    return DispatchTable(versions, fp, (entry,), {"margin": 0.03}, "2026-01-01T00:00:00+00:00")


@pytest.mark.parametrize("name, edit, why", [
    ("newer schema", lambda raw: raw.update(schema=3), "stale: schema 3"),
    ("other torch", lambda raw: raw["versions"].update(torch="9.9"), "stale: tuned with torch 9.9"),
    ("corrupt", None, "corrupt dispatch table"),
])
def test_a_table_that_cannot_be_merged_is_kept_aside_never_overwritten(here, tmp_path, name, edit, why):
    from tpfuse.dispatch.table import save_merged, table_path

    path = table_path(here[0], tmp_path)
    if edit is None:
        path.write_bytes(b"{not json")
    else:
        raw = json.loads(_two_bucket_table(*here).to_json())
        edit(raw)
        path.write_text(_resigned(raw))
    before = path.read_bytes()
    saved = save_merged(_one_bucket(*here, 4), path)
    assert saved.kept is not None and saved.kept.read_bytes() == before, name
    assert saved.kept.name.startswith(f"{path.name}.kept-") and why in saved.kept_why
    assert [e.tokens for e in load(path, *here)[0].entries] == [4]


def _save_buckets(fp, versions, directory, first: int, count: int) -> None:
    from tpfuse.dispatch.table import save_merged, table_path

    for tokens in range(first, first + count):
        save_merged(_one_bucket(fp, versions, tokens), table_path(fp, directory))


def test_concurrent_saves_keep_every_bucket(here, tmp_path):
    """Two tunes saving at once each re-read the table under the lock: neither loses the other's buckets."""
    import multiprocessing

    from tpfuse.dispatch.table import table_path

    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_save_buckets, args=(*here, str(tmp_path), 1 + 100 * i, 25)) for i in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=120)
        assert w.exitcode == 0
    table, why = load(table_path(here[0], tmp_path), *here)
    assert why == "" and sorted(e.tokens for e in table.entries) == sorted(
        t for i in range(3) for t in range(1 + 100 * i, 26 + 100 * i))


# ---- schema 2 -----------------------------------------------------------------------------------

FP = {"world_size": 2, "backend": "gloo", "device_type": "cpu", "num_hosts": 1, "shares_device": False,
      "peer_access": False, "cpu": ["test cpu", 2]}
VERSIONS = {"tpfuse": "0.0", "torch": "0.0", "driver": None, "cuda": None}
TIMES = {"reference": {"median": 10.0, "p20": 9.0, "p80": 11.0, "n": 5},
         "oneshot": {"median": 9.0, "p20": 8.0, "p80": 10.0, "n": 5}}


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


def _schema_entry(tokens: int, guarded: bool, choice: str = "reference") -> Entry:
    return Entry("all_reduce_residual_rmsnorm", "bfloat16", 64, tokens, choice, "r", "reference", TIMES, {}, {},
                 guarded=guarded)


def _schema_table(entries) -> DispatchTable:
    return DispatchTable(VERSIONS, FP, tuple(entries), {"margin": 0.03}, "2026-01-01T00:00:00+00:00")


def test_schema_2_round_trip_keeps_guarded(tmp_path):
    table = _schema_table([_schema_entry(1, True), _schema_entry(2, False)])
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
    raw = json.loads(_schema_table([_schema_entry(1, True)]).to_json())
    edit(raw)
    raw["digest"] = canonical_digest({k: v for k, v in raw.items() if k != "digest"})
    with pytest.raises(ValueError, match="malformed field") as info:
        parse(json.dumps(raw))
    assert reason in str(info.value)


def test_a_later_schema_is_stale(tmp_path):
    path = save(DispatchTable(VERSIONS, FP, (_schema_entry(1, False),), {}, "", schema=3), tmp_path / "t.json")
    table, why = load(path, FP, VERSIONS)
    assert table is None and "stale: schema 3, this tpfuse reads schema 2" in why


def test_save_merged_keeps_other_buckets_replaces_same_ones_or_starts_fresh(tmp_path):
    path = table_path(FP, tmp_path)
    measured = _schema_table([_schema_entry(2, True, "oneshot")])
    assert save_merged(measured, path).table == measured  # nothing saved yet
    save(_schema_table([_schema_entry(1, False), _schema_entry(2, False)]), path)
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


# ---- saving -------------------------------------------------------------------------------------

def test_check_writable_and_save_leave_nothing_behind(tmp_path):
    table = _two_bucket_table({"world_size": 2}, {"tpfuse": "0", "torch": "0", "driver": None, "cuda": None})
    assert check_writable(tmp_path / "new" / "dir") == tmp_path / "new" / "dir"
    assert os.listdir(tmp_path / "new" / "dir") == []
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / "new" / "dir" / f".t.json.{int(dead.stdout)}.0badc0de.tmp"  # a save killed mid-write
    orphan.write_text('{"kind": "tpfuse-dispatch-ta')
    alive = tmp_path / "new" / "dir" / f".t.json.{os.getpid()}.12345678.tmp"  # a save in progress right now
    alive.write_text("{")
    path = save(table, tmp_path / "new" / "dir" / "t.json")
    assert sorted(os.listdir(path.parent)) == [alive.name, "t.json"] and path.read_text() == table.to_json()
    alive.unlink()
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(CacheDirError, match="cannot write the dispatch table in .*a-file.*--cache-dir DIR"):
        save(table, tmp_path / "a-file" / "t.json")
    target = tmp_path / "is-a-dir.json"
    target.mkdir()
    with pytest.raises(CacheDirError, match="Is a directory"):
        save(table, target)
    assert sorted(os.listdir(tmp_path)) == ["a-file", "is-a-dir.json", "new"]
