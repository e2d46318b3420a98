"""`tpfuse.spawn.run_ranks` under faults: a rank the kernel's OOM killer ended is named so, with its
last resident size; a plain SIGKILL is not; survivors get longer than the host strategies' peer bound
to report before they are killed; and a killed parent leaves no "leaked semaphore" warning behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tpfuse import spawn
from tpfuse.env import HOST_DEFAULT_TIMEOUT_S
from tpfuse.spawn import RankFailure, failure_grace_s, run_ranks
from tpfuse.strategies.host_wait import CENSUS_S

pytestmark = pytest.mark.gloo

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _hold_then_die(rank, world_size, megabytes):
    import torch

    if rank == 1:
        held = torch.ones(megabytes * 2**18)  # float32: megabytes MiB, touched
        time.sleep(1.5)  # the parent samples resident sizes every half second
        os.kill(os.getpid(), signal.SIGKILL)
        return float(held[0])
    return rank


def _counters(rises: bool):
    calls = []

    def oom_kills():
        calls.append(1)
        return {"/proc/vmstat oom_kill": 3 + (len(calls) > 1 and rises)}
    return oom_kills


@pytest.mark.parametrize("rises", [True, False], ids=["oom-counter-rose", "plain-sigkill"])
def test_a_sigkilled_rank_is_named_an_oom_kill_only_when_the_kernel_counted_one(monkeypatch, rises):
    monkeypatch.setattr(spawn, "oom_kills", _counters(rises))
    with pytest.raises(RankFailure) as info:
        run_ranks(_hold_then_die, 2, args=(64,), timeout_s=120)
    (why,) = info.value.failures.values()
    assert list(info.value.failures) == [1] and info.value.results == {0: 0}
    if rises:
        assert why.startswith("process killed by the kernel's out-of-memory killer (SIGKILL; "
                              "/proc/vmstat oom_kill rose by 1) holding "), why
        assert "resident when last seen" in why and "available now; give each rank less to hold" in why
    else:
        assert why.startswith("process killed by SIGKILL (exit code -9) before reporting"), why
        assert "out-of-memory" not in why


def test_the_failure_grace_outlasts_the_host_strategies_bound_and_census(monkeypatch):
    monkeypatch.delenv("TPFUSE_TIMEOUT_S", raising=False)
    assert failure_grace_s({}) > HOST_DEFAULT_TIMEOUT_S + CENSUS_S
    assert failure_grace_s({"TPFUSE_TIMEOUT_S": "2"}) > 2 + CENSUS_S
    with pytest.raises(ValueError, match="TPFUSE_TIMEOUT_S='nan'"):
        failure_grace_s({"TPFUSE_TIMEOUT_S": "nan"})


def _late_survivor(rank, world_size, delay_s):
    if rank == 0:
        raise RuntimeError("rank 0 fails first")
    time.sleep(delay_s)
    raise RuntimeError("rank 1 reports its own error late")


@pytest.mark.slow
def test_a_survivor_reporting_after_ten_seconds_is_heard_not_killed(monkeypatch):
    """The grace used to be 10 s, shorter than the host strategies' 30 s bound: survivors waiting
    on a dead peer were killed before they could say which peer it was."""
    monkeypatch.delenv("TPFUSE_TIMEOUT_S", raising=False)
    with pytest.raises(RankFailure) as info:
        run_ranks(_late_survivor, 2, args=(12.0,), timeout_s=120)
    assert "rank 0 fails first" in info.value.failures[0]
    assert "rank 1 reports its own error late" in info.value.failures[1], info.value.failures[1]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_parent_leaves_no_leaked_semaphore_warning(tmp_path, sig):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        from tpfuse.spawn import run_ranks

        def wait(rank, world_size):
            open(os.path.join({str(tmp_path)!r}, f"{{rank}}.up"), "w").close()
            time.sleep(60)

        if __name__ == "__main__":
            run_ranks(wait, 2, timeout_s=120)
    """))
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    parent = subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"{r}.up").exists() for r in range(2)):
            assert parent.poll() is None and time.monotonic() < deadline, parent.communicate()
            time.sleep(0.1)
        parent.send_signal(sig)
        _, err = parent.communicate(timeout=30)
        time.sleep(2)  # the resource tracker, if any, warns after the parent is gone
    finally:
        if parent.poll() is None:
            parent.kill()
    assert "leaked semaphore" not in err, err
