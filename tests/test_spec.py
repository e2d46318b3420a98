"""The facts' types (`tpfuse.spec`): a Problem refuses a dtype it does not know, naming it."""

import pytest

from tpfuse.spec import GroupFacts, Op, Problem

CPU_GROUP = GroupFacts(world_size=2, backend="gloo", device_type="cpu", devices=("cpu", "cpu"))


def test_problem_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="dtype 'int8'"):
        Problem(Op.ALL_REDUCE, 1, 8, "int8", CPU_GROUP)
