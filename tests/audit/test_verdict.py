"""verdict.py: what a condition means for `--arch`: a gate, an inverse gate (a check that turns a
feature off where it names an architecture) or a quirk (a tuning that enables nothing elsewhere).

Expected sets are written from each idiom's documented meaning (gate-idioms.md), independently of
the evaluator.
"""

from __future__ import annotations

import json

import pytest

from tpfuse.audit.arch import parse_arch

from .conftest import find, names
from .test_patch import run

SM120 = parse_arch("sm120")


def test_a_branch_that_only_returns_tuning_numbers_is_a_quirk(result):
    f = find(result, "v2/idioms.py", "major >= 10")  # `return (8, 8)`: a tuned default, nothing enabled
    assert (f.kind, f.category, f.enables) == ("if", "quirk", names(lambda a: a.major >= 10))


INVERSE = [
    # (fragment, kind, category, where the feature is on)
    ("get_platform().is_sm120", "if", "inverse", names(lambda a: a.major != 12)),  # config.use_pdl = False on SM12x
    ("cap != (12, 0)", "guard", "gate", ["sm120"]),  # return "device is not SM120": the SM120 kernel
    ("major not in (8, 12)", "if", "gate", names(lambda a: a.major in (8, 12))),  # unsupported.append(...)
    ("get_device_sm() // 10 == 12", "if", "inverse", names(lambda a: a.major != 12)),  # options["disable_..."] = True
]


@pytest.mark.parametrize("part,kind,category,expected", INVERSE, ids=[c[0][:30] for c in INVERSE])
def test_inverse_gates(result, part, kind, category, expected):
    f = find(result, "v2/inverse.py", part)
    assert (f.kind, f.category, f.enables) == (kind, category, expected)
    assert f not in result.selected(SM120)  # an inverse gate or an SM120-only path is not a gate excluding SM120


def test_explicit_inequality_exclusion_is_an_inverse_gate_never_undone(capsys, engine, result):
    # `major > 9 and major != 12` (sglang attn_residual.py: `major >= 10 and major != 12`) names SM12x to
    # exclude it: an inverse gate (`or major == 12` would undo the author's exclusion).
    f = find(result, "v2/idioms.py", "major != 12")
    assert f.category == "inverse" and f.enables == names(lambda a: a.major in (10, 11))
    assert f in result.inverse(SM120)
    code, out, _ = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", f.id, "--json")
    data = json.loads(out)
    assert code == 1 and not data["diff"] and "inverse gate" in data["errors"][0]["error"]
