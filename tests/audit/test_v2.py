"""Audit v2 idioms, inverse gates, hardware exclusions, patches that cannot harm, file/tree agreement.

Expected sets are written from each idiom's documented meaning (gate-idioms.md), independently of
the evaluator.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tpfuse.audit import patch as patch_mod
from tpfuse.audit.arch import ARCHS, parse_arch
from tpfuse.audit.driver import audit
from tpfuse.audit.hardware import gate_class

from .test_patch import run, snapshot

FIXTURES = Path(__file__).parent / "fixtures"
SM120, SM100 = parse_arch("sm120"), parse_arch("sm100")


def names(pred):
    return [a.name for a in ARCHS if pred(a)]


@pytest.fixture(scope="module")
def result():
    return audit(str(FIXTURES / "fakeengine"))


def find(result, path, part):
    hits = [f for f in result.findings if f.path == path and part in f.condition]
    assert len(hits) == 1, [(f.line, f.condition) for f in result.findings if f.path == path]
    return hits[0]


V2 = [
    ("sm == 90 or 100 <= sm < 110", "if", names(lambda a: a.cc_int == 90 or 100 <= a.cc_int < 110)),
    ("sm in (90, 100, 103, 120)", "assign", ["sm90", "sm100", "sm103", "sm120"]),  # `sm = sm or get_device_sm()`
    ("self.sm_version >= 100", "if", ["sm100", "sm103"]),  # attribute set in __init__, below the method
    ("capability.major in (9, 10)", "return", names(lambda a: a.major in (9, 10))),  # supports_compute_capability(cls, capability)
    ("capability >= (10, 0) and capability < (11, 0)", "return", names(lambda a: a.major == 10)),
    ("cap in SUPPORTED_CAPS", "if", ["sm90", "sm100", "sm103"]),
    ("ONE_SHOT_MAX_MB.get(", "table", ["sm90", "sm100", "sm103"]),  # the gate is a missing key
    ("in _SUPPORTED_PAIRS", "return", ["sm90", "sm100"]),
    ('not _match_sm_version(device, ["100", "103"])', "guard", ["sm100", "sm103"]),
    ("not (current_platform.is_device_capability_family(100)", "guard", names(lambda a: a.major == 10 or a.cc_int == 90)),
    ("not get_platform().is_sm100", "guard", names(lambda a: a.major == 10)),
    ("(major, minor) != (9, 0)", "guard", ["sm90"]),
    ("get_platform().is_sm100 or get_platform().is_sm120", "return", names(lambda a: a.major in (10, 12))),
    ("sm in (100, 103, 120, 121)", "return", ["sm100", "sm103", "sm120", "sm121"]),
    # parameters named as the device's capability (FlashInfer's _compile_hca_kernel, green_ctx)
    ("compute_capability not in ((10, 0), (10, 3))", "guard", ["sm100", "sm103"]),
    ('get_device_arch() == "90a"', "if", ["sm90"]),  # f"{major * 10 + minor}{suffix}" with a ternary suffix
]


@pytest.mark.parametrize("part,kind,expected", V2, ids=[c[0][:30] for c in V2])
def test_v2_idiom(result, part, kind, expected):
    f = find(result, "v2/idioms.py", part)
    assert (f.kind, f.category, f.enables) == (kind, "gate", expected)


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


def test_inverse_gate_is_listed_apart_and_never_opened(capsys, engine, result):
    f = find(result, "v2/inverse.py", "get_platform().is_sm120")
    assert f in result.inverse(SM120)
    code, out, err = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", f.id, "--json")
    data = json.loads(out)
    assert code == 1 and not data["diff"] and "inverse gate" in data["errors"][0]["error"]


def test_hardware_gates_refused_unless_forced(capsys, engine, result):
    tcgen05 = find(result, "v2/hardware.py", "[0] == 10")
    policy = next(f for f in result.findings if f.scope == "policy_default_backend")
    assert gate_class(tcgen05, SM120)[0] == "hardware" and gate_class(tcgen05, SM100)[0] == "policy"
    assert "sm_100a" in tcgen05.requires and gate_class(policy, SM120)[0] == "policy"
    code, out, _ = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", tcgen05.id, "--json")
    assert code == 1 and "hardware exclusion" in json.loads(out)["errors"][0]["error"]
    code, out, err = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", tcgen05.id, "--force-hardware", "--json")
    assert code == 0 and json.loads(out)["diff"] and "warning" in err and "hardware gate" in err


def test_every_proposed_edit_reaudits_open_and_type_consistent(capsys, engine):
    code, out, _ = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--json")
    data = json.loads(out)
    assert data["gates"] and all(g["includes_arch"] and g["harm"] is None for g in data["gates"])
    added = [line[1:].strip() for d in data["diff"].values() for line in d.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert "if cap in SUPPORTED_CAPS or cap == 120:" in added  # an int SM compared with an int
    assert "return capability.major in (9, 10, 12)" in added  # a major with a major
    assert 'if not _match_sm_version(device, ["100", "103", "120"]):' in added  # the list in its own spelling
    assert not [line for line in added if "(12, 0)" in line and ("major" in line or "sm ==" in line)]


def test_harm_rule():
    class F:
        def __init__(self, **values):
            self.values = {a.name: values.get(a.name, False) for a in ARCHS}

    before = F(sm100=True, sm103=True)
    assert patch_mod.harm(before, F(sm100=True, sm103=True, sm120=True, sm121=True), SM120, SM100) is None
    assert "still excluding" in patch_mod.harm(before, F(sm100=True, sm103=True), SM120, SM100)
    # `cap != (12, 0) or cap == (12, 0)`: true everywhere is not "opened like sm100"
    assert "sm80" in patch_mod.harm(before, F(**{a.name: True for a in ARCHS}), SM120, SM100)


def test_apply_patch_never_writes_an_edit_that_fails_its_reaudit(engine, state_dir):
    # The harm rule is the library's: a caller of apply_patch (not only the CLI) cannot write an edit
    # that re-audits as still excluding --arch, whatever the proposal it passes says.
    result = audit(str(engine))
    gate = find(result, "v2/idioms.py", "cap in SUPPORTED_CAPS")
    proposal = patch_mod.propose_patch(result, [gate], SM120, SM100)
    assert proposal.complete and list(proposal.plans) == [gate.id]
    before = snapshot(engine)
    rel, (old, new) = next(iter(proposal.changes.items()))
    assert "cap in SUPPORTED_CAPS or cap == 120" in new
    proposal.changes[rel] = (old, new.replace("cap in SUPPORTED_CAPS or cap == 120", "cap in SUPPORTED_CAPS or cap == 121"))
    with pytest.raises(patch_mod.PatchRefused, match=rf"nothing written.*{gate.id} re-audits as still excluding sm120"):
        patch_mod.apply_patch(proposal, state_dir=state_dir)
    assert snapshot(engine) == before and not state_dir.exists()
    proposal.changes[rel] = (old, new)  # the edit as proposed is written
    written, rows = patch_mod.apply_patch(proposal, state_dir=state_dir)
    assert written.is_file() and [r["includes_arch"] for r in rows] == [True]


def test_dry_run_and_apply_of_one_plan_exit_alike_then_revert(capsys, engine, state_dir):
    # Some fixture gates stay closed (hardware, explicit exclusions): 1 for the dry run and for --apply,
    # which still writes the others; a plan whose every gate opens exits 0 both ways.
    before = snapshot(engine)
    argv = ["patch", str(engine), "--arch", "sm120", "--like", "sm100", "--json"]
    dry_code, out, _ = run(capsys, *argv)
    assert dry_code == 1 and json.loads(out)["errors"] and not json.loads(out)["applied"]
    code, out, err = run(capsys, *argv, "--apply", "--state-dir", str(state_dir))
    data = json.loads(out)
    assert code == dry_code and data["applied"] and f"--state-dir {state_dir}" in data["undo"]
    assert snapshot(engine) != before
    assert run(capsys, "revert", str(engine), "--state-dir", str(state_dir))[0] == 0
    assert snapshot(engine) == before
    gid = find(audit(str(engine)), "v2/idioms.py", "cap in SUPPORTED_CAPS").id
    assert run(capsys, *argv, "--only", gid)[0] == 0
    assert run(capsys, *argv, "--only", gid, "--apply", "--state-dir", str(state_dir))[0] == 0
    assert run(capsys, "revert", str(engine), "--state-dir", str(state_dir))[0] == 0 and snapshot(engine) == before


def test_cpp_runtime_capability_comparisons(result):
    f = find(result, "csrc/runtime_caps.cpp", "sm >= 100 && sm < 120")
    assert f.report_only and f.kind == "runtime-cpp" and f.enables == names(lambda a: 100 <= a.cc_int < 120)
    assert find(result, "csrc/runtime_caps.cpp", "cap == 90").enables == ["sm90"]


def test_non_source_file_says_so(capsys, tmp_path):
    notes = tmp_path / "NOTES.txt"
    notes.write_text("if is_sm100_supported(): pass\n")
    code, out, _ = run(capsys, "audit", str(notes), "--arch", "sm120", "--json")
    data = json.loads(out)
    assert code == 0 and data["gates"] == [] and "not a Python" in data["note"]
    code, out, _ = run(capsys, "audit", str(notes), "--arch", "sm120")
    assert code == 0 and "not a Python" in out


def test_single_file_and_tree_agree_on_every_file(result):
    tree: dict = {}
    for f in result.findings:
        if not f.report_only:
            tree.setdefault(f.path, []).append((f.id, f.line, f.kind, f.category, f.enables))
    for rel, expected in tree.items():
        alone = audit(str(FIXTURES / "fakeengine" / rel), native=False)
        assert [(f.id, f.line, f.kind, f.category, f.enables) for f in alone.findings] == expected, rel


def test_namespace_packages_are_named_apart(tmp_path):
    # sglang 0.5.10: srt/ and multimodal_gen/runtime/ lack __init__.py and both hold server_args.py.
    root = tmp_path / "eng"
    for sub in ("srt", "mm/runtime"):
        (root / sub).mkdir(parents=True)
        (root / sub / "server_args.py").write_text(
            "from eng.utils import is_sm100_supported\n\n\ndef pick():\n    if is_sm100_supported():\n        return 'fast'\n    return 'slow'\n"
        )
    (root / "__init__.py").write_text("")
    (root / "mm" / "__init__.py").write_text("")
    (root / "utils.py").write_text("import torch\n\n\ndef is_sm100_supported():\n    return torch.cuda.get_device_capability()[0] == 10\n")
    tree = audit(str(root))
    gates = [f.path for f in tree.findings if f.category == "gate"]
    assert sorted(gates) == ["mm/runtime/server_args.py", "srt/server_args.py"] and not tree.skipped
    alone = audit(str(root / "srt" / "server_args.py"))
    assert [(f.id, f.enables) for f in alone.findings] == [(f.id, f.enables) for f in tree.findings if f.path == "srt/server_args.py"]


def test_capability_parameter_compares_in_every_integer_form():
    from tpfuse.audit.arch import compare
    from tpfuse.audit.predicates import CAP_ANY

    assert compare("Eq", CAP_ANY, 9).values == tuple(a.major == 9 for a in ARCHS)  # a major
    assert compare("GtE", CAP_ANY, 100).values == tuple(a.cc_int >= 100 for a in ARCHS)  # major*10+minor
    assert compare("Lt", CAP_ANY, 1000).values == tuple(a.cuda_arch < 1000 for a in ARCHS)  # __CUDA_ARCH__
    assert compare("In", CAP_ANY, ((10, 0), (10, 3))).values == tuple(a.cc_int in (100, 103) for a in ARCHS)


SELECTIVE = '''"""Module docstring
def not_code():
    return get_platform().is_sm100
"""
import torch

_MAJOR, _ = torch.cuda.get_device_capability()
_USE_FMA = _MAJOR >= 10


def plain(x):
    return x + 1


def reads_flag():
    if _USE_FMA:
        return "fma"
    return "mul"


def calls_helper():
    if _sm90():
        return "wgmma"
    return None


def _sm90():
    return torch.cuda.get_device_capability()[0] == 9


class Unrelated:
    def method(self):
        return 2
'''


def test_selective_parse_keeps_every_condition(tmp_path):
    from tpfuse.audit.parse import TextMap, parse_selected
    from tpfuse.audit.resolve import ARCH_RE, arch_tokens

    (tmp_path / "m.py").write_text(SELECTIVE)
    textmap = TextMap(SELECTIVE)
    tree, skipped, hot, hidden = parse_selected(SELECTIVE, "m.py", arch_tokens(textmap)[1], ARCH_RE, textmap=textmap)
    assert {"_MAJOR", "_USE_FMA", "_sm90"} <= hot
    kept = {n.name for n in tree.body if hasattr(n, "name")}
    assert {"reads_flag", "calls_helper", "_sm90"} <= kept  # a hot flag, a same-module arch helper
    assert set(skipped) == {"plain", "Unrelated"}
    left_out = {line for a, b in hidden for line in SELECTIVE.split("\n")[a:b]}
    assert any("def plain" in line for line in left_out) and any("class Unrelated" in line for line in left_out)
    found = {(f.scope, f.enables[0]) for f in audit(str(tmp_path / "m.py")).findings if f.category == "gate"}
    assert {("reads_flag", "sm100"), ("calls_helper", "sm90")} <= found  # and the flag and helper themselves
    assert not [f for f in audit(str(tmp_path / "m.py")).findings if f.line <= 4]  # the docstring holds no code


def test_report_only_audit_frees_trees_with_the_same_findings(result):
    lean = audit(str(FIXTURES / "fakeengine"), keep_trees=False)
    assert [f.to_dict() for f in lean.findings] == [f.to_dict() for f in result.findings]
    assert not lean.sites


def test_audit_objects_are_frozen_so_exit_does_not_rescan_them():
    # The process lingered ~10 s after printing a whole-sglang audit: the collector at interpreter
    # exit rescanned the millions of objects the audit left alive. audit() freezes them.
    import gc

    gc.unfreeze()
    before = gc.get_freeze_count()
    result = audit(str(FIXTURES / "fakeengine"))
    assert gc.get_freeze_count() > before + len(result.findings)
    gc.unfreeze()


def test_explicit_inequality_exclusion_is_an_inverse_gate_never_undone(capsys, engine, result):
    # `major > 9 and major != 12` (sglang attn_residual.py: `major >= 10 and major != 12`) names SM12x to
    # exclude it: an inverse gate (`or major == 12` would undo the author's exclusion).
    f = find(result, "v2/idioms.py", "major != 12")
    assert f.category == "inverse" and f.enables == names(lambda a: a.major in (10, 11))
    assert f in result.inverse(SM120)
    code, out, _ = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", f.id, "--json")
    data = json.loads(out)
    assert code == 1 and not data["diff"] and "inverse gate" in data["errors"][0]["error"]


def test_class_methods_without_architecture_text_are_trimmed_not_lost(tmp_path):
    from tpfuse.audit.parse import _trim_class

    cls = (
        "class Runner:\n"
        "    def __init__(self):\n"
        "        self.sm = get_device_sm()\n"
        "\n"
        "    def plain(self, x):\n"
        "        return x + 1\n"
        "\n"
        "    def fast(self):\n"
        "        if self.sm >= 100:\n"
        "            return 1\n"
        "        return 0\n"
    )
    trimmed, ranges, exports = _trim_class(cls, {2}, set())
    assert [cls.split("\n")[a] for a, _ in ranges] == ["    def plain(self, x):"]
    assert exports == {"sm", "fast"}  # what other code reads the architecture through: `self.sm`, `x.fast()`
    assert trimmed.count("\n") == cls.count("\n")  # every position stays the real one
    assert "return x + 1" not in trimmed and "self.sm >= 100" in trimmed  # `self.sm` ties `fast` to __init__
    (tmp_path / "r.py").write_text("from eng.utils import get_device_sm\n\n\n" + cls)
    found = [f for f in audit(str(tmp_path / "r.py")).findings if f.scope == "Runner.fast"]
    assert [f.enables for f in found] == [names(lambda a: a.cc_int >= 100)]
