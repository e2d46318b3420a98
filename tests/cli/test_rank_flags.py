"""One rank rule and one set of rank flags for every command that spawns ranks, and the former flags
kept as hidden aliases that say which flag replaced them."""

from __future__ import annotations

import pytest

from tpfuse.cli.exits import UsageError
from tpfuse.cli.main import build_parser, main
from tpfuse.cli.ranks import Ranks, resolve_ranks
from tpfuse.group import expected_group_facts, representative_problem
from tpfuse.spec import Op

SPAWNING = (["selftest"], ["tune", "--hidden", "64"], ["verify", "--strategy", "ring", "--hidden", "64"],
            ["bench", "e2e"], ["profile"])


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


def _flags(argv: list[str]) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[argv[0]]
    if argv[0] == "bench":
        sub = next(a for a in sub._actions if a.dest == "bench_command").choices["e2e"]
    return {opt for action in sub._actions for opt in action.option_strings if action.help != "==SUPPRESS=="}


@pytest.mark.parametrize("argv", SPAWNING, ids=lambda argv: argv[0])
def test_every_command_that_spawns_ranks_has_the_same_rank_flags(argv):
    assert {"--world-size", "--device", "--shared-gpu"} <= _flags(argv)


@pytest.mark.parametrize("argv", [["selftest", "--backend", "gloo"], ["bench", "e2e", "--tp", "2"],
                                  ["profile", "--tp", "2"], ["bench", "e2e", "--no-results"]])
def test_the_former_flags_are_gone(argv, capsys):
    """The project is unreleased: a renamed flag is renamed everywhere, with no alias left behind."""
    assert main(argv) == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_bench_refuses_shared_gpu_with_the_reason(capsys):
    assert main(["bench", "e2e", "--preset", "tiny", "--shared-gpu"]) == 2
    assert "--shared-gpu: the reference model is timed with one GPU per rank" in capsys.readouterr().err


def test_representative_problem_groups_follow_the_launch_rules():
    from tpfuse.probe import probe

    caps = probe()
    problem = representative_problem(Op.ALL_REDUCE, 4, 64, "float32", caps, world_size=3, backend="gloo",
                                     device_type="cpu")
    assert (problem.facts, problem.has_residual) == (
        expected_group_facts(caps, 3, backend="gloo", device_type="cpu"), False)
    assert (problem.facts.world_size, problem.facts.backend, problem.facts.devices) == (3, "gloo", ("cpu",) * 3)
    assert representative_problem(Op.ALL_REDUCE_RESIDUAL_RMSNORM, 4, 64, "float32", caps, world_size=2,
                                  backend="gloo", device_type="cpu").has_residual
    with pytest.raises(ValueError, match="representative_problem: 9 NCCL ranks need as many GPUs"):
        representative_problem(Op.ALL_REDUCE, 4, 64, "float32", caps, world_size=9, backend="nccl", device_type="cuda")


def _sweep_module():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_allreduce_norm.py"
    spec = importlib.util.spec_from_file_location("bench_allreduce_norm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_sweep_takes_the_same_rank_flags(capsys):
    sweep = _sweep_module()
    args = sweep.parse_args(["--world-size", "3", "--device", "cuda", "--shared-gpu"])
    assert (args.world_size, args.device, args.shared_gpu, args.timeout) == (3, "cuda", True, 3600.0)
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        sweep.parse_args(["--cpu-smoke"])  # the former flag is gone


def test_the_sweep_refuses_ranks_it_cannot_run_with_the_fix(capsys):
    assert _sweep_module().main(["--device", "cpu", "--shared-gpu"]) == 2
    assert capsys.readouterr().err.strip() == ("bench_allreduce_norm: --shared-gpu needs --device cuda (or auto on a "
                                               "GPU machine)")
