"""`tpfuse tune` under faults: a killed parent takes its ranks with it and writes no table; a cache
directory that cannot be written is a usage error (exit 2, the fix named) before anything is measured."""

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from dispatch.test_table_faults import _table
from tpfuse.cli.main import main
from tpfuse.dispatch.table import CacheDirError, check_writable, save
from tpfuse.spawn import failure_grace_s

TESTS = os.path.dirname(os.path.dirname(__file__))
SRC = os.path.join(os.path.dirname(TESTS), "src")


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


@pytest.mark.slow
@pytest.mark.parametrize("target,sig", [("parent", signal.SIGKILL), ("parent", signal.SIGTERM),
                                        ("parent", signal.SIGINT), ("rank", signal.SIGKILL)],
                         ids=["parent-SIGKILL", "parent-SIGTERM", "parent-SIGINT", "rank-SIGKILL"])
@pytest.mark.gloo
def test_a_killed_tune_takes_every_rank_with_it_and_writes_no_table(tmp_path, target, sig):
    cache, pids = tmp_path / "cache", tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS]), "TPFUSE_TEST_PID_DIR": str(pids),
           "TPFUSE_STRATEGIES": "pid_then_block=support.blocking_strategy:PidThenBlock", "TPFUSE_TIMEOUT_S": "2"}
    parent = subprocess.Popen(
        [sys.executable, "-m", "tpfuse.cli", "tune", "--hidden", "16", "--max-tokens", "1", "--op", "all_reduce",
         "--strategies", "reference,pid_then_block", "--world-size", "2", "--cache-dir", str(cache), "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


def test_check_writable_and_save_leave_nothing_behind(tmp_path):
    table = _table({"world_size": 2}, {"tpfuse": "0", "torch": "0", "driver": None, "cuda": None})
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

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS])}
    runs = [subprocess.Popen([sys.executable, "-m", "tpfuse.cli", *QUICK, "--hidden", str(h), "--max-tokens", "2",
                              "--cache-dir", str(tmp_path), "--json"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for h in (16, 32)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    (path,) = {json.loads(out)["path"] for out, _ in outputs}
    table = json.loads(open(path).read())
    assert sorted((e["hidden"], e["tokens"]) for e in table["entries"]) == [(16, 1), (16, 2), (32, 1), (32, 2)]
