"""The two-shot kernel (`tpfuse.kernels.twoshot`) against the reference: chunk owners (fewer
tokens than ranks) and whole-row owners (at least one token a rank), in the interpreter (spawned
ranks) and on one GPU with W ranks as W streams (see tests/kernels/test_oneshot.py for the tiers).
"""

import pytest
import torch

from support.peer import EmulatedRanks, check_calls, check_outputs, check_split, check_split_quant

CALLS = [(3, "int", "res"), (5, "rand", "res"), (1, "int", "none"), (4, "int", "ar"), (2, "rand", "res"),
         (7, "int", "res"), (1, "rand", "ar")]


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("owns_rows", [None, True])
def test_two_ranks_back_to_back_calls(owns_rows):
    """The rule's cut (chunk owners at these sizes), then whole-row owners forced for every call
    (the one-token calls keep chunk owners: a cut of whole rows needs a row a rank)."""
    calls = CALLS if owns_rows is None else [c for c in CALLS if c[0] >= 2]
    check_calls("twoshot", 2, torch.bfloat16, 64, calls, owns_rows=owns_rows)


@pytest.mark.interpreter
@pytest.mark.slow
def test_four_ranks():
    check_calls("twoshot", 4, torch.float16, 32, [(5, "int", "res"), (2, "rand", "res"), (9, "int", "ar"),
                                                   (3, "int", "res")])


@pytest.mark.interpreter
@pytest.mark.slow
def test_rows_split_over_chunks_match_the_reference():
    check_split("twoshot", 40, 16)


@pytest.mark.interpreter
@pytest.mark.slow
def test_split_rows_quantized_in_the_kernel_equal_the_reference():
    check_split_quant("twoshot")


@pytest.mark.parametrize("world, spin", [(8, 2), (8, 4), (2, 4)])
def test_chunk_owner_kernel_lowers_and_assembles_for_sm90(world, spin):
    """The plain tier of two-shot's GPU build (chunk owners) for sm_90: with spin 4 an owner's
    reduce reloads every other source's 16-byte vector and tag together (one predicated load per
    source, 8 consecutive elements a thread); ptxas takes the whole kernel."""
    import re

    from support.ptx import PEER_ALIGNED, assemble, assert_poll_vectorised, lower_to_ptx, peer_kernel_signature
    from tpfuse.kernels.peer_stages import PeerConfig, QuantOpts
    from tpfuse.kernels.twoshot import twoshot_kernel

    C = PeerConfig.of(world=world, world_p2=world, chunk=1024, num_chunks=6, num_chunks_p2=8, sentinel=-(1 << 15),
                      elem_bits=16, has_res=True, has_norm=True, split=True, use_asm=True, soft_bf16=False, pdl=1,
                      spin=spin, single=False, rows_owned=False, per_poll=1, per_push=1)
    sig, constexprs = peer_kernel_signature(world), {"C": C, "Q": QuantOpts.of()}
    ptx = lower_to_ptx(twoshot_kernel, sig, constexprs, PEER_ALIGNED, cc=90)
    vector_polls = re.findall(r"@n(\d+) ld\.volatile\.global\.v4\.b32", ptx)
    assert sorted(map(int, vector_polls)) == (list(range(world)) if spin >= 4 else []), vector_polls
    if spin >= 4:
        assert_poll_vectorised(lower_to_ptx(twoshot_kernel, sig, constexprs, PEER_ALIGNED, cc=90, stage="ttgir"))
    assert "st.relaxed.sys.global.v4.b32" in ptx
    assemble(ptx)


GPU_CALLS = [(1, "int", "res"), (16, "int", "res"), (3, "rand", "res"), (64, "rand", "res"), (9, "int", "none"),
             (8, "int", "ar"), (1, "rand", "res")]


@pytest.mark.gpu
@pytest.mark.parametrize("world, owns_rows, pdl, spin", [(8, None, 1, 2), (8, True, 2, 1), (8, False, 0, 0),
                                                         (8, False, 1, 4), (8, None, 2, 4), (2, None, 2, 2),
                                                         (2, True, 1, 0), (3, False, 1, 4)])
def test_both_cuts_and_launch_options_give_the_reference_bits(world, owns_rows, pdl, spin):
    """None: the rule (whole rows from one token a rank); True / False force one cut for every call
    that allows it (whole rows need at least one row a rank)."""
    from tpfuse.kernels.peer_launch import LaunchOptions

    calls = [c for c in GPU_CALLS if owns_rows is not True or c[0] >= world]
    ranks = EmulatedRanks("twoshot", world, 6144, torch.bfloat16, 64, options=LaunchOptions(pdl=pdl, spin=spin),
                          owns_rows=owns_rows)
    outs = [ranks.call(m, kind, mode, i) for i, (m, kind, mode) in enumerate(calls)]
    check_outputs(f"twoshot rows={owns_rows} pdl={pdl}", [[o[r] for o in outs] for r in range(world)], world,
                  torch.bfloat16, 6144, calls)
    for ws in ranks.ws:
        ws.check()
