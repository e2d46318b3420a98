"""benchmarks/bench_tree.py counts the package as its source stands: every module once, no import
circle (tests/test_layering.py's graph), and its JSON agrees with its table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_tree.py"), *args], check=True,
                          capture_output=True, text=True, cwd=ROOT).stdout


def test_counts_every_module_once_and_no_circle():
    shape = json.loads(_run("--json"))
    modules = list((ROOT / "src" / "tpfuse").rglob("*.py"))
    assert shape["modules"] == len(modules)
    assert shape["lines"] == sum(len(p.read_text().splitlines()) for p in modules)
    assert sum(p["lines"] for p in shape["packages"].values()) == shape["lines"]
    assert shape["import_circles"] == []
    assert 0 <= shape["internal_imports_inside_functions"] <= shape["internal_imports"]
    assert shape["largest_modules"][0]["lines"] >= shape["median_module_lines"]
    table = _run()
    assert f"{shape['lines']} lines in {shape['modules']} modules" in table
