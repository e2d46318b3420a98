"""Abstract values the audit evaluator computes for Python expressions.

Besides `ArchBool` / `ArchNum` (arch.py) an expression evaluates to a plain constant, a reference
to a module (inside the target, resolvable; or external), a function defined in the target (which
the evaluator may inline), a partial application, a seeded function or object (predicates.py), or
`UNKNOWN`. Nothing here executes target code.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class _Unknown:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = _Unknown()


@dataclass(frozen=True)
class Const:
    """A literal value: int, float, str, bool, None, or a tuple/list of those."""

    value: Any


@dataclass(frozen=True)
class ModuleRef:
    """A module of the target, by dotted name (attributes resolve through the resolver)."""

    name: str


@dataclass(frozen=True)
class External:
    """A dotted name outside the target (`torch.cuda.get_device_capability`)."""

    dotted: str

    @property
    def last(self) -> str:
        return self.dotted.rsplit(".", 1)[-1]


@dataclass(frozen=True, eq=False)
class UserFunc:
    """A `def` in the target; `module` is the dotted name of the module that defines it."""

    module: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    attrs: dict | None = None  # a method's class attributes (`cls.X` / `self.X` inside it)
    bound: bool = False  # a method called through its class or instance: its first parameter is implicit

    @property
    def name(self) -> str:
        return self.node.name


@dataclass(frozen=True, eq=False)
class UserClass:
    """A `class` in the target: `Cls.method(...)` calls its method (the class's `cls` implicit)."""

    module: str
    node: ast.ClassDef

    def method(self, name: str) -> UserFunc | None:
        for stmt in self.node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in stmt.decorator_list)
                return UserFunc(self.module, stmt, None, bound=not static)
        return None


@dataclass(frozen=True)
class LazyImport:
    """`from <module> import <name>` inside a def: resolved (from the scanned module) when a condition reads it."""

    module: str | None
    level: int
    name: str


@dataclass(frozen=True, eq=False)
class Partial:
    """`functools.partial(func, *args, **kwargs)`, kept so that calling it binds the keywords."""

    func: Any
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class SeedFn:
    """A function whose meaning is seeded (predicates.py): `call(args, kwargs) -> value`."""

    name: str
    call: Callable[[list, dict], Any]
    weak: bool = False


@dataclass(frozen=True, eq=False)
class Obj:
    """An object with seeded attributes (a platform object): `attr(name) -> value`."""

    name: str
    attr: Callable[[str], Any]
