"""The CLI's ranks: one rule for how many, on what and over which backend (`resolve_ranks`, refusing
what cannot run with the fix), and how the CLI tells about them: tpfuse warnings as one line, a
RankFailure as one line per error."""

import pytest

from tpfuse.cli.exits import UsageError
from tpfuse.cli.ranks import Ranks, _format_warning, describe_failure, resolve_ranks
from tpfuse.dispatch.choice import DispatchWarning
from tpfuse.spawn import RankFailure

TRACEBACK = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\nRuntimeError: {}\n'


def test_a_rank_failure_is_one_clause_per_distinct_error():
    exc = RankFailure({0: TRACEBACK.format("tune: no strategy passed"), 1: TRACEBACK.format("tune: no strategy passed"),
                       2: "no result within 300 s (hung or waiting on a peer)"})
    assert describe_failure(exc) == ("rank(s) 0, 1: RuntimeError: tune: no strategy passed; rank(s) 2: no result "
                                     "within 300 s (hung or waiting on a peer) (`tpfuse -v ...` prints the ranks' "
                                     "tracebacks)")


def test_tpfuse_warnings_print_as_one_plain_line_others_as_python_does():
    line = _format_warning(DispatchWarning("Communicator: no dispatch table"), DispatchWarning, "/x/api.py", 182,
                           "name = self._choose(problem).name")
    assert line == "tpfuse: warning: Communicator: no dispatch table\n"
    other = _format_warning(UserWarning("u"), UserWarning, "/x/y.py", 3, "src line")
    assert other == "/x/y.py:3: UserWarning: u\n  src line\n"


@pytest.mark.parametrize("world_size, device, shared, gpus, default, expect", [
    (None, "auto", False, 0, None, Ranks(2, "gloo", "cpu")),  # no GPU: 2 CPU ranks
    (None, "auto", False, 4, None, Ranks(4, "nccl", "cuda")),  # every GPU, one rank each
    (None, "cpu", False, 1, None, Ranks(2, "gloo", "cpu")),  # CPU ranks asked for on a one-GPU machine
    (3, "auto", False, 4, None, Ranks(3, "nccl", "cuda")),
    (None, "auto", False, 8, 2, Ranks(2, "nccl", "cuda")),  # a command's own default (selftest)
    (None, "auto", False, 8, 1, Ranks(1, "nccl", "cuda")),  # bench: one GPU
    (4, "auto", True, 1, None, Ranks(4, "gloo", "cuda")),  # sharing one GPU
    (4, "cuda", True, 1, None, Ranks(4, "gloo", "cuda")),
    (2, "cpu", False, 8, None, Ranks(2, "gloo", "cpu")),  # CPU ranks on a GPU machine
])
def test_resolve_ranks(world_size, device, shared, gpus, default, expect):
    ranks = resolve_ranks(world_size, device, shared_gpu=shared, default_world_size=default, num_gpus=gpus)
    assert ranks == expect and ranks.shared_gpu == (expect.backend == "gloo" and expect.device == "cuda")


@pytest.mark.parametrize("world_size, device, shared, gpus, message", [
    (None, "cuda", False, 0, "--device cuda but torch sees no CUDA GPU; use --device cpu"),
    (2, "cpu", True, 0, "--shared-gpu needs --device cuda (or auto on a GPU machine)"),
    (2, "auto", True, 0, "--shared-gpu needs a CUDA GPU and torch sees none; drop --shared-gpu to run on CPU"),
    (None, "auto", False, 1, "2 ranks but 1 GPU(s); NCCL needs one GPU per rank. Pass --shared-gpu for a functional "
                              "check with ranks sharing a GPU, --world-size 1 or less, or --device cpu"),
    (3, "cuda", False, 2, "3 ranks but 2 GPU(s)"),
])
def test_resolve_ranks_refuses_what_cannot_run_and_names_the_fix(world_size, device, shared, gpus, message):
    with pytest.raises(UsageError) as info:
        resolve_ranks(world_size, device, shared_gpu=shared, num_gpus=gpus)
    assert message in str(info.value)
