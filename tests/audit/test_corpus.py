"""The labelled corpus of engine conditionals: recall and precision of SM120-excluding gates.

Targets (the audit's acceptance figures): recall >= 0.95 (Python) and >= 0.9 (C++/CUDA/CMake),
precision >= 0.95; each case's category and architecture set match its label in >= 95% of cases.
`benchmarks/bench_audit.py --corpus` writes the same figures as rows to benchmarks/results/.
"""

from __future__ import annotations

import pytest

from .corpus_harness import load, score


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    return score(tmp_path_factory.mktemp("corpus"))


def test_corpus_size_and_labels():
    py, native = load("python_cases.txt"), load("native_cases.txt")
    assert len(py) + len(native) >= 150
    assert {c.category for c in py + native} <= {"gate", "inverse", "none"}
    engines = {c.origin.split()[0] for c in py + native}
    assert {"sglang", "vllm", "flashinfer", "tensorrt_llm"} <= engines


@pytest.mark.parametrize("lang,min_recall", [("python", 0.95), ("native", 0.9)])
def test_recall_and_precision(scored, lang, min_recall):
    s = scored[lang]
    assert s["positives"] >= 9
    assert s["recall"] >= min_recall, s["misses"]
    assert s["precision"] >= 0.95, s["misses"]
    assert s["exact"] >= 0.95, s["misses"]
