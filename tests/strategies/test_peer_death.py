"""A peer killed with SIGKILL mid-run: every surviving rank's next call raises within the strategy's
own timeout (not the process group's 30-minute default), for `ring` as for `reference`.

Four ranks, rank 1 killed: ranks 0 and 2 (its neighbours) see a closed socket at once; rank 3 does
not: its neighbours are alive, they raised and stopped sending. Survivors stay alive until every
survivor has reported, so none is rescued by a neighbour's socket closing when it exits; rank 3
must fail on its own bound (the case that blocked for 30 minutes). Each strategy runs on its own
process group (same ranks), so one spawn checks both, and debug mode's own check before the call
(a third group) is bounded the same way.
"""

import json
import os
import signal
import time

import pytest
import torch

from tpfuse.reference import all_reduce_ref, small_integer_inputs
from tpfuse.spawn import RankFailure, run_ranks

pytestmark = pytest.mark.gloo

H = 16
WORLD_SIZE, VICTIM = 4, 1
# name -> (Communicator arguments, who raises): the debug check runs before the strategy's call.
CASES = {"ring": ({"strategy": "ring"}, "ring"), "reference": ({"strategy": "reference"}, "reference"),
         "debug": ({"strategy": "reference", "debug": True}, "Communicator")}
TIMEOUT_S = 2.0
# Bound on a survivor's time to raise: its own timeout plus scheduling slack on a loaded 2-core
# CI machine (the unbounded case waits 1800 s).
SLACK_S = 6.0


def _call(comm, x) -> tuple[str, float]:
    start = time.monotonic()
    try:
        comm.all_reduce(x)
        return "no error", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - the test records whatever the survivor raised
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start


def _survivor_rank(rank, world_size, out_dir):
    import torch.distributed as dist

    from tpfuse import Communicator

    comms = {name: Communicator(dist.new_group(list(range(world_size))), timeout_s=TIMEOUT_S, **kwargs)
             for name, (kwargs, _) in CASES.items()}
    x = small_integer_inputs(rank, 5, H, torch.float32)
    report = {name: {"good": comm.all_reduce(x).tolist()} for name, comm in comms.items()}  # every link is up
    if rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    for name, comm in comms.items():
        report[name]["first"], report[name]["elapsed"] = _call(comm, x)
        # Once broken, the strategy refuses at once instead of mixing late messages into a new call.
        report[name]["second"], _ = _call(comm, x)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(report, f)
    deadline = time.monotonic() + 60
    while len(os.listdir(out_dir)) < world_size - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return rank


@pytest.mark.slow
def test_every_survivor_fails_within_the_strategy_timeout(tmp_path):
    try:
        run_ranks(_survivor_rank, WORLD_SIZE, args=(str(tmp_path),), timeout_s=120)
        raise AssertionError("the killed rank was not reported")
    except RankFailure as exc:
        failure = exc
    assert list(failure.failures) == [VICTIM] and "SIGKILL" in failure.failures[VICTIM]
    assert sorted(failure.results) == [r for r in range(WORLD_SIZE) if r != VICTIM]
    want = all_reduce_ref([small_integer_inputs(r, 5, H, torch.float32) for r in range(WORLD_SIZE)])
    for rank in failure.results:
        report = json.loads((tmp_path / f"{rank}.json").read_text())
        for name, (_, where) in CASES.items():
            got = report[name]
            assert torch.equal(torch.tensor(got["good"]), want)
            assert got["first"].startswith(f"PeerLostError: {where}: rank {rank} "), (rank, got)
            assert "destroy the process group" in got["first"]
            assert got["elapsed"] < TIMEOUT_S + SLACK_S, (rank, got)
            assert got["second"].startswith(f"PeerLostError: {where}: rank {rank}: an earlier call failed"), (rank, got)
    # Rank 3 is not next to the dead rank: it can only have failed on its own bound.
    assert "without an answer" in json.loads((tmp_path / "3.json").read_text())["ring"]["first"]
