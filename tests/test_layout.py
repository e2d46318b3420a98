"""tests/ mirrors src/ (docs/ARCHITECTURE.md, `tests/`), whatever the tier of a test (tiers are
markers, tests/conftest.py):

- tests of src/tpfuse/<folder>/<module>.py live in tests/<folder>/test_<module>.py;
- of a top-level module src/tpfuse/<module>.py in tests/test_<module>.py;
- of a package's __init__.py in tests/<folder>/test_<folder>.py (of tpfuse/__init__.py: tests/test_tpfuse.py);
- of a benchmark script benchmarks/bench_<x>.py in tests/benchmarks/test_bench_<x>.py.

Tests of the repository as a whole sit at the top of tests/ under names that say what they check
(REPOSITORY_WIDE). Every folder of test files is a package, so two folders may hold test files of
the same name (tests/cli/test_profile.py and tests/e2e/test_profile.py).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PACKAGE = ROOT / "src" / "tpfuse"

# The top-level test files that test no one module, and what each checks.
REPOSITORY_WIDE = {
    "test_architecture_doc.py": "docs/ARCHITECTURE.md has a line for every module and benchmark",
    "test_examples.py": "examples/ run as a user runs them, and the README quotes them as they are",
    "test_layering.py": "every module sits in one layer and no import circle exists",
    "test_layout.py": "tests/ mirrors src/ (this file)",
    "test_packaging.py": "the declared dependencies, and .ci/run runs the README's set-up commands",
    "test_readme_figures.py": "the README's figures are rebuilt from the rows they name",
}
# Engine-shaped source trees that the audit tests scan, not tests (tests/audit/conftest.py keeps
# pytest out of them).
NOT_TESTS = ("audit/fixtures",)


def _test_paths() -> list[PurePosixPath]:
    """Every test_*.py under tests/, relative to it."""
    paths = (PurePosixPath(p.relative_to(TESTS).as_posix()) for p in TESTS.rglob("test_*.py"))
    return sorted(p for p in paths if not any(p.is_relative_to(skip) for skip in NOT_TESTS))


def mirrors(rel: PurePosixPath) -> bool:
    """Whether tests/`rel` is named after what it tests, by the rule of the module docstring."""
    name = rel.stem.removeprefix("test_")
    folders = rel.parent.parts
    if not folders:
        return name == "tpfuse" or (PACKAGE / f"{name}.py").is_file()
    if folders == ("benchmarks",):
        return name.startswith("bench_") and (ROOT / "benchmarks" / f"{name}.py").is_file()
    package = PACKAGE.joinpath(*folders)
    if name == folders[-1]:
        return (package / "__init__.py").is_file()
    return name != "__init__" and (package / f"{name}.py").is_file()


def test_every_test_file_mirrors_a_module_or_a_benchmark():
    stray = [str(rel) for rel in _test_paths()
             if str(rel) not in REPOSITORY_WIDE and not mirrors(rel)]
    assert not stray, (f"{', '.join(stray)}: name each test file after the module it tests (tests/<folder>/"
                       "test_<module>.py, see tests/test_layout.py), or move its tests into that file")


def test_every_folder_of_test_files_is_a_package():
    bare = sorted({str(rel.parent) for rel in _test_paths() if rel.parent.parts}
                  - {str(p.parent.relative_to(TESTS)) for p in TESTS.rglob("__init__.py")})
    assert not bare, (f"{', '.join(bare)}: add an __init__.py, so that its test files may share names "
                      "with those of other folders")


def test_every_import_of_a_test_module_names_one_that_exists():
    """A GPU test that imports a helper of another test file runs only on a GPU machine: a file
    renamed or merged would leave it failing there and nowhere else. Every `tests.` import, at
    module level or inside a function, names a module or package under tests/."""
    import ast

    missing = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS)
        if any(PurePosixPath(rel.as_posix()).is_relative_to(skip) for skip in NOT_TESTS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name == "tests" or not name.startswith("tests."):
                    continue
                target = ROOT.joinpath(*name.split("."))
                if not (target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()):
                    missing.append(f"tests/{rel.as_posix()}:{node.lineno} imports {name}")
    assert not missing, "; ".join(missing) + ": no such test module (renamed or merged?); import it from where it is"
