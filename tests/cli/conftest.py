"""What the CLI tests of several commands share: `empty_cwd`, a fresh working directory and cache
directory, where a command that writes nothing unasked leaves nothing."""

import pytest


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TPFUSE_CACHE_DIR", str(tmp_path / "cache"))  # no dispatch table: the default is used
    return work
