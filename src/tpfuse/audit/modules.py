"""A parsed target module (`ModuleInfo`), its top-level bindings, and its dotted name on disk.

`module_name_for` names a file the way its imports name it: walking up through packages, and
through namespace directories (no `__init__.py`) up to the top package that its text imports
absolutely. `collect_bindings` records the first binding of every top-level name (assignments,
imports, defs, and the bodies of top-level `if`/`try`).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

# How far above a namespace directory its top package may be (sglang 0.5.23:
# kernels/ops/attention/minimax_sparse/decode/ is 5 below sglang/).
_NAMESPACE_DEPTH = 8


@dataclass
class ModuleInfo:
    """One parsed module: its tree, source lines and top-level bindings (first binding wins)."""

    name: str
    path: Path
    source: str
    tree: ast.Module
    is_package: bool
    arch_offsets: list = field(default_factory=list)  # where ARCH_RE tokens start in `source`'s code (characters)
    textmap: object = None  # parse.TextMap of `source` (line offsets), dropped with the tree
    hidden: list = field(default_factory=list)  # [first, last) 0-based line ranges the selective parse left out
    hot: set = field(default_factory=set)  # top-level names tied to the architecture (parse.py)
    bindings: dict = field(default_factory=dict)
    stars: list = field(default_factory=list)

    _lines: list | None = None

    def text_of(self, node: ast.AST) -> str:
        if self._lines is None:
            self._lines = self.source.split("\n")
        return "\n".join(self._lines[node.lineno - 1: getattr(node, "end_lineno", node.lineno)])

    def release_lines(self) -> None:
        self._lines = None

    def hides(self, names: set) -> bool:
        """Does a part the selective parse left out mention one of `names`?"""
        if self._lines is None:
            self._lines = self.source.split("\n")
        return any(name in line for a, b in self.hidden for line in self._lines[a:b] for name in names)


def module_name_for(path: Path, heads=None, *, packages: dict | None = None) -> tuple[str, Path]:
    """(dotted module name, import root) of a .py file, walking up while `__init__.py` exists.

    Above the first directory without `__init__.py`, an ancestor package that the module text
    `heads()` imports absolutely (`from sglang.srt...`) is the top package, and the directories between are
    namespace packages (PEP 420; sglang 0.5.10 ships `srt/` and `srt/models/` so): without this,
    two `server_args.py` of one tree would both be called `server_args`. `packages` (directory ->
    whether it holds `__init__.py`) is shared by the calls for one tree, so each directory above
    its files is probed once, not once for each directory below it."""
    packages = {} if packages is None else packages

    def is_package(directory: Path) -> bool:
        key = str(directory)
        if key not in packages:
            packages[key] = (directory / "__init__.py").exists()
        return packages[key]

    path = path.resolve()
    parts = [] if path.name == "__init__.py" else [path.stem]
    parent = path.parent
    while is_package(parent):
        parts.insert(0, parent.name)
        parent = parent.parent
    ups = [up for up in parent.parents[:_NAMESPACE_DEPTH] if is_package(up)]
    text = heads() if heads is not None and ups else ""
    for up in ups if text else ():
        if re.search(rf"^\s*(?:from|import)\s+{re.escape(up.name)}\b", text, re.MULTILINE):
            gap = path.parent.relative_to(up.parent).parts
            return ".".join([*gap, *parts[-1:]] if path.name != "__init__.py" else gap), up.parent
    return ".".join(parts) or path.stem, parent


def collect_bindings(info: ModuleInfo, body: list) -> None:
    for stmt in body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if stmt.value is None:
                continue
            for target in targets:
                if isinstance(target, ast.Name):
                    info.bindings.setdefault(target.id, ("assign", stmt.value, None))
                elif isinstance(target, ast.Tuple):
                    for i, elt in enumerate(target.elts):
                        if isinstance(elt, ast.Name):
                            info.bindings.setdefault(elt.id, ("assign", stmt.value, i))
        elif isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if alias.name == "*":
                    info.stars.append((stmt.module, stmt.level))
                else:
                    info.bindings.setdefault(alias.asname or alias.name, ("from", stmt.module, stmt.level, alias.name))
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname:
                    info.bindings.setdefault(alias.asname, ("import", alias.name))
                else:
                    top = alias.name.split(".")[0]
                    info.bindings.setdefault(top, ("import", top))
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            info.bindings.setdefault(stmt.name, ("def", stmt))
        elif isinstance(stmt, ast.If):
            if not (isinstance(stmt.test, (ast.Name, ast.Attribute))
                    and ast.unparse(stmt.test).endswith("TYPE_CHECKING")):
                # `if TYPE_CHECKING:` declares types, and defaults that are not what runs
                collect_bindings(info, stmt.body)
            collect_bindings(info, stmt.orelse)
        elif isinstance(stmt, ast.Try):
            collect_bindings(info, stmt.body)
            for handler in stmt.handlers:
                collect_bindings(info, handler.body)
            collect_bindings(info, stmt.orelse)


