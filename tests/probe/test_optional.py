"""The probe's optional packages (`tpfuse.probe.optional`): a missing package, one whose import
fails, and a submodule of a missing parent, each with its reason."""

from __future__ import annotations

import sys

from tpfuse.probe.optional import OptionalPackage, read_package


def test_optional_package_missing_and_broken(tmp_path, monkeypatch):
    missing = read_package(OptionalPackage("nothere", "tpfuse_no_such_module", ("nothere",), "pip install nothere"))
    assert (missing.available, missing.reason) == (False, "not installed (pip install nothere)")
    (tmp_path / "tpfuse_broken_pkg.py").write_text("raise OSError('libfoo.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = read_package(OptionalPackage("broken", "tpfuse_broken_pkg", ("broken",), "pip install broken",
                                          import_check=True))
    assert not broken.available
    assert broken.reason == "installed but import failed: OSError: libfoo.so: cannot open shared object file"
    sys.modules.pop("tpfuse_broken_pkg", None)
    parentless = read_package(OptionalPackage("x", "tpfuse_no_parent.sub", ("x",), "pip install x"))
    assert parentless.reason == "not installed (pip install x)"
