"""hardware.py: a gate whose guarded code needs what `--arch` lacks is a hardware exclusion, which
`patch` refuses unless `--force-hardware`; a policy gate it opens."""

from __future__ import annotations

import json

from tpfuse.audit.arch import parse_arch
from tpfuse.audit.hardware import gate_class

from .conftest import find
from .test_patch import run

SM120, SM100 = parse_arch("sm120"), parse_arch("sm100")


def test_hardware_gates_refused_unless_forced(capsys, engine, result):
    tcgen05 = find(result, "v2/hardware.py", "[0] == 10")
    policy = next(f for f in result.findings if f.scope == "policy_default_backend")
    assert gate_class(tcgen05, SM120)[0] == "hardware" and gate_class(tcgen05, SM100)[0] == "policy"
    assert "sm_100a" in tcgen05.requires and gate_class(policy, SM120)[0] == "policy"
    code, out, _ = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", tcgen05.id,
                       "--json")
    assert code == 1 and "hardware exclusion" in json.loads(out)["errors"][0]["error"]
    code, out, err = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", tcgen05.id,
                         "--force-hardware", "--json")
    assert code == 0 and json.loads(out)["diff"] and "warning" in err and "hardware gate" in err
