"""driver.py: `audit()` of a tree or a file: skipped files, the selection for `--arch` / `--like`,
stable IDs, the file alone agreeing with the tree, report-only audits; the labelled corpus's recall
and precision (corpus_harness.py); the real sglang source.

Corpus targets (the audit's acceptance figures on SM120): recall >= 0.95 of the Python gates that
exclude it, >= 0.9 of the C++/CUDA ones, precision >= 0.95; the file audited alone gives the
verdicts the tree gives. `benchmarks/bench_audit.py --corpus` writes the same figures as rows to
benchmarks/results/; `test_the_real_trees_agree` scores the labels on the trees themselves when
they are on disk.

The sglang tests are slow (whole-engine audits) and skip with the pip error when PyPI is
unreachable; the source is cached outside the repository (sglang_source.py says where).
"""

from __future__ import annotations

import re

import pytest

from tpfuse.audit.arch import parse_arch
from tpfuse.audit.driver import audit
from tpfuse.audit.patch import propose_patch

from .conftest import FIXTURES
from .corpus_harness import FAMILIES, TREE_DIRS, load, score, score_trees, trees
from .sglang_source import ADD_NORM, runtime_gate, sglang_source

SM120, SM100 = parse_arch("sm120"), parse_arch("sm100")
_NEGATED = re.compile(r"\bnot\b|!=|\bnot in\b")


def test_syntax_error_file_is_reported_and_skipped(result):
    assert [s["path"] for s in result.skipped] == ["broken.py"]
    assert "SyntaxError" in result.skipped[0]["error"]


def test_always_true_conditions_are_not_gates(result):
    # `>= (9, 0)` and `has_device_capability(90)` include SM12x: nothing to report for sm120.
    sm120 = parse_arch("sm120")
    for part in (">= (9, 0)", "has_device_capability(90)", "get_device_sm() >= 90"):
        hits = [f for f in result.findings if part in f.condition]
        assert hits and all(f.values["sm120"] is True for f in hits)
        assert not [f for f in result.selected(sm120) if part in f.condition]


def test_selection_with_like(result):
    sm120, sm100, sm90 = parse_arch("sm120"), parse_arch("sm100"), parse_arch("sm90")
    like_sm100 = result.selected(sm120, sm100)
    assert all(f.values["sm120"] is False and f.values["sm100"] is not False for f in like_sm100)
    assert any("major >= 9 and major < 10" in f.condition for f in result.selected(sm120, sm90))
    assert not any("major >= 9 and major < 10" in f.condition for f in like_sm100)
    assert all(f.category == "gate" for f in result.selected(sm120))


def test_ids_are_stable_and_unique(result):
    again = audit(str(FIXTURES / "fakeengine"))
    assert [f.id for f in again.findings] == [f.id for f in result.findings]
    assert len({f.id for f in result.findings}) == len(result.findings)


def test_single_file_and_tree_agree_on_every_file(result):
    tree: dict = {}
    for f in result.findings:
        if not f.report_only:
            tree.setdefault(f.path, []).append((f.id, f.line, f.kind, f.category, f.enables))
    for rel, expected in tree.items():
        alone = audit(str(FIXTURES / "fakeengine" / rel), native=False)
        assert [(f.id, f.line, f.kind, f.category, f.enables) for f in alone.findings] == expected, rel


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


@pytest.fixture(scope="module")
def cases():
    return load("python_cases.txt") + load("native_cases.txt")


@pytest.fixture(scope="module")
def scored(tmp_path_factory, cases):
    return score(tmp_path_factory.mktemp("corpus"), cases=cases)


def test_the_corpus_is_large_quoted_from_released_trees_and_covers_every_family(cases):
    assert len(cases) >= 250
    assert {c.origin for c in cases} == set(TREE_DIRS)  # every case names its release and file:line
    assert {c.category for c in cases} <= {"gate", "inverse", "quirk", "none"}
    # A family's positives: gates excluding SM120; for inverse gates (F5), inverse gates off there; for quirks (F6),
    # quirks.
    wanted = {"F5": "inverse", "F6": "quirk"}
    for family in FAMILIES:
        mine = [c for c in cases if c.family == family]
        kind = wanted.get(family, "gate")
        positives = [c for c in mine if c.category == kind and (kind == "quirk" or SM120.name not in c.expected())]
        negatives = [c for c in mine if c not in positives]
        negated = [c for c in mine if c.category == "inverse"
                   or _NEGATED.search(c.files[c.main].split("\n")[c.line - 1])]
        assert positives and negatives and negated, family


@pytest.mark.parametrize("lang,min_recall", [("python", 0.95), ("native", 0.9)])
def test_recall_and_precision_of_gates_that_exclude_sm120(scored, lang, min_recall):
    s = scored[lang]
    assert s["positives"] >= 15
    assert s["recall"] >= min_recall, s["misses"]
    assert s["precision"] >= 0.95, s["misses"]


def test_a_file_audited_alone_gives_the_tree_verdicts(scored):
    assert scored["python"]["identical"], [m for m in scored["python"]["misses"] if not m.get("identical", True)]


@pytest.mark.slow
def test_the_real_trees_agree(cases):
    found = trees()
    if not found:
        pytest.skip("no released tree under $TPFUSE_AUDIT_TREES (~/.cache/tpfuse-audit-trees)")
    s = score_trees(cases=cases)
    for lang in ("python", "native"):
        assert s[lang]["recall"] >= (0.95 if lang == "python" else 0.9), s[lang]["misses"]
        assert s[lang]["precision"] >= 0.95, s[lang]["misses"]



@pytest.fixture(scope="module")
def full(source):
    return audit(str(source), native=False)


@pytest.mark.slow
def test_finds_the_allreduce_fusion_gate_excluding_sm120(full):
    gate = runtime_gate(full)
    assert "(_is_sm90_supported or _is_sm100_supported)" in gate.condition
    assert gate.category == "gate" and gate.kind == "return"
    # _is_sm90_supported = _is_cuda and get_platform().is_sm90 -> _PLATFORM_PROBES -> majors [9]
    assert gate.values["sm120"] is False and gate.values["sm121"] is False and gate.values["sm80"] is False
    assert gate.values["sm90"] is not False and gate.values["sm100"] is not False and gate.values["sm103"] is not False
    assert gate in full.selected(SM120, SM100)
    assert not full.skipped, full.skipped  # every file of the release parses


@pytest.mark.slow
def test_finds_the_startup_auto_enable_gate(full):
    hits = [f for f in full.selected(SM120, SM100) if f.scope.endswith("_flashinfer_allreduce_fusion_auto_enable")
            and "is_sm90 or" in f.condition]
    assert len(hits) == 1
    assert "flashinfer_allreduce_fusion_backend" in hits[0].guards


# The story's three gates in each release: (path, scope suffix, condition fragment).
STORY = {
    "0.5.10": [
        ("srt/layers/communicator.py", "apply_flashinfer_allreduce_fusion",
         "(_is_sm90_supported or _is_sm100_supported)"),
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
        hits = [f for f in result.findings if f.path.endswith(path.split("/")[-1]) and f.scope.endswith(scope)
                and fragment in f.condition]
    assert len(hits) == 1, [(f.path, f.line, f.scope, f.condition[:60]) for f in hits]
    return hits[0]


@pytest.fixture(scope="module", params=sorted(STORY))
def release(request):
    path, why = sglang_source(request.param)
    if path is None:
        pytest.skip(f"sglang {request.param} source unavailable: {why}")
    return request.param, path, audit(str(path), native=False)


@pytest.mark.slow
def test_all_six_story_gates_found_excluding_sm120_and_patchable(release):
    version, root, result = release
    gates = [_story_gate(result, root, *spec) for spec in STORY[version]]
    selected = result.selected(SM120, SM100)
    for gate in gates:
        assert gate.category == "gate" and gate.values["sm120"] is False and gate.values["sm100"] is not False
        assert gate in selected
    proposal = propose_patch(result, gates, SM120, SM100)
    assert not proposal.errors and sorted(proposal.plans) == sorted(g.id for g in gates)


@pytest.mark.slow
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
