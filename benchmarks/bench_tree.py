"""The shape of the package, counted from its source (nothing is imported or run): lines per
package, median and largest modules, internal imports (and how many sit inside functions), import
circles, lines longer than the line length, and test files that do not mirror a module.

    python benchmarks/bench_tree.py [--json]

The import graph and the circles are tests/test_layering.py's (the same reading of imports, lazy
ones included); the test-file rule is tests/test_layout.py's.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE_LENGTH = 120


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _imports_by_place(path: Path) -> tuple[int, int]:
    """(tpfuse imports at module level, tpfuse imports inside a function) of one file."""
    top = inside = 0

    def visit(node, in_function: bool) -> None:
        nonlocal top, inside
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or ""]
                if getattr(child, "level", 0) or any(n.split(".")[0] == "tpfuse" for n in names):
                    inside, top = (inside + 1, top) if in_function else (inside, top + 1)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text()), False)
    return top, inside


def tree_shape() -> dict:
    layering, layout = _load("test_layering"), _load("test_layout")
    lines: dict[str, list[int]] = defaultdict(list)
    top = inside = long_lines = 0
    for module, path in sorted(layering.MODULES.items()):
        package = module.split(".")[1] if module.count(".") and path.parent.name != "tpfuse" else "tpfuse (top level)"
        text = path.read_text()
        lines[package].append(len(text.splitlines()))
        t, i = _imports_by_place(path)
        top, inside = top + t, inside + i
        long_lines += sum(len(line) > LINE_LENGTH for line in text.splitlines())
    sizes = sorted((len(p.read_text().splitlines()), m) for m, p in layering.MODULES.items())
    graph = {m: layering.imports_of(m) for m in layering.MODULES}
    tests = layout._test_paths()
    stray = [str(t) for t in tests if str(t) not in layout.REPOSITORY_WIDE and not layout.mirrors(t)]
    return {
        "packages": {name: {"modules": len(v), "lines": sum(v)} for name, v in sorted(lines.items())},
        "modules": len(sizes),
        "lines": sum(n for n, _ in sizes),
        "median_module_lines": statistics.median(n for n, _ in sizes),
        "largest_modules": [{"module": m, "lines": n} for n, m in sizes[-5:][::-1]],
        "internal_imports": top + inside,
        "internal_imports_inside_functions": inside,
        "import_circles": layering.strongly_connected(graph),
        "lines_over_line_length": long_lines,
        "test_files": len(tests),
        "test_files_not_mirroring_a_module": sorted(stray),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    args = p.parse_args(argv)
    shape = tree_shape()
    if args.json:
        print(json.dumps(shape, indent=1))
        return 0
    for name, pkg in shape["packages"].items():
        print(f"{pkg['lines']:7d} lines  {pkg['modules']:3d} modules  {name}")
    print(f"{shape['lines']:7d} lines in {shape['modules']} modules; median {shape['median_module_lines']:g}; largest: "
          + ", ".join(f"{m['module']} {m['lines']}" for m in shape["largest_modules"]))
    print(f"internal imports {shape['internal_imports']}, inside functions "
          f"{shape['internal_imports_inside_functions']}; import circles {len(shape['import_circles'])}; "
          f"lines over {LINE_LENGTH} columns {shape['lines_over_line_length']}; test files {shape['test_files']}, "
          f"not mirroring a module {len(shape['test_files_not_mirroring_a_module'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
