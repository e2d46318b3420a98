"""Audit tests: fixture engines are data, never collected or imported."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

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
