"""Cross-module name resolution for the audit: module index, top-level bindings, inlining.

A `Resolver` knows the target's import roots (directories from which its top-level packages
import), parses modules on demand (never imports them), and answers "what is name N in module M"
as an abstract value: following `from X import N`, `import X.Y as Z`, star imports, simple and
chained assignments (`is_blackwell_supported = is_blackwell = ...`), tuple unpacking, and `def`s.
Imports are followed only for names that look architecture-related (`ARCH_RE`) so an audit parses
the modules a gate depends on, not the whole import graph; other imported names are unknown.

sglang's `get_platform()` returns a `PlatformContext` whose attributes are looked up in the string
table `_PLATFORM_PROBES` (runtime_context.py); the resolver reads that dict literal from the target
and evaluates the probe it names, so `get_platform().is_sm100` means what the target says it means.
Lookups that fail for a reason a patch would care about (a fact missing from that table) are
recorded in `missing`.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

from tpfuse.audit.arch import ArchBool, ArchNum
from tpfuse.audit.evaluate import Evaluator, ite, seed_for, to_bool
from tpfuse.audit.modules import ModuleInfo, collect_bindings
from tpfuse.audit.parse import parse_selected
from tpfuse.audit.predicates import ALWAYS, sglang_fact
from tpfuse.audit.target import SourceSkip, read_source
from tpfuse.audit.values import UNKNOWN, Const, External, ModuleRef, Obj, SeedFn, UserFunc

# Identifiers that may carry an architecture meaning, from the gate idioms of sglang, vLLM and FlashInfer.
ARCH_RE = re.compile(
    r"sm_?\d{2,3}|sm\d+x|blackwell|hopper|ampere|capabilit|device_sm|sm_version|cuda_arch|"
    r"get_platform|current_platform|device_properties|^_?is_cuda|device_arch|gpu_arch|arch_major|arch_number|arch_code",
    re.IGNORECASE,
)
_FROM_IMPORT_RE = re.compile(r"^[ \t]*from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+\(?([\w ,]+)", re.MULTILINE)
# ARCH_RE for whole-text searches of lower-cased source (no anchors, no IGNORECASE: 5x faster).
_ARCH_TEXT_RE = re.compile(ARCH_RE.pattern.replace("^_?", "").lower())
# The tokens that can make a def's conditions depend on the architecture (ARCH_RE without the
# platform objects and `is_cuda`, which are constant on every audited arch unless an arch token follows).
_CONSTANT_TOKENS = frozenset({"get_platform", "current_platform", "is_cuda"})
_CHUNK_RE = re.compile(_ARCH_TEXT_RE.pattern.replace("get_platform|current_platform|", "").replace("|is_cuda", ""))
# Inlining depth: a call site -> helper -> its one shared checker (sglang's partial) -> a getter.
MAX_DEPTH = 4


class Resolver:
    """Parses target modules on demand and resolves names to abstract values (memoized)."""

    def __init__(self, roots: list[Path], overlay: dict | None = None, within: Path | None = None):
        self.roots = [Path(r).resolve() for r in roots]
        # Only modules under `within` (the audited tree) are parsed: `import torch` stays external.
        self.within = Path(within).resolve() if within else None
        self.overlay = {Path(k).resolve(): v for k, v in (overlay or {}).items()}
        self._modules: dict[str, ModuleInfo | None] = {}
        self._paths: dict[str, Path | None] = {}
        self._values: dict = {}
        self._calls: dict = {}
        self._active: set = set()
        self.errors: dict[Path, str] = {}
        self._root_strs = [str(r) for r in self.roots]
        self._overlay_strs = {str(p) for p in self.overlay}
        self._inlinable: dict = {}
        self.missing: list[str] = []

    # -- modules ------------------------------------------------------------------------
    def path_of(self, name: str) -> Path | None:
        """File of module `name` inside the audited tree, or None (string paths: pathlib was slow here)."""
        if name not in self._paths:
            rel = name.replace(".", os.sep)
            found = None
            within = str(self.within) + os.sep if self.within else ""
            for root in self._root_strs:
                for cand in (os.path.join(root, rel, "__init__.py"), os.path.join(root, rel + ".py")):
                    if within and not cand.startswith(within):
                        continue
                    if cand in self._overlay_strs or os.path.isfile(cand):
                        found = Path(cand)
                        break
                if found:
                    break
            self._paths[name] = found
        return self._paths[name]

    def read(self, path: Path) -> str:
        """Source text of `path` (the overlay's, else the file's, decoded as Python does); SourceSkip if unreadable."""
        try:
            path = path.resolve()
        except (OSError, RuntimeError) as exc:  # RuntimeError: Path.resolve on a symlink loop (Python < 3.13)
            raise SourceSkip("symlink-loop", f"cannot be resolved ({exc})") from None
        if path in self.overlay:
            return self.overlay[path]
        return read_source(path)[0]

    def module(self, name: str, path: Path | None = None) -> ModuleInfo | None:
        if name in self._modules:
            return self._modules[name]
        path = path or self.path_of(name)
        info = None
        if path is not None:
            try:
                source = self.read(path)
                hits = [(m.start(), m.group()) for m in _ARCH_TEXT_RE.finditer(source.lower())]
                tokens = [pos for pos, text in hits if text not in _CONSTANT_TOKENS]
                tree, skipped, hot = parse_selected(source, str(path), tokens, ARCH_RE)
            except SourceSkip as exc:  # unreadable, undecodable or too large: the module is unknown, never fatal
                self.errors[path] = str(exc)
            except (SyntaxError, ValueError, RecursionError) as exc:
                self.errors[path] = f"{type(exc).__name__}: {exc}"
            else:
                info = ModuleInfo(name, path, source, tree, path.name == "__init__.py", arch_offsets=[pos for pos, _ in hits], hot=hot)
                collect_bindings(info, tree.body)
                for skipped_name in skipped:  # a def with no architecture text: bound, but opaque
                    info.bindings.setdefault(skipped_name, ("skipped",))
        self._modules[name] = info
        return info

    def release(self, name: str) -> None:
        """Drop what a scanned module's tree holds that no other module can resolve through:
        the module node and class bodies (a class evaluates to UNKNOWN). Top-level defs stay: the
        selective parse kept only those whose text can hold an architecture condition."""
        info = self._modules.get(name)
        if info is None:
            return
        info.tree = None
        for key, binding in info.bindings.items():
            if binding[0] == "def" and isinstance(binding[1], ast.ClassDef):
                info.bindings[key] = ("skipped",)

    def _can_inline(self, module: str, node) -> bool:
        if id(node) not in self._inlinable:
            info = self.module(module)
            self._inlinable[id(node)] = bool(ARCH_RE.search(node.name) or ARCH_RE.search(info.text_of(node)))
        return self._inlinable[id(node)]

    def absolute(self, module: str, target: str | None, level: int) -> str:
        if not level:
            return target or ""
        info = self.module(module)
        parts = module.split(".")
        package = parts if (info and info.is_package) else parts[:-1]
        base = package[: len(package) - (level - 1)] if level > 1 else package
        return ".".join(base + ([target] if target else []))

    # -- names --------------------------------------------------------------------------
    def global_value(self, module: str, name: str):
        key = (module, name)
        if key in self._values:
            return self._values[key]
        if key in self._active:
            return UNKNOWN
        self._active.add(key)
        try:
            value = self._lookup(module, name)
        finally:
            self._active.discard(key)
        self._values[key] = value
        return value

    def _lookup(self, module: str, name: str):
        if name in ALWAYS:
            return ALWAYS[name]
        info = self.module(module)
        binding = info.bindings.get(name) if info else None
        if binding is None:
            for star_mod, level in info.stars if info else ():
                target = self.absolute(module, star_mod, level)
                sub = self.module(target)
                if sub is not None and (name in sub.bindings or sub.stars):
                    value = self.global_value(target, name)
                    if value is not UNKNOWN:
                        return value
            return seed_for(name) or External(name)
        value = self._binding_value(module, name, binding)
        if value is UNKNOWN or isinstance(value, External):
            # A dynamic definition the evaluator cannot read (vLLM's `current_platform`, a try/except
            # import): the seeded meaning of the name is better than nothing.
            return seed_for(name) or value
        return value

    def _binding_value(self, module: str, name: str, binding: tuple):
        kind = binding[0]
        if kind == "skipped":
            return UNKNOWN
        if kind == "assign":
            value = Evaluator(self, module).eval(binding[1])
            if binding[2] is not None:
                if isinstance(value, ArchNum):
                    return value.map(lambda v: v[binding[2]]) or UNKNOWN
                return UNKNOWN
            return value
        if kind == "from":
            return self.import_value(module, binding[1], binding[2], binding[3])
        if kind == "import":
            return ModuleRef(binding[1]) if self.path_of(binding[1]) else External(binding[1])
        node = binding[1]
        if isinstance(node, ast.ClassDef):
            return UNKNOWN
        if node.name == "get_platform":
            return SeedFn("get_platform", lambda a, k, m=module: Obj("platform", lambda n: self.platform_fact(m, n)))
        return UserFunc(module, node)

    def import_value(self, module: str, target: str | None, level: int, name: str):
        """Value of `from <target> import <name>` written in `module`."""
        if name in ALWAYS:
            return ALWAYS[name]
        absolute = self.absolute(module, target, level)
        if self.path_of(f"{absolute}.{name}" if absolute else name):
            return ModuleRef(f"{absolute}.{name}" if absolute else name)
        if self.path_of(absolute) and (ARCH_RE.search(name) or level):
            value = self.global_value(absolute, name)
            if not (isinstance(value, External) and value.dotted == name):
                return value
        return seed_for(name) or External(f"{absolute}.{name}")

    def defines(self, module: str, name: str, _seen: frozenset = frozenset()) -> bool:
        """Does target module `module` bind `name` at top level (directly or through `import *`)?"""
        info = self.module(module)
        if info is None or module in _seen:
            return False
        if name in info.bindings or self.path_of(f"{module}.{name}"):
            return True
        return any(self.defines(self.absolute(module, m, lvl), name, _seen | {module}) for m, lvl in info.stars)

    def module_attr(self, module: str, attr: str):
        if self.path_of(f"{module}.{attr}"):
            return ModuleRef(f"{module}.{attr}")
        if ARCH_RE.search(attr):
            return self.global_value(module, attr)
        return UNKNOWN

    # -- sglang platform facts ------------------------------------------------------------
    def platform_fact(self, module: str, name: str):
        key = ("platform", module, name)
        if key not in self._values:
            self._values[key] = self._platform_fact(module, name)
        return self._values[key]

    def _platform_fact(self, module: str, name: str):
        info = self.module(module)
        tables = {}
        for table in ("_PLATFORM_PROBES", "_PLATFORM_VALUES"):
            binding = info.bindings.get(table) if info else None
            if binding and binding[0] == "assign" and isinstance(binding[1], ast.Dict):
                for k, v in zip(binding[1].keys, binding[1].values):
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant):
                        tables[k.value] = v.value
        if not tables:
            return sglang_fact(name)
        probe = tables.get(name)
        if probe is None:
            self.missing.append(f"platform fact {name!r} is not in _PLATFORM_PROBES of {module}")
            return UNKNOWN
        if probe in ALWAYS:
            return Evaluator(self, module).call(ALWAYS[probe], [], {})
        for cand in self._imported_modules(info):
            sub = self.module(cand)
            if sub is not None and probe in sub.bindings:
                value = Evaluator(self, cand).call(self.global_value(cand, probe), [], {})
                if value is not UNKNOWN:
                    return value
        return sglang_fact(name)

    def _imported_modules(self, info: ModuleInfo) -> list[str]:
        """Modules `info` imports from anywhere in its text (also inside defs that were not parsed)."""
        found = []
        for m in _FROM_IMPORT_RE.finditer(info.source):
            dots, target, names = m.group(1), m.group(2) or None, m.group(3)
            base = self.absolute(info.name, target, len(dots))
            for alias in re.findall(r"\w+", names.split(" as ")[0] if "," not in names else names):
                sub = f"{base}.{alias}"
                found.append(sub if self.path_of(sub) else base)
        return [m for m in dict.fromkeys(found) if self.path_of(m)]

    # -- inlining -----------------------------------------------------------------------
    def call_user(self, func: UserFunc, args: list, kwargs: dict, depth: int):
        """Evaluate a call to a target function by inlining its body (arch-related bodies only)."""
        if depth > MAX_DEPTH:
            return seed_for(func.name).call(args, kwargs) if seed_for(func.name) else UNKNOWN
        if not self._can_inline(func.module, func.node):
            return UNKNOWN
        try:
            key = (id(func.node), tuple(args), tuple(sorted(kwargs.items())))
            hash(key)
        except TypeError:
            key = None
        if key is not None and key in self._calls:
            return self._calls[key]
        if key is not None:
            self._calls[key] = UNKNOWN  # recursion guard
        local = self._bind(func.node.args, args, kwargs, func.module)
        value = self._block(func.node.body, local, func.module, depth)
        seed = seed_for(func.name)
        if not isinstance(value, (ArchBool, ArchNum)) and isinstance(seed, SeedFn):
            value = seed.call(args, kwargs)
        if key is not None:
            self._calls[key] = value
        return value

    def _bind(self, spec: ast.arguments, args: list, kwargs: dict, module: str) -> dict:
        params = [a.arg for a in spec.posonlyargs + spec.args]
        defaults = [None] * (len(params) - len(spec.defaults)) + list(spec.defaults)
        local = {}
        for i, pname in enumerate(params):
            if i < len(args):
                local[pname] = args[i]
            elif pname in kwargs:
                local[pname] = kwargs[pname]
            elif defaults[i] is not None:
                local[pname] = Evaluator(self, module).eval(defaults[i])
            else:
                local[pname] = UNKNOWN
        for a, d in zip(spec.kwonlyargs, spec.kw_defaults):
            local[a.arg] = kwargs.get(a.arg, Evaluator(self, module).eval(d) if d is not None else UNKNOWN)
        return local

    def _block(self, body: list, local: dict, module: str, depth: int):
        """Value a statement list returns: assignments, `if ...: return` ladders, a final return."""
        ev = Evaluator(self, module, local, None, depth)
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.Return):
                return ev.eval(stmt.value) if stmt.value is not None else Const(None)
            if isinstance(stmt, ast.Expr):
                continue
            if isinstance(stmt, ast.Assign) and all(isinstance(t, (ast.Name, ast.Tuple)) for t in stmt.targets):
                value = ev.eval(stmt.value)
                for t in stmt.targets:
                    if isinstance(t, ast.Name):
                        local[t.id] = value
                        continue
                    for i, elt in enumerate(t.elts):  # major, minor = get_compute_capability(device)
                        if isinstance(elt, ast.Name):
                            local[elt.id] = (value.map(lambda v, i=i: v[i]) if isinstance(value, ArchNum) else None) or UNKNOWN
                continue
            if isinstance(stmt, ast.If) and _returns(stmt.body):
                test = to_bool(ev.eval(stmt.test))
                # A branch that raises never returns: for a predicate that reads as "not supported".
                raises = isinstance(stmt.body[-1], ast.Raise)
                then = Const(False) if raises else self._block(stmt.body, dict(local), module, depth)
                rest = self._block(stmt.orelse + body[i + 1:], dict(local), module, depth)
                return ite(test, then, rest)
            if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.Pass)):
                if isinstance(stmt, ast.ImportFrom):
                    for alias in stmt.names:
                        local[alias.asname or alias.name] = self.import_value(module, stmt.module, stmt.level, alias.name)
                continue
            return UNKNOWN
        return Const(None)


def _returns(body: list) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise))
