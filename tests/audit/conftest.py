"""Audit tests: fixture engines are data, never collected or imported; what several test files share."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tpfuse.audit.arch import ARCHS
from tpfuse.audit.driver import audit

from .sglang_source import SGLANG_VERSION, sglang_source

collect_ignore_glob = ["fixtures/*"]

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def engine(tmp_path) -> Path:
    """A writable copy of the fakeengine fixture package (patch tests write into it)."""
    dest = tmp_path / "src" / "fakeengine"
    shutil.copytree(FIXTURES / "fakeengine", dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@pytest.fixture
def state_dir(tmp_path) -> Path:
    return tmp_path / "state"


@pytest.fixture(scope="module")
def result():
    """The audit of the fakeengine fixture as it is, once per test module (tests only read it)."""
    return audit(str(FIXTURES / "fakeengine"))


def names(pred, unknown=False) -> list:
    """The architectures where `pred(arch)` holds, in ARCHS order; each marked `?` when `unknown`."""
    return [a.name + ("?" if unknown else "") for a in ARCHS if pred(a)]


def find(result, path, condition_part, kind=None):
    """The one finding of `path` whose condition contains `condition_part` (and of `kind`, if given)."""
    hits = [f for f in result.findings
            if f.path == path and condition_part in f.condition and (kind is None or f.kind == kind)]
    assert len(hits) == 1, [(f.line, f.condition) for f in result.findings if f.path == path]
    return hits[0]


@pytest.fixture(scope="module")
def source():
    """The extracted source of sglang SGLANG_VERSION (skipped with the reason when unavailable)."""
    path, why = sglang_source()
    if path is None:
        pytest.skip(f"sglang {SGLANG_VERSION} source unavailable: {why}")
    return path
