"""docs/ARCHITECTURE.md stays true: one line for every module and benchmark, none for a file that is gone."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
LISTED = set(re.findall(r"^- `([^`]+)`: ", DOC, flags=re.M))


def test_every_module_and_benchmark_has_its_line():
    modules = {"tpfuse/" + p.relative_to(ROOT / "src" / "tpfuse").as_posix()
               for p in (ROOT / "src" / "tpfuse").rglob("*.py")}
    scripts = {p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks").glob("*.py")}
    scripts |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks" / "device").iterdir() if p.is_file()}
    missing = sorted((modules | scripts) - LISTED)
    assert not missing, f"docs/ARCHITECTURE.md has no line for {', '.join(missing)}"


def test_every_listed_path_exists():
    gone = sorted(p for p in LISTED if not ((ROOT / "src" / p).exists() or (ROOT / p).exists()))
    assert not gone, f"docs/ARCHITECTURE.md lists files that do not exist: {', '.join(gone)}"
