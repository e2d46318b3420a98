"""The world-size bound: ranks per usable core and memory per rank, with the reason in the message."""

import pytest

from tpfuse.cli.exits import UsageError
from tpfuse.cli.preflight import RANK_MEMORY_BYTES, check_world_size, max_local_ranks

GiB = 2**30


def test_the_bound_is_four_ranks_per_core_unless_memory_is_shorter():
    assert max_local_ranks(cores=2, memory_bytes=24 * GiB) == (8, "4 rank processes per usable core, 2 core(s)")
    assert max_local_ranks(cores=16, memory_bytes=3 * GiB) == (6, "512 MiB per rank, 3.0 GiB available")
    assert max_local_ranks(cores=1, memory_bytes=RANK_MEMORY_BYTES // 2)[0] == 1  # never below one rank


def test_check_world_size_says_the_bound_and_why():
    check_world_size(None)  # the command's default
    check_world_size(8, cores=2, memory_bytes=24 * GiB)
    with pytest.raises(UsageError) as exc:
        check_world_size(9, cores=2, memory_bytes=24 * GiB)
    assert str(exc.value) == ("--world-size 9 is more local ranks than this machine can run: at most 8 (4 rank "
                              "processes per usable core, 2 core(s)); use --world-size 8 or less")
    with pytest.raises(UsageError, match=r"^--world-size must be >= 1, got 0; pass the number of local ranks"):
        check_world_size(0)
