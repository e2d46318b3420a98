"""The peer protocol's work plan and region sizes: pure functions every rank must agree on."""

import pytest

from tpfuse.kernels.protocol import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    make_plan,
    plan_programs,
    region_elems_for,
)


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("hidden", [32, 100, 4096, 6144, 7168, 8192, 16384])
@pytest.mark.parametrize("tokens", [1, 3, 16, 64, 257])
@pytest.mark.parametrize("programs", [1, 16, 64, 128])
def test_plan_covers_every_element_once_with_whole_vectors(itemsize, hidden, tokens, programs):
    plan = make_plan(tokens, hidden, itemsize, programs)
    chunk_bytes = plan.chunk * itemsize
    assert MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES and plan.chunk & (plan.chunk - 1) == 0
    assert (plan.num_chunks - 1) * plan.chunk < hidden <= plan.num_chunks * plan.chunk  # no empty chunk
    assert plan.items == tokens * plan.num_chunks
    assert plan.num_warps * 32 * 16 == chunk_bytes  # one 16-byte vector per thread
    assert make_plan(tokens, hidden, itemsize, programs) == plan  # a pure function of its inputs


def test_small_calls_spread_a_row_over_programs():
    # 1 token of 6144 bf16 on 16 programs (8 ranks sharing one GPU): 6 chunks of 1024, not one program
    plan = make_plan(1, 6144, 2, plan_programs(8, True))
    assert plan_programs(8, True) == 16 and plan.split and plan.items == 6 and plan.chunk == 1024
    # large calls use the largest chunk (whole vectors per thread, fewest partials)
    assert make_plan(256, 6144, 2, 16).chunk == 2048
    assert plan_programs(8, False) == 128


def test_every_world_size_spreads_one_token_over_six_programs():
    # With every source polled at once, 6 chunks of 1024 were fastest at 1 token for W = 2, 4 and 8
    # and within 0.05 us of 3 of 2048 at W = 1 (the emulated sweep, peer_kernels_v3_chunks_emulated.jsonl)
    for world in (1, 2, 4, 8):
        for shares in (False, True):
            plan = make_plan(1, 6144, 2, plan_programs(world, shares))
            assert (plan.chunk, plan.items) == (1024, 6), (world, shares, plan)
    # more tokens than programs: the largest chunk
    assert make_plan(256, 6144, 2, 16).chunk == 2048


def test_twoshot_region_holds_one_owner_share():
    for tokens, hidden, world in ((1, 6144, 8), (1, 100, 2), (5, 96, 4), (64, 7168, 8)):
        plan = make_plan(tokens, hidden, 2, 16)
        need = region_elems_for(tokens, hidden, world, plan, twoshot=True)
        assert need >= tokens * hidden and need >= -(-plan.items // world) * plan.chunk
        assert region_elems_for(tokens, hidden, world, plan, twoshot=False) == tokens * hidden


def test_buffer_layout_parts_are_aligned_and_disjoint():
    from tpfuse.kernels.protocol import HEADER_BYTES, NUM_SLOTS, buffer_layout, round_region, round_tags

    for itemsize in (2, 4):
        for region, regions, items in ((6144, 8, 6), (100, 3, 1), (7168 * 64, 9, 192)):
            r, t = round_region(region), round_tags(items)
            lay = buffer_layout(r, regions, t, itemsize)
            assert lay.header_elems * itemsize == HEADER_BYTES
            assert lay.tags_elems == lay.header_elems + NUM_SLOTS * regions * r  # tags follow the slots
            assert lay.tags_elems * itemsize % 128 == 0 and lay.rows_elems * itemsize % 128 == 0
            assert (lay.rows_elems - lay.tags_elems) * itemsize == NUM_SLOTS * regions * t * 4
            assert (lay.total_elems - lay.rows_elems) * itemsize == NUM_SLOTS * t * 8


def test_twoshot_owns_rows_from_as_many_rows_a_rank_as_its_plan_has_programs():
    from tpfuse.kernels.protocol import PLAN_PROGRAMS_PER_GPU, plan_programs, tag_words_for, twoshot_owns_rows

    shared = plan_programs(8, True)  # 8 ranks on one GPU: 16 programs a rank
    assert not twoshot_owns_rows(64, 8, shared) and twoshot_owns_rows(256, 8, shared)  # as measured there
    alone = plan_programs(1, False)
    assert not twoshot_owns_rows(64, 1, alone) and twoshot_owns_rows(PLAN_PROGRAMS_PER_GPU, 1, alone)
    assert make_plan(64, 6144, 2, shared).programs == shared  # the plan carries what it was made for
    plan = make_plan(3, 6144, 2, 16)
    assert tag_words_for(plan, 3) == plan.items >= 3


def test_twoshot_plan_widens_chunks_only_where_owners_hold_several_items():
    from tpfuse.kernels.protocol import TWOSHOT_WIDE_CHUNK_BYTES, plan_programs, twoshot_owns_rows, twoshot_plan

    wide = TWOSHOT_WIDE_CHUNK_BYTES // 2
    shared = plan_programs(8, True)  # 16 programs a rank, as in the emulation that measured it
    for tokens in (1, 16, 32, 48, 64, 96, 128, 256, 2048):
        for world, programs in ((8, shared), (4, 33), (2, 66), (8, plan_programs(8, False))):
            for hidden in (2048, 4096, 6144, 7168):
                base = make_plan(tokens, hidden, 2, programs)
                plan = twoshot_plan(tokens, hidden, 2, programs, world)
                several = -(-base.items // world) > programs  # an owner's program would hold several items
                widened = several and hidden > wide and not twoshot_owns_rows(tokens, world, programs)
                if widened:
                    assert (plan.chunk, plan.num_chunks, plan.num_warps) == (wide, -(-hidden // wide), 16)
                    assert plan.items == tokens * plan.num_chunks and plan.programs == programs and plan.split
                else:
                    assert plan == base, (tokens, world, hidden)
    # the measured cases: 8 ranks sharing a GPU, x 6144, wide from 48 tokens (two items a program)
    assert twoshot_plan(32, 6144, 2, shared, 8).chunk == 2048 and twoshot_plan(48, 6144, 2, shared, 8).chunk == wide
    assert twoshot_plan(64, 6144, 2, plan_programs(8, False), 8).chunk == 2048  # one rank a GPU: one item a program
