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


def _peak_rank_rss(argv: list[str]) -> int:
    """The largest resident size (bytes) any rank of `tpfuse ARGV` reached, from a fresh interpreter."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import json, resource, sys\nfrom tpfuse.cli.main import main\n"
            "if __name__ == '__main__':\n    rc = main(json.loads(sys.argv[1]))\n"
            "    print(json.dumps([rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024]))\n")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True, text=True, env=env,
                          timeout=900)
    rc, peak = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rc == 0, proc.stderr[-2000:]
    return peak


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("argv, tokens, hidden", [
    (["selftest", "--strategy", "ring", "--tokens", "512", "--repeats", "1", "--json"], 512, 8192),
    (["tune", "--hidden", "4096", "--max-tokens", "512", "--rounds", "2", "--confirm-rounds", "2", "--no-save",
      "--json"], 512, 4096),
], ids=["selftest", "tune"])
def test_the_memory_estimate_bounds_what_a_rank_holds(argv, tokens, hidden):
    """The refusal is only as good as its estimate: a rank's measured peak stays below it (with the
    process itself, RANK_MEMORY_BYTES), so a run the estimate admits is not killed for memory."""
    from tpfuse.cli.preflight import check_bytes

    peak = _peak_rank_rss(argv)
    assert peak < check_bytes(tokens, hidden) + RANK_MEMORY_BYTES, (peak, check_bytes(tokens, hidden))
