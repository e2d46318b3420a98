"""`tpfuse tune` end to end on spawned gloo ranks: the table it writes, what a second run reports,
its summary, its usage errors, and its faults.

A second `tune` reports only what it measured: result rows and the printed table hold this run's
buckets, never the cached rows of an earlier run stamped anew; the saved table keeps both. The
summary tells the reasons of the buckets the do-no-harm guard weighed from the entry's `guarded`
field (not from the words of its reason). Under faults: a killed parent takes its ranks with it and
writes no table; a cache directory that cannot be written is a usage error (exit 2, the fix named)
before anything is measured; a table tune cannot read is kept aside; a failed save loses nothing
measured; two tunes at once keep both runs' buckets.
"""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpfuse.cli.main import main
from tpfuse.cli.tune import _print_measured, _print_outcome
from tpfuse.dispatch.table import DispatchTable, Entry, load, versions_of
from tpfuse.probe import probe
from tpfuse.results import read_rows
from tpfuse.spawn import failure_grace_s

TESTS_DIR = str(Path(__file__).resolve().parents[1])
SRC = os.path.join(os.path.dirname(TESTS_DIR), "src")


@pytest.mark.slow
@pytest.mark.gloo
def test_tune_writes_a_table_that_loads(tmp_path, capsys):
    rc = main(["tune", "--hidden", "64", "--max-tokens", "2", "--world-size", "2",
               "--op", "all_reduce_residual_rmsnorm",
               "--rounds", "5", "--confirm-rounds", "5", "--cache-dir", str(tmp_path), "--json",
               "--results", str(tmp_path / "rows.jsonl")])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 2 and report["backend"] == "gloo" and report["device"] == "cpu"
    path = report["path"]
    assert os.path.dirname(path) == str(tmp_path)
    entries = report["table"]["entries"]
    assert [(e["hidden"], e["tokens"]) for e in entries] == [(64, 1), (64, 2)]
    for e in entries:
        assert {"reference", "ring"} <= set(e["times_us"]) and e["choice"] in e["times_us"]
    table, why = load(path, report["table"]["fingerprint"], versions_of(probe()))
    assert why == "" and table.digest == report["table"]["digest"]
    # Every timed median is also a result row (first pass and confirmation).
    rows = read_rows(tmp_path / "rows.jsonl")
    expected = {(e["tokens"], n, "first", t["median"]) for e in entries for n, t in e["times_us"].items()}
    expected |= {(e["tokens"], n, "confirm", t["median"]) for e in entries for n, t in e["confirmed_us"].items()}
    assert {(r["shape"]["tokens"], r["strategy"], r["extra"]["phase"], r["median"]) for r in rows} == expected
    assert all(r["unit"] == "us" and r["world_size"] == 2 and r["p20"] <= r["median"] <= r["p80"] for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["tune", "--max-tokens", "4"], "give --preset"),
    (["tune", "--hidden", "64", "--device", "cpu", "--shared-gpu"], "--shared-gpu needs --device cuda"),
    (["tune", "--hidden", "64", "--margin", "1.5"], "margin"),
    (["tune", "--hidden", "64", "--strategies", "reference,nope"], "unknown strategy nope in --strategies"),
])
def test_usage_errors_exit_2_and_say_the_fix(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# ---- a second run --------------------------------------------------------------------------------

BASE = ["tune", "--hidden", "64", "--world-size", "2", "--device", "cpu", "--op", "all_reduce_residual_rmsnorm",
        "--strategies", "reference,ring", "--rounds", "2", "--confirm-rounds", "2"]


@pytest.mark.gloo
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


# ---- the summary ---------------------------------------------------------------------------------

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


# ---- faults --------------------------------------------------------------------------------------

def _alive(pid: int) -> bool:
    """Running (a zombie left for a non-reaping init counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def _sigint_as_in_a_terminal() -> None:
    """SIGINT as a shell's foreground command gets it: a run of the tests in the background (`&` in a
    script, as CI may start them) passes SIGINT on ignored, and a process ignoring it never sees Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("target,sig", [("parent", signal.SIGKILL), ("parent", signal.SIGTERM),
                                        ("parent", signal.SIGINT), ("rank", signal.SIGKILL)],
                         ids=["parent-SIGKILL", "parent-SIGTERM", "parent-SIGINT", "rank-SIGKILL"])
@pytest.mark.gloo
def test_a_killed_tune_takes_every_rank_with_it_and_writes_no_table(tmp_path, target, sig):
    cache, pids = tmp_path / "cache", tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS_DIR]), "TPFUSE_TEST_PID_DIR": str(pids),
           "TPFUSE_STRATEGIES": "pid_then_block=support.blocking_strategy:PidThenBlock", "TPFUSE_TIMEOUT_S": "2"}
    parent = subprocess.Popen(
        [sys.executable, "-m", "tpfuse.cli", "tune", "--hidden", "16", "--max-tokens", "1", "--op", "all_reduce",
         "--strategies", "reference,pid_then_block", "--world-size", "2", "--cache-dir", str(cache), "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_sigint_as_in_a_terminal)
    try:
        deadline = time.monotonic() + 120
        while len([p for p in os.listdir(pids) if p.isdigit()]) < 2:
            assert parent.poll() is None, parent.communicate()
            assert time.monotonic() < deadline, "the ranks never reached the measurement"
            time.sleep(0.1)
        ranks = sorted(int(p) for p in os.listdir(pids) if p.isdigit())
        assert all(_alive(pid) for pid in ranks)
        if target == "parent" and sig == signal.SIGINT:  # Ctrl-C: the parent kills its ranks and says so
            parent.send_signal(sig)
            sent = time.monotonic()
            _, err = parent.communicate(timeout=30)
            # At once, not after the 5 s teardown grace of ranks that finished (1-2 s of exit on a loaded machine).
            assert time.monotonic() - sent < 4.0
            assert parent.returncode == 130 and err.strip().endswith("tpfuse tune: interrupted"), err
            bound = 1.0
        elif target == "parent":
            parent.send_signal(sig)
            parent.wait(timeout=30)
            bound = 5.0  # the kernel signals the ranks as the parent dies; 5 s covers a loaded machine
        else:
            os.kill(ranks[0], sig)
            killed = time.monotonic()
            # The survivor's next collective raises within TPFUSE_TIMEOUT_S and stops the tune; the
            # parent names both ranks well before the launcher's grace would have killed the survivor.
            _, err = parent.communicate(timeout=60)
            assert time.monotonic() - killed < failure_grace_s({"TPFUSE_TIMEOUT_S": "2"}), err
            assert parent.returncode == 2, err
            assert err.startswith("tpfuse tune: tuning on 2 gloo rank(s) failed"), err
            assert "killed by SIGKILL" in err and "PeerLostError: pid_then_block: rank " in err, err
            bound = 1.0
        deadline = time.monotonic() + bound
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in ranks if _alive(pid)], "ranks outlived the run"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in [int(p) for p in os.listdir(pids) if p.isdigit()]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not cache.exists() or sorted(os.listdir(cache)) == []  # no table, no temporary file


def _read_only_mount(tmp_path, monkeypatch):
    def erofs(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr("tpfuse.dispatch.table.tempfile.mkstemp", erofs)  # what a read-only mount answers
    return tmp_path, os.strerror(errno.EROFS)


def _under_a_file(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("not a directory")
    return tmp_path / "a-file" / "cache", os.strerror(errno.ENOTDIR)


def _read_only_dir(tmp_path, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("root writes through permission bits; run as a non-root user to test a mode 0555 directory")
    (tmp_path / "ro").mkdir(mode=0o555)
    return tmp_path / "ro", os.strerror(errno.EACCES)


@pytest.mark.parametrize("make", [_read_only_mount, _under_a_file, _read_only_dir],
                         ids=["read-only-mount", "under-a-file", "mode-0555"])
def test_an_unwritable_cache_dir_is_exit_2_before_measuring(tmp_path, monkeypatch, capsys, make):
    where, reason = make(tmp_path, monkeypatch)
    start = time.monotonic()
    rc = main(["tune", "--hidden", "16", "--max-tokens", "1", "--world-size", "2", "--cache-dir", str(where), "--json"])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith(f"tpfuse tune: cannot write the dispatch table in {where} ({reason}); "), err
    assert "pass --cache-dir DIR (or set TPFUSE_CACHE_DIR) to a writable directory, or --no-save" in err
    assert "Traceback" not in err
    assert elapsed < 5, f"{elapsed:.1f} s: ranks were spawned before the check"


QUICK = ["tune", "--op", "all_reduce", "--strategies", "reference", "--rounds", "2", "--confirm-rounds", "2",
         "--world-size", "2", "--device", "cpu"]


@pytest.mark.gloo
def test_a_table_tune_cannot_read_is_kept_aside_and_named_never_overwritten(tmp_path, capsys):
    import json

    cache = ["--cache-dir", str(tmp_path)]
    assert main([*QUICK, "--hidden", "16", "--max-tokens", "1", *cache, "--json"]) == 0
    path = json.loads(capsys.readouterr().out)["path"]
    newer = json.loads(open(path).read())
    newer["schema"] = 3  # what a later tpfuse might write under the same name
    with open(path, "w") as f:
        f.write(json.dumps(newer))
    assert main([*QUICK, "--hidden", "16", "--max-tokens", "2", *cache]) == 0
    out = capsys.readouterr().out
    kept = [p for p in os.listdir(tmp_path) if p.startswith(os.path.basename(path) + ".kept-")]
    assert len(kept) == 1 and json.loads((tmp_path / kept[0]).read_text()) == newer
    assert "could not be merged (ignoring dispatch table" in out and "stale: schema 3" in out
    assert f"was kept as {tmp_path / kept[0]}" in " ".join(out.split())


@pytest.mark.gloo
@pytest.mark.parametrize("as_json", [True, False], ids=["json", "table"])
def test_a_save_that_fails_loses_nothing_measured(tmp_path, capsys, monkeypatch, as_json):
    """A full disk at save time: the measured table is printed (in the one JSON object with --json)
    before the save, and a copy goes where one can still be written, named in the error."""
    import json

    from tpfuse.dispatch import table as table_module

    def disk_full(measured, path, *, fresh=False):
        raise table_module._cannot_write(path.parent, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))

    monkeypatch.setattr(table_module, "save_merged", disk_full)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "spare"))
    (tmp_path / "spare").mkdir()
    rc = main([*QUICK, "--hidden", "16", "--max-tokens", "2", "--cache-dir", str(tmp_path / "cache"),
               *(["--json"] if as_json else [])])
    captured = capsys.readouterr()
    assert rc == 2
    (copy,) = (tmp_path / "spare").iterdir()
    saved = json.loads(copy.read_text())
    assert sorted(e["tokens"] for e in saved["entries"]) == [1, 2]
    error = captured.err.strip().splitlines()[-1]
    assert error.startswith("tpfuse tune: cannot write the dispatch table in ") and os.strerror(errno.ENOSPC) in error
    assert error.endswith(f"a copy of the measured table is at {copy}")
    if as_json:
        doc = json.loads(captured.out)
        assert doc["exit_code"] == 2 and doc["copy"] == str(copy) and doc["table"] == saved
        assert sorted(e["tokens"] for e in doc["measured"]) == [1, 2]
    else:
        import re

        for tokens in (1, 2):  # this run's buckets, printed before the save was tried
            assert re.search(rf"all_reduce\s+│\s+16\s+│\s+{tokens}\s+│\s+reference", captured.out), captured.out
        assert "dispatch table not saved" in captured.out


@pytest.mark.slow
@pytest.mark.gloo
def test_two_tunes_at_once_keep_both_runs_buckets(tmp_path):
    import json

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS_DIR])}
    runs = [subprocess.Popen([sys.executable, "-m", "tpfuse.cli", *QUICK, "--hidden", str(h), "--max-tokens", "2",
                              "--cache-dir", str(tmp_path), "--json"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for h in (16, 32)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    (path,) = {json.loads(out)["path"] for out, _ in outputs}
    table = json.loads(open(path).read())
    assert sorted((e["hidden"], e["tokens"]) for e in table["entries"]) == [(16, 1), (16, 2), (32, 1), (32, 2)]
