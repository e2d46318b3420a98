"""Construction agrees across ranks or fails on every rank alike (3 gloo ranks, one spawn).

- Dispatch tables: rank 0 holds a valid table, rank 1 one with a non-UTF-8 byte, rank 2 one with
  a wrong-typed field and a recomputed digest; then a rank whose load raises outright. Every rank
  ends with no table, the same note naming each rank's reason, and calls that still work.
- Settings: TPFUSE_DEBUG on one rank only, debug=True on one rank only, a bad TPFUSE_DEBUG
  or TPFUSE_TIMEOUT_S value on one rank, different strategies: each raises ValueError on every rank, naming the ranks,
  and leaves the group usable; with debug on every rank, calls run and a shape mismatch is named.
"""

import json
import os

import pytest
import torch

from tpfuse.reference import all_reduce_ref, small_integer_inputs
from tpfuse.spawn import run_ranks

from .test_table import _resigned, _set, _two_bucket_table

pytestmark = pytest.mark.gloo

H = 16
WORLD_SIZE = 3


def _outcome(make):
    try:
        comm = make()
    except ValueError as exc:
        return f"ValueError: {exc}"
    comm.close()
    return "constructed"


def _tables(rank, root):
    import torch.distributed as dist

    from tpfuse import Communicator
    from tpfuse.dispatch import agree
    from tpfuse.dispatch.table import fingerprint, save, table_path, versions_of
    from tpfuse.group import agree_group_facts
    from tpfuse.probe import probe

    caps = probe()
    fp = fingerprint(agree_group_facts(dist.group.WORLD, caps), caps)
    os.environ["TPFUSE_CACHE_DIR"] = os.path.join(root, f"rank{rank}")
    path = save(_two_bucket_table(fp, versions_of(caps)), table_path(fp))
    if rank == 1:
        path.write_bytes(path.read_bytes().replace(b'"fastest"', b'"fast\xe9st"', 1))
    if rank == 2:
        path.write_text(_resigned(_set("entries.0.tokens", "8")(json.loads(path.read_text()))))
    x = small_integer_inputs(rank, 3, H, torch.float32)
    out = {}
    with Communicator() as comm:
        out["mixed"] = (comm.table is None, comm.table_note, comm.all_reduce(x))
    real_load = agree.load
    if rank == 1:
        def broken(*args):
            raise MemoryError("simulated")
        agree.load = broken
    with Communicator() as comm:
        out["raising"] = (comm.table is None, comm.table_note, comm.all_reduce(x))
    agree.load = real_load
    return out


def _settings(rank):
    from tpfuse import Communicator

    out = {}
    os.environ["TPFUSE_DEBUG"] = "1" if rank == 1 else "0"
    out["env_on_one_rank"] = _outcome(Communicator)
    os.environ.pop("TPFUSE_DEBUG")
    out["arg_on_one_rank"] = _outcome(lambda: Communicator(debug=True if rank == 0 else None))
    os.environ["TPFUSE_DEBUG"] = "yes" if rank == 2 else "1"
    out["bad_value_on_one_rank"] = _outcome(Communicator)
    os.environ.pop("TPFUSE_DEBUG")
    os.environ["TPFUSE_TIMEOUT_S"] = "soon" if rank == 0 else "5"
    out["bad_timeout_on_one_rank"] = _outcome(Communicator)
    os.environ.pop("TPFUSE_TIMEOUT_S")
    out["strategies"] = _outcome(lambda: Communicator(strategy="ring" if rank == 0 else "reference"))
    os.environ["TPFUSE_DEBUG"] = "1"
    with Communicator() as comm:  # debug on every rank: calls run, then a mismatch is an error
        x = small_integer_inputs(rank, 3, H, torch.float32)
        out["debug_sum"] = comm.all_reduce(x)
        try:
            comm.all_reduce(small_integer_inputs(rank, 3 + (rank == 2), H, torch.float32))
            out["debug_mismatch"] = "no error"
        except ValueError as exc:
            out["debug_mismatch"] = str(exc)
    return out


def _agreement_rank(rank, world_size, root):
    return {**_tables(rank, root), **_settings(rank)}


@pytest.mark.slow
def test_ranks_agree_at_construction_or_all_fail_alike(tmp_path):
    results = run_ranks(_agreement_rank, WORLD_SIZE, args=(str(tmp_path),), timeout_s=150)
    want = all_reduce_ref([small_integer_inputs(r, 3, H, torch.float32) for r in range(WORLD_SIZE)])

    for case in ("mixed", "raising"):
        assert len({r[case][1] for r in results}) == 1, case  # the same words on every rank
        for gone, _, got in (r[case] for r in results):
            assert gone and torch.equal(got, want), case
    note = results[0]["mixed"][1]
    assert "ranks hold different dispatch tables" in note
    assert "rank 1: none (corrupt dispatch table" in note and "not UTF-8 text" in note
    assert "rank 2: none (corrupt dispatch table" in note and "entries[0].tokens" in note
    assert "rank 1: none (could not load the dispatch table: MemoryError: simulated)" in results[0]["raising"][1]

    expect = {
        "env_on_one_rank": "ranks disagree on debug (ranks 0, 2: False; rank 1: True); set TPFUSE_DEBUG",
        "arg_on_one_rank": "ranks disagree on debug (rank 0: True; ranks 1, 2: False); set TPFUSE_DEBUG",
        "bad_value_on_one_rank": "Communicator: on rank 2: TPFUSE_DEBUG='yes': use 1 (on) or 0 (off)",
        "bad_timeout_on_one_rank": "Communicator: on rank 0: TPFUSE_TIMEOUT_S='soon': give a number of seconds",
        "strategies": "ranks disagree on strategy (rank 0: 'ring'; ranks 1, 2: 'reference'); pass the same strategy=",
    }
    for case, text in expect.items():
        messages = {r[case] for r in results}
        assert len(messages) == 1, (case, messages)  # raised on every rank, with the same words
        message = messages.pop()
        assert message.startswith("ValueError: Communicator: ") and text in message, (case, message)
    for r in results:
        assert torch.equal(r["debug_sum"], want)
        assert ("ranks disagree on the call" in r["debug_mismatch"]
                and "rank 2: all_reduce (4, 16)" in r["debug_mismatch"])
