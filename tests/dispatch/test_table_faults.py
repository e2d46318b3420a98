"""Dispatch tables that cannot be used: each is ignored with the reason, never raised, on every rank
alike (the gloo side is in test_agree_gloo.py). Typed validation at load: a wrong-typed field is refused even when the digest was recomputed
to match (the file then passes every other check), and bytes that are not UTF-8 are a reason too."""

import json
import os

import pytest

from tpfuse.dispatch.table import (
    MAX_TABLE_BYTES,
    DispatchTable,
    Entry,
    canonical_digest,
    fingerprint,
    load,
    save,
    versions_of,
)
from tpfuse.probe import probe
from tpfuse.spec import GroupFacts


@pytest.fixture(scope="module")
def here():
    caps = probe()
    facts = GroupFacts(world_size=2, backend="gloo", device_type="cpu", devices=("cpu", "cpu"))
    return fingerprint(facts, caps), versions_of(caps)


def _table(fp, versions) -> DispatchTable:
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
    ("median", _set("entries.0.times_us.ring.median", "fast"), "entries[0].times_us.ring.median: expected a finite number"),
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
    path = save(_table(*here), tmp_path / "t.json")
    path.write_text(_resigned(edit(json.loads(path.read_text()))))
    table, why = load(path, *here)
    assert table is None, name
    assert why.startswith(f"corrupt dispatch table {path}: malformed field: ") and reason in why, why


def test_a_valid_table_still_loads(here, tmp_path):
    table = _table(*here)
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
    path = save(_table(*here), tmp_path / "t.json")
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
        raw = json.loads(_table(*here).to_json())
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
