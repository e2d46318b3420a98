"""The labelled corpus of conditions quoted from released engine trees (corpus_harness.py).

Targets (the audit's acceptance figures on SM120): recall >= 0.95 of the Python gates that exclude
it, >= 0.9 of the C++/CUDA ones, precision >= 0.95; the file audited alone gives the verdicts the
tree gives. `benchmarks/bench_audit.py --corpus` writes the same figures as rows to
benchmarks/results/; `test_the_real_trees_agree` scores the labels on the trees themselves when
they are on disk.
"""

from __future__ import annotations

import re

import pytest

from tpfuse.audit.arch import parse_arch

from .corpus_harness import FAMILIES, TREE_DIRS, load, score, score_trees, trees

SM120 = parse_arch("sm120")
_NEGATED = re.compile(r"\bnot\b|!=|\bnot in\b")


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
    # A family's positives: gates excluding SM120; for inverse gates (F5), inverse gates off there; for quirks (F6), quirks.
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
