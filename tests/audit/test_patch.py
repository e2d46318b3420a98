"""`tpfuse patch` / `revert` on a writable copy of the fixture engine, and on the real sglang source
(slow; skipped with the pip error when PyPI is unreachable, sglang_source.py says where it is cached):
edits in the codebase's idiom, re-audited before anything is written, byte-identical reverts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from tpfuse.audit import manifest
from tpfuse.audit import patch as patch_mod
from tpfuse.audit.arch import ARCHS, parse_arch
from tpfuse.audit.driver import audit
from tpfuse.audit.patch import propose_patch
from tpfuse.cli.main import main

from .conftest import find
from .sglang_source import ADD_NORM, runtime_gate

RUNTIME_GATE = "allreduce_fusion_applies() result"
SM120, SM100 = parse_arch("sm120"), parse_arch("sm100")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def gate_id(root: Path, guards: str) -> str:
    result = audit(str(root))
    return next(f.id for f in result.findings if f.guards == guards)


def test_diff_adds_flag_import_and_disjunct_in_the_codebase_idiom(capsys, engine):
    before = snapshot(engine)
    gid = gate_id(engine, RUNTIME_GATE)
    code, out, err = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", gid)
    assert code == 0, err
    assert snapshot(engine) == before  # a dry run writes nothing
    assert "+    is_sm120_supported,\n" in out  # next to its sibling in the parenthesized import
    assert "+_is_sm120_supported = _is_cuda and is_sm120_supported()\n" in out  # after the sibling flag
    # the comment on the gate's line survives
    assert "+        (_is_sm90_supported or _is_sm100_supported or _is_sm120_supported)  # the runtime gate\n" in out
    assert f"# {gid} -> " in err and "now includes sm120" in err


@pytest.mark.parametrize("fragment,expected", [
    ("sm_version in (100, 103)", "return sm_version in (100, 103, 120)"),
    ("major == 10", "if major in (10, 12):"),
    ("100 <= sm < 120", "is_fp8_deprecated = 100 <= sm < 120 or sm == 120"),
    ("is_device_capability_family(100)",
     "c = current_platform.is_device_capability_family(100) or current_platform.is_device_capability_family(120)"),
    ('moe_runner_backend == "auto"',
     'if server_args.moe_runner_backend == "auto" and (get_platform().is_sm100 or get_platform().is_sm120):'),
    ("not (get_platform().is_sm90",
     "if not (get_platform().is_sm90 or get_platform().is_sm100 or get_platform().is_sm120):"),
    ("supported_compute_capability([100, 103])", "@supported_compute_capability([100, 103, 120])"),
])
def test_comparison_and_platform_edits(capsys, engine, fragment, expected):
    result = audit(str(engine))
    gid = next(f.id for f in result.findings if fragment in f.condition and f.category == "gate")
    code, out, _ = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", gid, "--json")
    data = json.loads(out)
    assert code == 0, data["errors"]
    diff = "".join(data["diff"].values())
    assert any(line[1:].strip() == expected for line in diff.splitlines() if line.startswith("+")), diff
    assert [g["includes_arch"] for g in data["gates"]] == [True]


def test_apply_reaudit_and_byte_identical_revert(capsys, engine, state_dir):
    before = snapshot(engine)
    gid = gate_id(engine, RUNTIME_GATE)
    code, out, _ = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", gid, "--apply",
                       "--state-dir", str(state_dir), "--json")
    data = json.loads(out)
    assert code == 0 and data["applied"]
    assert Path(data["manifest"]).is_file()
    after = audit(str(engine))
    gate = next(f for f in after.findings if f.guards == RUNTIME_GATE)
    assert gate.values["sm120"] is not False and gate.values["sm80"] is False
    assert "_is_sm120_supported" in gate.condition
    assert snapshot(engine) != before
    code, out, _ = run(capsys, "revert", str(engine), "--state-dir", str(state_dir), "--json")
    assert code == 0 and [r["path"] for r in json.loads(out)["restored"]] == ["layers/fusion.py"]
    assert snapshot(engine) == before
    code, _, err = run(capsys, "revert", str(engine), "--state-dir", str(state_dir))
    assert code == 2 and "nothing to revert" in err


def test_revert_refuses_a_file_changed_after_patching(capsys, engine, state_dir):
    before = snapshot(engine)
    gid = gate_id(engine, RUNTIME_GATE)
    assert run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", gid, "--apply",
               "--state-dir", str(state_dir))[0] == 0
    target = engine / "layers/fusion.py"
    target.write_text(target.read_text() + "\n# local edit\n")
    code, _, err = run(capsys, "revert", str(engine), "--state-dir", str(state_dir))
    assert code == 2 and "changed after patching" in err and "--force" in err
    assert "# local edit" in target.read_text()  # nothing restored
    assert run(capsys, "revert", str(engine), "--state-dir", str(state_dir), "--force")[0] == 0
    assert snapshot(engine) == before


def test_second_patch_needs_a_revert_first(capsys, engine, state_dir):
    gid = gate_id(engine, RUNTIME_GATE)
    args = ["patch", str(engine), "--arch", "sm120", "--like", "sm100", "--apply", "--state-dir", str(state_dir)]
    assert run(capsys, *args, "--only", gid)[0] == 0
    other = gate_id(engine, "return 'flashinfer_trtllm'")
    code, _, err = run(capsys, *args, "--only", other)
    assert code == 2 and "tpfuse revert" in err


def test_read_only_file_nothing_half_written(capsys, engine, state_dir):
    before = snapshot(engine)
    caps = engine / "layers/caps.py"
    os.chmod(caps, 0o444)
    try:
        code, _, err = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--apply", "--state-dir",
                           str(state_dir))
    finally:
        os.chmod(caps, 0o644)
    assert code == 2 and "read-only" in err and "nothing was written" in err
    assert snapshot(engine) == before
    assert not (state_dir.exists() and any(state_dir.rglob("manifest.json")))


def test_failure_midway_restores_written_files(engine, state_dir, monkeypatch):
    before = snapshot(engine)
    result = audit(str(engine))
    from tpfuse.audit.patch import propose_patch

    findings = result.selected(parse_arch("sm120"), parse_arch("sm100"))
    changes = propose_patch(result, findings, parse_arch("sm120"), parse_arch("sm100")).changes
    assert len(changes) >= 2
    real_replace, calls = os.replace, []

    def flaky_replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", flaky_replace)
    with pytest.raises(manifest.ManifestError, match="nothing changed"):
        manifest.apply(engine, {rel: new for rel, (_, new) in changes.items()}, result.file_hashes, {},
                       state_dir=state_dir)
    monkeypatch.undo()
    assert snapshot(engine) == before
    assert not list(engine.rglob("*.tpfuse-tmp"))


def test_refuses_a_file_changed_since_the_audit(capsys, engine, tmp_path):
    code, out, _ = run(capsys, "audit", str(engine), "--arch", "sm120", "--json")
    audit_json = tmp_path / "audit.json"
    audit_json.write_text(out)
    gid = next(g["id"] for g in json.loads(out)["gates"] if g["guards"] == RUNTIME_GATE)
    target = engine / "layers/fusion.py"
    target.write_text(target.read_text().replace("FUSE_MAX_TOKENS = 2048", "FUSE_MAX_TOKENS = 4096"))
    code, _, err = run(capsys, "patch", str(engine), "--arch", "sm120", "--only", gid, "--audit-json", str(audit_json),
                       "--apply")
    assert code == 2 and "changed since the audit" in err
    assert "4096" in target.read_text() and "sm120" not in target.read_text()
    # The in-process guard: hashes handed to apply() must match the file.
    with pytest.raises(manifest.ManifestError, match="changed since it was audited"):
        manifest.apply(engine, {"layers/fusion.py": "x = 1\n"},
                       {"layers/fusion.py": hashlib.sha256(b"old").hexdigest()}, {}, state_dir=tmp_path / "s")


def test_refuses_to_call_a_helper_the_target_lacks(capsys, engine):
    common = engine / "utils/common.py"
    text = common.read_text()
    start = text.index("is_sm120_supported = ")
    end = text.index("is_blackwell_supported")
    common.write_text(text[:start] + text[end:])
    gid = gate_id(engine, RUNTIME_GATE)
    code, out, _ = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", gid, "--json")
    data = json.loads(out)
    assert code == 1 and not data["diff"]
    error = data["errors"][0]["error"]
    assert "is_sm120_supported" in error and "does not exist" in error and "add `is_sm120_supported`" in error


def test_unknown_only_id(capsys, engine):
    code, _, err = run(capsys, "patch", str(engine), "--arch", "sm120", "--only", "deadbeef")
    assert code == 2 and "deadbeef" in err


def test_refuses_explicit_exclusion(capsys, engine):
    # `is_blackwell and not is_sm120` names SM12x to turn the path off there: an inverse gate, never opened.
    (engine / "layers/excl.py").write_text(
        "from fakeengine.runtime_context import get_platform\n\n\n"
        "def fused_ok(x):\n    return x and get_platform().is_blackwell and not get_platform().is_sm120\n"
    )
    gid = gate_id(engine, "fused_ok() result")
    code, out, _ = run(capsys, "patch", str(engine), "--arch", "sm120", "--only", gid, "--json")
    data = json.loads(out)
    assert code == 1 and "inverse gate" in data["errors"][0]["error"] and not data["diff"]


def test_a_gate_opened_through_the_helper_the_same_patch_edits_is_not_left_to_the_user(capsys, tmp_path):
    root = tmp_path / "eng"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "utils.py").write_text("import torch\n\n\ndef is_sm100_supported():\n    return "
                                   "torch.cuda.get_device_capability()[0] == 10\n\n\ndef is_sm120_supported():\n    "
                                   "return torch.cuda.get_device_capability()[0] == 12\n")
    (root / "flags.py").write_text("from eng.utils import is_sm100_supported, is_sm120_supported\n\n\n"
                                   "def use_fused_path():\n    return is_sm100_supported()\n")
    (root / "layer.py").write_text("from eng.flags import use_fused_path\n\n\ndef forward(x):\n    if "
                                   "use_fused_path():\n        return 'fused'\n    return 'unfused'\n")
    argv = ["patch", str(root), "--arch", "sm120", "--like", "sm100", "--json"]
    code, out, err = run(capsys, *argv)
    data = json.loads(out)
    assert code == 0 and data["errors"] == [], data["errors"]  # not "add the sm120 condition by hand"
    assert [row["path"] for row in data["opened_by_other_edits"]] == ["layer.py"]
    assert list(data["diff"]) == ["flags.py"]
    code, out, _ = run(capsys, *argv, "--apply", "--state-dir", str(tmp_path / "state"))
    assert code == 0 and json.loads(out)["applied"]
    assert audit(str(root)).selected(parse_arch("sm120"), parse_arch("sm100")) == []  # a re-run finds nothing left


def test_inverse_gate_is_listed_apart_and_never_opened(capsys, engine, result):
    f = find(result, "v2/inverse.py", "get_platform().is_sm120")
    assert f in result.inverse(SM120)
    code, out, err = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", f.id, "--json")
    data = json.loads(out)
    assert code == 1 and not data["diff"] and "inverse gate" in data["errors"][0]["error"]


def test_every_proposed_edit_reaudits_open_and_type_consistent(capsys, engine):
    code, out, _ = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--json")
    data = json.loads(out)
    assert data["gates"] and all(g["includes_arch"] and g["harm"] is None for g in data["gates"])
    added = [line[1:].strip() for d in data["diff"].values() for line in d.splitlines()
             if line.startswith("+") and not line.startswith("+++")]
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
    proposal.changes[rel] = (old, new.replace("cap in SUPPORTED_CAPS or cap == "
                                              "120", "cap in SUPPORTED_CAPS or cap == 121"))
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



@pytest.mark.slow
def test_patch_reaudit_revert(source, tmp_path):
    root = tmp_path / "sglang"
    shutil.copytree(source, root)
    original = (root / ADD_NORM).read_bytes()
    before = audit(str(root), native=False, only={ADD_NORM})
    gate = runtime_gate(before)
    proposal = propose_patch(before, [gate], SM120, SM100)
    changes = proposal.changes
    assert not proposal.errors and list(changes) == [ADD_NORM]
    new = changes[ADD_NORM][1]
    assert "_is_sm120_supported = _is_cuda and get_platform().is_sm120\n" in new
    assert "(_is_sm90_supported or _is_sm100_supported or _is_sm120_supported)" in new
    state = tmp_path / "state"
    manifest.apply(root, {ADD_NORM: new}, before.file_hashes, {"arch": "sm120"}, state_dir=state)
    after = runtime_gate(audit(str(root), native=False, only={ADD_NORM}))
    assert after.values["sm120"] is not False and after.values["sm121"] is not False  # is_sm120 = major 12
    assert after.values["sm80"] is False
    manifest.revert(root, state_dir=state)
    assert hashlib.sha256((root / ADD_NORM).read_bytes()).digest() == hashlib.sha256(original).digest()
