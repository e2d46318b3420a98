"""`tpfuse.group`: the representative problem of a launch follows the launch rules (world size,
backend, devices, residual), and a group no launch can make is refused with the reason."""

import pytest

from tpfuse.group import expected_group_facts, representative_problem
from tpfuse.spec import Op


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
