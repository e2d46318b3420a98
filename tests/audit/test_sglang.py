"""The audit on the real sglang source: the story's allreduce-fusion gate, patched and reverted.

Slow (a whole-engine audit, about 10 s on one core); skipped with the pip error when PyPI is
unreachable. The source is cached outside the repository (sglang_source.py says where).
"""

from __future__ import annotations

import hashlib
import shutil

import pytest

from tpfuse.audit import manifest
from tpfuse.audit.arch import parse_arch
from tpfuse.audit.driver import audit
from tpfuse.audit.patch import propose_patch

from .sglang_source import SGLANG_VERSION, sglang_source

pytestmark = pytest.mark.slow

ADD_NORM = "srt/layers/layer_boundary/residual/add_norm.py"
SM120, SM100 = parse_arch("sm120"), parse_arch("sm100")


@pytest.fixture(scope="module")
def source():
    path, why = sglang_source()
    if path is None:
        pytest.skip(f"sglang {SGLANG_VERSION} source unavailable: {why}")
    return path


@pytest.fixture(scope="module")
def full(source):
    return audit(str(source), native=False)


def runtime_gate(result):
    hits = [f for f in result.findings if f.path == ADD_NORM and f.scope == "flashinfer_ar_fusion_applies"]
    assert len(hits) == 1, [(f.line, f.condition) for f in result.findings if f.path == ADD_NORM]
    return hits[0]


def test_finds_the_allreduce_fusion_gate_excluding_sm120(full):
    gate = runtime_gate(full)
    assert "(_is_sm90_supported or _is_sm100_supported)" in gate.condition
    assert gate.category == "gate" and gate.kind == "return"
    # _is_sm90_supported = _is_cuda and get_platform().is_sm90 -> _PLATFORM_PROBES -> majors [9]
    assert gate.values["sm120"] is False and gate.values["sm121"] is False and gate.values["sm80"] is False
    assert gate.values["sm90"] is not False and gate.values["sm100"] is not False and gate.values["sm103"] is not False
    assert gate in full.selected(SM120, SM100)
    assert not full.skipped, full.skipped  # every file of the release parses


def test_finds_the_startup_auto_enable_gate(full):
    hits = [f for f in full.selected(SM120, SM100) if f.scope.endswith("_flashinfer_allreduce_fusion_auto_enable") and "is_sm90 or" in f.condition]
    assert len(hits) == 1
    assert "flashinfer_allreduce_fusion_backend" in hits[0].guards


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


# The story's three gates in each release: (path, scope suffix, condition fragment).
STORY = {
    "0.5.10": [
        ("srt/layers/communicator.py", "apply_flashinfer_allreduce_fusion", "(_is_sm90_supported or _is_sm100_supported)"),
        ("srt/server_args.py", "_handle_model_specific_adjustments", "(is_sm90_supported() or is_sm100_supported())"),
        ("srt/server_args.py", "_handle_model_specific_adjustments", "GLM"),
    ],
    "0.5.23": [
        (ADD_NORM, "flashinfer_ar_fusion_applies", "(_is_sm90_supported or _is_sm100_supported)"),
        ("srt/arg_groups/overrides.py", "_flashinfer_allreduce_fusion_auto_enable", "is_sm90 or"),
        ("srt/arg_groups/model_overrides/glm4_moe.py", "_glm4_moe_overrides", "get_platform().is_sm100"),
    ],
}


def _story_gate(result, root, path, scope, fragment):
    if fragment == "GLM":  # the `if is_sm100_supported():` right under `elif model_arch in ["Glm4MoeForCausalLM"]:`
        lines = (root / path).read_text().splitlines()
        hits = [f for f in result.findings if f.path == path and f.scope.endswith(scope)
                and 'model_arch in ["Glm4MoeForCausalLM"]' in lines[f.line - 2]]
    else:
        hits = [f for f in result.findings if f.path.endswith(path.split("/")[-1]) and f.scope.endswith(scope) and fragment in f.condition]
    assert len(hits) == 1, [(f.path, f.line, f.scope, f.condition[:60]) for f in hits]
    return hits[0]


@pytest.fixture(scope="module", params=sorted(STORY))
def release(request):
    path, why = sglang_source(request.param)
    if path is None:
        pytest.skip(f"sglang {request.param} source unavailable: {why}")
    return request.param, path, audit(str(path), native=False)


def test_all_six_story_gates_found_excluding_sm120_and_patchable(release):
    version, root, result = release
    gates = [_story_gate(result, root, *spec) for spec in STORY[version]]
    selected = result.selected(SM120, SM100)
    for gate in gates:
        assert gate.category == "gate" and gate.values["sm120"] is False and gate.values["sm100"] is not False
        assert gate in selected
    proposal = propose_patch(result, gates, SM120, SM100)
    assert not proposal.errors and sorted(proposal.plans) == sorted(g.id for g in gates)


def test_tree_and_single_file_audits_agree(release):
    version, root, result = release
    tree: dict = {}
    for f in result.findings:
        tree.setdefault(f.path, []).append((f.id, f.line, f.kind, f.category, f.enables))
    paths = sorted(tree)
    # Every file with findings in 0.5.10 (55); an evenly spread sample of 0.5.23's ~190 keeps this under a minute.
    for rel in paths if len(paths) <= 60 else paths[:: len(paths) // 40]:
        alone = audit(str(root / rel), native=False)
        assert [(f.id, f.line, f.kind, f.category, f.enables) for f in alone.findings] == tree[rel], rel
