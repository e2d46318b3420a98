"""The package's layers (docs/ARCHITECTURE.md, "Layers"): every module sits in one layer, imports
only modules of its own layer or below, and no import circle exists between modules.

Imports are read with ast, so an import inside a function counts as much as one at the top: a
lazy import hides a dependency from the reader, not from this test. A module imports what its
`import` or `from ... import` statements name (`from tpfuse.x import y` imports tpfuse.x.y when y is
a module, else tpfuse.x); `if TYPE_CHECKING:` imports count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tpfuse"

# Lowest first. A module is placed by its longest listed prefix (a folder places all its modules).
LAYERS: list[tuple[str, list[str]]] = [
    ("facts", ["tpfuse", "tpfuse._version", "tpfuse.spec", "tpfuse.env", "tpfuse.quant", "tpfuse.presets",
               "tpfuse.host_memory"]),
    ("meaning, kernels and tools", ["tpfuse.validation", "tpfuse.reference", "tpfuse.timing", "tpfuse.results",
                                    "tpfuse.rank_setup", "tpfuse.kernels", "tpfuse.audit", "tpfuse.diagnose"]),
    ("probe and strategies", ["tpfuse.probe", "tpfuse.strategies"]),
    ("agreement and selection", ["tpfuse.group", "tpfuse.dispatch", "tpfuse.correctness", "tpfuse.spawn"]),
    ("the Communicator", ["tpfuse.api"]),
    ("users of the Communicator", ["tpfuse.selftest", "tpfuse.tune", "tpfuse.models", "tpfuse.e2e",
                                   "tpfuse.integrations"]),
    ("command line", ["tpfuse.cli", "tpfuse.__main__"]),
]


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = module_names()


def imported_modules(source: str, package: str) -> set[str]:
    """Every name `source` (of a module in `package`) imports, as absolute dotted names."""
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


def module_of(name: str) -> str | None:
    """The tpfuse module a dotted name lives in (the name itself, or the longest module prefix)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = {module_of(n) for n in imported_modules(path.read_text(), package) if n.split(".")[0] == "tpfuse"}
    return found - {None, module}


def layer_of(module: str) -> int | None:
    best, layer = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), index
    return layer


def test_the_scan_sees_lazy_relative_and_type_checking_imports():
    source = ("import os\nfrom . import table\nif TYPE_CHECKING:\n    from tpfuse.spec import Op\n"
              "def f():\n    from ..cli.main import UsageError\n")
    assert imported_modules(source, "tpfuse.dispatch") == {
        "os", "tpfuse.dispatch", "tpfuse.dispatch.table", "tpfuse.spec", "tpfuse.spec.Op", "tpfuse.cli.main",
        "tpfuse.cli.main.UsageError"}
    assert module_of("tpfuse.dispatch.table.DispatchTable") == "tpfuse.dispatch.table"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_imports_only_its_layer_and_below(module):
    layer = layer_of(module)
    assert layer is not None, f"{module} is in no layer: add it to LAYERS here and to docs/ARCHITECTURE.md"
    above = sorted(m for m in imports_of(module) if (layer_of(m) or 0) > layer)
    assert not above, (f"{module} ({LAYERS[layer][0]}) imports {', '.join(above)} from a higher layer; move the "
                       "shared name down, or the module up")


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (the import circles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_strongly_connected_finds_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    source = "def later():\n    from tpfuse.spec import Op\n"
    assert "tpfuse.spec" in {module_of(n) for n in imported_modules(source, "tpfuse")}


def test_no_import_circles_counting_imports_inside_functions():
    graph = {m: imports_of(m) for m in MODULES}
    circles = strongly_connected(graph)
    assert not circles, "import circles (a name two modules need belongs below both): " + "; ".join(
        " <-> ".join(c) for c in circles)


def documented_layers() -> list[tuple[str, list[str]]]:
    """The layers table of docs/ARCHITECTURE.md as (name, modules): `kernels/` is tpfuse.kernels,
    `tpfuse` (`__init__`) the package itself."""
    text = (PACKAGE.parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0][:1].isdigit():
            continue
        names = [n.rstrip("/") for n in cells[1].split("`")[1::2] if n != "__init__"]
        layers.append((cells[0].split(". ", 1)[1], [n if n == "tpfuse" else f"tpfuse.{n}" for n in names]))
    return layers


def test_the_architecture_document_lists_these_layers():
    assert documented_layers() == [(name, list(prefixes)) for name, prefixes in LAYERS], (
        "docs/ARCHITECTURE.md's Layers table and LAYERS here differ: change both together")
