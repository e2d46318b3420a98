"""`fusegate tune` under faults: a killed parent takes its ranks with it and writes no table; a cache
directory that cannot be written is a usage error (exit 2, the fix named) before anything is measured."""

import os
import signal
import subprocess
import sys
import time

import pytest

from fusegate.cli.main import main
from fusegate.tune.table import CacheDirError, check_writable, save

from test_table_faults import _table

HERE = os.path.dirname(__file__)
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")


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
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killing_tune_kills_its_ranks_and_writes_no_table(tmp_path, sig):
    cache, pids = tmp_path / "cache", tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, HERE]), "FUSEGATE_TEST_PID_DIR": str(pids),
           "FUSEGATE_STRATEGIES": "pid_then_block=blocking_strategy:PidThenBlock"}
    parent = subprocess.Popen(
        [sys.executable, "-m", "fusegate.cli", "tune", "--hidden", "16", "--max-tokens", "1", "--op", "all_reduce",
         "--strategies", "reference,pid_then_block", "--world-size", "2", "--cache-dir", str(cache), "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len([p for p in os.listdir(pids) if p.isdigit()]) < 2:
            assert parent.poll() is None, parent.communicate()
            assert time.monotonic() < deadline, "the ranks never reached the measurement"
            time.sleep(0.1)
        ranks = [int(p) for p in os.listdir(pids) if p.isdigit()]
        assert all(_alive(pid) for pid in ranks)
        parent.send_signal(sig)
        parent.wait(timeout=30)
        # Bound: the kernel delivers the parent-death signal at once; 5 s covers a loaded machine.
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in ranks if _alive(pid)], "ranks outlived their parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in [int(p) for p in os.listdir(pids) if p.isdigit()]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not cache.exists() or sorted(os.listdir(cache)) == []  # no table, no temporary file


def _unwritable_dirs(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    yield "under a file", blocker / "cache"
    if os.geteuid() != 0:  # root writes through permission bits, so only a non-root run tests them
        ro = tmp_path / "read-only"
        ro.mkdir(mode=0o555)
        yield "read-only", ro


def test_an_unwritable_cache_dir_is_exit_2_before_measuring(tmp_path, capsys):
    for name, where in _unwritable_dirs(tmp_path):
        start = time.monotonic()
        rc = main(["tune", "--hidden", "16", "--max-tokens", "1", "--world-size", "2", "--cache-dir", str(where), "--json"])
        elapsed = time.monotonic() - start
        err = capsys.readouterr().err
        assert rc == 2, (name, err)
        assert f"fusegate tune: cannot write the dispatch table in {where}" in err, err
        assert "pass --cache-dir DIR (or set FUSEGATE_CACHE_DIR) to a writable directory, or --no-save" in err
        assert "Traceback" not in err
        assert elapsed < 5, f"{name}: {elapsed:.1f} s: ranks were spawned before the check"


def test_check_writable_and_save_leave_nothing_behind(tmp_path):
    table = _table({"world_size": 2}, {"fusegate": "0", "torch": "0", "driver": None, "cuda": None})
    assert check_writable(tmp_path / "new" / "dir") == tmp_path / "new" / "dir"
    assert os.listdir(tmp_path / "new" / "dir") == []
    path = save(table, tmp_path / "new" / "dir" / "t.json")
    assert os.listdir(path.parent) == ["t.json"] and path.read_text() == table.to_json()
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(CacheDirError, match="cannot write the dispatch table in .*a-file.*--cache-dir DIR"):
        save(table, tmp_path / "a-file" / "t.json")
    target = tmp_path / "is-a-dir.json"
    target.mkdir()
    with pytest.raises(CacheDirError, match="Is a directory"):
        save(table, target)
    assert sorted(os.listdir(tmp_path)) == ["a-file", "is-a-dir.json", "new"]
