"""Layering: the library never imports its CLI, and serving a call never imports the measuring side.

Scans the imports (ast, so lazy imports inside functions count too) of every module under
src/tpfuse outside `tpfuse.cli`. `tpfuse/__main__.py` runs the CLI and is the one exception.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "tpfuse"


def imported_modules(source: str, package: str) -> set[str]:
    """Every module `source` (of a module in `package`) imports, as absolute names."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = parts[: len(parts) - node.level + 1]
                base = ".".join([*parent, base]) if base else ".".join(parent)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def imports_of(path: Path) -> set[str]:
    package = ".".join(("tpfuse", *path.relative_to(PACKAGE).parent.parts))
    return imported_modules(path.read_text(), package)


def library_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if p.relative_to(PACKAGE).parts[0] != "cli" and p.relative_to(PACKAGE) != Path("__main__.py"))


def test_the_scan_sees_lazy_and_relative_imports():
    source = "import os\nfrom . import table\ndef f():\n    from ..cli.main import UsageError\n"
    assert imported_modules(source, "tpfuse.dispatch") == {
        "os", "tpfuse.dispatch", "tpfuse.dispatch.table", "tpfuse.cli.main", "tpfuse.cli.main.UsageError"}
    assert "tpfuse.kernels.custom_ops" in imports_of(PACKAGE / "strategies" / "peer.py")  # inside a method


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_library_module_imports_the_cli(path):
    cli = sorted(name for name in imports_of(path) if name == "tpfuse.cli" or name.startswith("tpfuse.cli."))
    assert not cli, f"{path.relative_to(PACKAGE)} imports {', '.join(cli)}; the library must not depend on its CLI"


# What a Communicator needs to serve a call: its module, the group facts and the selection runtime.
RUN_TIME = [PACKAGE / "api.py", PACKAGE / "group.py", *sorted((PACKAGE / "dispatch").glob("*.py"))]


@pytest.mark.parametrize("path", RUN_TIME, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_run_time_does_not_import_the_measuring_side(path):
    tune = sorted(name for name in imports_of(path) if name == "tpfuse.tune" or name.startswith("tpfuse.tune."))
    assert not tune, f"{path.relative_to(PACKAGE)} imports {', '.join(tune)}; serving a call must not need tune/"
