"""The waiting and signalling primitives (`tpfuse.kernels.sync`): the failure record and the abort
broadcast driven directly by a small kernel (interpreter and GPU), and on one GPU through the
peer kernels with W ranks as W streams: a rank that never calls (the pending-ranks mask names it,
and only ranks of the group), ranks whose call counts differ by two (the epoch tags: an error, not
mixed calls), and the host-mapped error words (the next eager call raises without a copy kernel).
"""

import pytest
import torch

from support.peer import INTERP, EmulatedRanks
from tpfuse.kernels.protocol import ERR_ABORTED, ERR_EPOCH, ERR_STALL, ERR_TIMEOUT
from tpfuse.spawn import run_ranks


def _config(world, use_asm, spin=0):
    """The compile-time facts of a one-item bf16 peer kernel of `world` ranks (`PeerConfig`)."""
    import triton

    from tpfuse.kernels.peer_stages import PeerConfig

    return PeerConfig.of(world=world, world_p2=triton.next_power_of_2(world), chunk=256, num_chunks=1,
                         num_chunks_p2=1, sentinel=-(1 << 15), elem_bits=16, has_res=True, has_norm=True, split=False,
                         use_asm=use_asm, soft_bf16=not use_asm, pdl=0, spin=spin, single=True, rows_owned=False,
                         per_poll=1, per_push=1)


def _record(world, rank, ranks, epoch_ranks, what, abort_from, device):
    """Run `fail` or `stall` in one program of a test kernel over W one-word buffers; returns
    (err words, errmap words, every buffer's abort word)."""
    from support.record_kernel import record_kernel
    from tpfuse.kernels.device import interpreting

    C = _config(world, use_asm=not interpreting())
    bufs = tuple(torch.zeros(64, dtype=torch.bfloat16, device=device) for _ in range(world))
    if abort_from is not None:
        bufs[rank].view(torch.int32)[0] = abort_from + 1
    err = torch.zeros(4, dtype=torch.int32, device=device)
    errmap = torch.zeros(4, dtype=torch.int32, device=device)
    record_kernel[(1,)](err, errmap, bufs, rank, ranks, epoch_ranks, STALL=what == "stall", C=C)
    return err.tolist(), errmap.tolist(), [int(b.view(torch.int32)[0]) for b in bufs]


CASES = [  # (world, rank, ranks, epoch_ranks, what, abort word of this rank (None: 0)) -> err code, mask, aborts
    ((8, 0, 0xFEFEFEFF, 0, "fail", None), (ERR_TIMEOUT, 0xFE, [1] * 8)),  # bits outside the group never land
    ((8, 1, 1 << 7, 1 << 7, "fail", None), (ERR_EPOCH, 1 << 7, [2] * 8)),
    ((4, 1, 0b1101, 0b0100, "fail", None), (ERR_TIMEOUT, 0b1101, [2] * 4)),  # not every source foreign: a timeout
    ((4, 1, 0b0001, 0, "fail", 2), (ERR_ABORTED, 0b0100, [0, 3, 0, 0])),  # rank 2 gave up first: no broadcast
    ((4, 1, 0, 0, "stall", None), (ERR_STALL, 0, [2] * 4)),  # a stall tells every rank, as a timeout does
    ((2, 1, 0, 0, "stall", 0), (ERR_ABORTED, 0b01, [0, 1])),
]


def _record_rank(rank_, world_size, cases):
    return [_record(*case, device="cpu") for case, _ in cases]


def _check_record(case, want, got):
    err, errmap, aborts = got
    code, mask, want_aborts = want
    assert err[0] == code and err[1] == mask, (case, err)
    assert errmap[0] == code and errmap[1] == mask, (case, errmap)  # the host-mapped mirror says the same
    assert err[2:] == [5, 9] and errmap[2:] == [5, 9], (case, err)
    assert aborts == want_aborts, (case, aborts)


@pytest.mark.interpreter
def test_fail_and_stall_records_and_broadcasts_in_the_interpreter():
    (results,) = run_ranks(_record_rank, 1, args=(CASES,), env=INTERP, timeout_s=120)
    for (case, want), got in zip(CASES, results):
        _check_record(case, want, got)


@pytest.mark.gpu
def test_fail_and_stall_records_and_broadcasts_on_the_gpu():
    for case, want in CASES:
        _check_record(case, want, _record(*case, device="cuda"))


# ---- the wait on every source's tag at once (spin 3; inline assembly, GPU builds) -------------

TAGS_SIG = {"tag_ptr": "*i32", "abort_ptr": "*i32", "out_ptr": "*i32", "tag_words": "i32", "rank": "i32",
            "want": "i32", "timeout_ns": "i64", "dead": "i32", "C": "constexpr"}


@pytest.mark.parametrize("world", [2, 8])
def test_tag_wait_lowers_to_one_reload_of_every_tag_and_assembles(world):
    """Plain tier (CPU): the wait compiles for sm_90; every retry reloads the W - 1 other tags and
    the abort word (a predicated load per source, the own one never issued), and ptxas takes it."""
    import re

    from support.ptx import assemble, lower_to_ptx
    from support.tags_kernel import wait_tags_kernel

    ptx = lower_to_ptx(wait_tags_kernel, TAGS_SIG, {"C": _config(world, use_asm=True, spin=3)}, cc=90)
    loads = re.findall(r"@m(\d+) ld\.volatile\.global\.b32", ptx)
    assert sorted(map(int, loads)) == list(range(world)), loads
    assert "ld.volatile.global.b32 ab" in ptx and "%globaltimer" in ptx
    assemble(ptx)


def _wait_tags(world, rank, tags_of, want, timeout_s, dead=0, abort=0, programs=4):
    """Run the tag wait in `programs` programs over tags `tags_of(src)` (5 words apart, the own
    rank's garbage); returns [(ok, microseconds waited)] per program."""
    from support.tags_kernel import wait_tags_kernel

    stride = 5
    tags = torch.full((world * stride,), -7, dtype=torch.int32, device="cuda")
    for src in range(world):
        tags[src * stride] = tags_of(src) if src != rank else -1
    abort_word = torch.tensor([abort], dtype=torch.int32, device="cuda")
    out = torch.full((2 * programs,), -5, dtype=torch.int32, device="cuda")
    wait_tags_kernel[(programs,)](tags, abort_word, out, stride, rank, want, int(timeout_s * 1e9), dead,
                                  C=_config(world, use_asm=True, spin=3))
    return [tuple(pair) for pair in out.view(programs, 2).tolist()]


@pytest.mark.gpu
def test_tag_wait_ends_on_arrival_deadline_abort_or_dead():
    want = 41
    assert all(ok == 1 for ok, _ in _wait_tags(8, 3, lambda s: want, want, 5.0))  # the own tag is never read
    assert all(ok == 1 for ok, _ in _wait_tags(1, 0, lambda s: want, want, 5.0))  # no other source
    late = _wait_tags(8, 3, lambda s: want - 2 if s == 6 else want, want, 0.002)  # a foreign tag never matches
    assert all(ok == 0 and us >= 2000 for ok, us in late), late
    aborted = _wait_tags(4, 0, lambda s: 0, want, 5.0, abort=2)  # a rank gave up: no wait for the deadline
    assert all(ok == 0 and us < 2_500_000 for ok, us in aborted), aborted
    dead = _wait_tags(4, 0, lambda s: 0, want, 5.0, dead=1)
    assert all(ok == 0 and us < 2_500_000 for ok, us in dead), dead


# ---- through the peer kernels, W ranks as streams on one GPU ------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name, spin", [("oneshot", 2), ("oneshot", 3), ("oneshot", 4), ("oneshot", 0), ("twoshot", 2)])
def test_absent_rank_is_named_alone_and_only_ranks_of_the_group(name, spin):
    """W = 8, rank 7 never calls: every survivor records ERR_TIMEOUT naming rank 7 (one-shot waits
    on it directly; two-shot may also name an owner that gave up) or ERR_ABORTED naming a survivor
    that timed out; no mask has a bit outside ranks 0..7 or its own."""
    from tpfuse.kernels.peer_launch import LaunchOptions
    from tpfuse.strategies.workspace import PeerTimeoutError

    world = 8
    ranks = EmulatedRanks(name, world, 6144, torch.bfloat16, 4, options=LaunchOptions(pdl=0, spin=spin),
                          timeout_s=0.5)
    outs = ranks.call(1, "int", "res", 0, ranks=range(world - 1))
    timed_out = set()
    for rank, ws in enumerate(ranks.ws[: world - 1]):
        code, mask = ws.err.tolist()[:2]
        assert mask & ~((1 << world) - 1) == 0 and not mask >> rank & 1, (rank, hex(mask))
        if code == ERR_TIMEOUT:
            timed_out.add(rank)
            assert mask >> 7 & 1 and (name != "oneshot" or mask == 1 << 7), (rank, hex(mask))
        else:
            assert code == ERR_ABORTED and mask and all(mask >> r & 1 == 0 for r in (7,)), (rank, code, hex(mask))
        assert torch.isnan(outs[rank][0]).all()
        with pytest.raises(PeerTimeoutError):  # the mapped words: the next eager call raises at once
            ws.before_call()
    assert timed_out


@pytest.mark.gpu
@pytest.mark.parametrize("name, spin", [("oneshot", 2), ("oneshot", 3), ("oneshot", 4), ("twoshot", 2)])
def test_call_counts_two_apart_raise_instead_of_mixing_calls(name, spin):
    """Rank 1's epoch words two calls ahead (same slot, other call): its data carries that count,
    so a rank sees data present under a foreign tag and records ERR_EPOCH (the others: that rank's
    abort, or their own timeout where a wait of theirs ended first); nobody returns a sum."""
    from tpfuse.kernels.peer_launch import LaunchOptions

    ranks = EmulatedRanks(name, 2, 1024, torch.bfloat16, 4, options=LaunchOptions(pdl=0, spin=spin),
                          timeout_s=0.5)
    ranks.call(2, "int", "res", 0)  # one good call first
    ranks.ws[1].state += 2
    outs = ranks.call(2, "int", "res", 1)
    codes = [ws.err.tolist()[0] for ws in ranks.ws]
    # one-shot: the foreign tag is on the data each rank waits for; two-shot: a receiver's own wait
    # may end first, so any failure code will do, as long as nobody returns a sum
    assert set(codes) <= {ERR_EPOCH, ERR_ABORTED, ERR_TIMEOUT} and (name == "twoshot" or ERR_EPOCH in codes), codes
    assert all(code != 0 for code in codes), codes
    for got in outs:
        assert torch.isnan(got[0]).all()


def _epoch_rank(rank, world_size, name):
    import torch.distributed as dist

    from support.peer import cpu_strategy
    from tpfuse.strategies.workspace import PeerTimeoutError

    strategy = cpu_strategy(name, rank, world_size, timeout_s=0.3, max_programs=1)
    strategy.prepare(hidden=32, dtype=torch.float32, max_tokens=2)
    x = torch.ones(2, 32)
    strategy.all_reduce(x)
    if rank == 1:
        strategy._workspaces[torch.float32].state += 2
    y = strategy.all_reduce(x)
    try:
        strategy.check()
        outcome = ("no error", y.tolist())
    except PeerTimeoutError as exc:
        outcome = (exc.code, bool(torch.isnan(y).all()))
    dist.barrier()
    strategy.close()
    return outcome


@pytest.mark.interpreter
@pytest.mark.slow
def test_call_counts_two_apart_raise_in_the_interpreter():
    results = run_ranks(_epoch_rank, 2, args=("oneshot",), env=INTERP, timeout_s=120)
    assert any(code == ERR_EPOCH for code, _ in results), results
    assert all(code in (ERR_EPOCH, ERR_ABORTED) and nan for code, nan in results), results
