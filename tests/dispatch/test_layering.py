"""Layering: the library never imports its CLI, and the run-time selection never imports the measuring.

Scans the imports (ast, so lazy imports inside functions count too) of every module under
src/fusegate outside `fusegate.cli`. `fusegate/__main__.py` runs the CLI and is the one exception.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "fusegate"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, absolute names (relative imports resolved against its package)."""
    package = ".".join(("fusegate", *path.relative_to(PACKAGE).parent.parts))
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base]) if base else ".".join(parent)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def library_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if p.relative_to(PACKAGE).parts[0] != "cli" and p.relative_to(PACKAGE) != Path("__main__.py"))


def test_the_scan_sees_imports_inside_functions_and_relative_ones(tmp_path):
    module = PACKAGE / "tune" / "tuner.py"
    assert "fusegate.dispatch.table" in imported_modules(module)
    assert "fusegate.probe" in imported_modules(module)  # imported inside tune_in_group


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_library_module_imports_the_cli(path):
    cli = sorted(name for name in imported_modules(path) if name == "fusegate.cli" or name.startswith("fusegate.cli."))
    assert not cli, f"{path.relative_to(PACKAGE)} imports {', '.join(cli)}; the library must not depend on its CLI"


@pytest.mark.parametrize("path", sorted((PACKAGE / "dispatch").glob("*.py")), ids=lambda p: p.name)
def test_dispatch_does_not_import_the_measuring_side(path):
    tune = sorted(name for name in imported_modules(path) if name == "fusegate.tune" or name.startswith("fusegate.tune."))
    assert not tune, f"dispatch/{path.name} imports {', '.join(tune)}; run-time selection must not need tune/"


def test_the_scan_would_catch_a_cli_import():
    # The check itself: a module like the former tune/cli_common.py is reported.
    source = "from fusegate.cli.main import UsageError\n"
    assert "fusegate.cli.main" in {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
