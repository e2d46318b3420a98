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
import bisect
import os
import re
from pathlib import Path

from tpfuse.audit.arch import ArchBool, ArchNum
from tpfuse.audit.evaluate import Evaluator, asks_given, ite, seed_for, to_bool
from tpfuse.audit.modules import ModuleInfo, collect_bindings
from tpfuse.audit.parse import TextMap, parse_selected, prefixed_matches
from tpfuse.audit.predicates import ALWAYS, sglang_fact
from tpfuse.audit.target import SourceSkip, read_source
from tpfuse.audit.values import UNKNOWN, Const, External, LazyImport, ModuleRef, Obj, SeedFn, UserClass, UserFunc

# Identifiers that may carry an architecture meaning, from the gate idioms of sglang, vLLM and FlashInfer.
ARCH_RE = re.compile(
    r"sm_?\d{2,3}|sm\d+x|blackwell|hopper|ampere|capabilit|device_sm|sm_version|cuda_arch|"
    r"get_platform|current_platform|device_properties|^_?is_cuda|device_arch|gpu_arch|arch_major|arch_number|arch_code",
    re.IGNORECASE,
)
_FROM_IMPORT_RE = re.compile(r"^[ \t]*from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+\(?([\w ,]+)", re.MULTILINE)
# ARCH_RE for whole-text searches of lower-cased source (no anchors, no IGNORECASE: faster; the figure is in
# benchmarks/results/README.md).
_ARCH_TEXT_RE = re.compile(ARCH_RE.pattern.replace("^_?", "").lower())
# ARCH_RE inside a longer text (a def's), where its anchored `^_?is_cuda` can never match: the same
# lower-cased way.
_ARCH_INNER_RE = re.compile(ARCH_RE.pattern.replace("|^_?is_cuda", "").lower())
# The tokens that can make a def's conditions depend on the architecture (ARCH_RE without the
# platform objects and `is_cuda`, which are constant on every audited arch unless an arch token follows).
_CONSTANT_TOKENS = frozenset({"get_platform", "current_platform", "is_cuda"})
_IDENT_RE = re.compile(r"\w+")
_CONSTANT_NAMES = frozenset({"get_platform", "current_platform", "is_cuda", "is_cuda_alike"})
# Inlining depth: a call site -> helper -> its one shared checker (sglang's partial) -> a getter.
MAX_DEPTH = 4


def arch_tokens(textmap: TextMap) -> tuple[list, list]:
    """(offsets of every architecture token in code, those that can make a condition depend on the
    architecture: without the platform objects and `is_cuda`, constant on every audited arch, unless
    one begins a longer imported name such as `is_cuda_sm_at_least`)."""
    return _arch_scan(textmap)[:2]


def _arch_scan(textmap: TextMap) -> tuple[list, list, list]:
    """`arch_tokens(textmap)` and `_inner_match_lines(textmap.source)`, from one search of the text."""
    lower = textmap.source.lower()
    matches = _arch_matches(lower)
    hits = [(m.start(), m.group()) for m in matches if textmap.is_code(m.start())]
    tokens = [pos for pos, text in hits if text not in _CONSTANT_TOKENS or _longer_import(textmap, pos)]
    return [pos for pos, _ in hits], tokens, _inner_lines_of(lower, matches)


# Where a match of _ARCH_TEXT_RE can start: every alternative begins with one of these.
_ARCH_PREFIXES = ("sm", "blackwell", "hopper", "ampere", "capabilit", "device_", "cuda_arch", "get_platform",
                  "current_platform", "is_cuda", "gpu_arch", "arch_")


def _arch_matches(lower: str) -> list:
    """`_ARCH_TEXT_RE.finditer(lower)` as a list (the regex tried at every position of every
    candidate file was a tenth of an engine audit)."""
    return prefixed_matches(_ARCH_TEXT_RE, _ARCH_PREFIXES, lower)


# Where a match of _ARCH_INNER_RE can start (_ARCH_PREFIXES without `is_cuda`, which it does not hold).
_INNER_PREFIXES = tuple(p for p in _ARCH_PREFIXES if p != "is_cuda")


def _inner_lines_of(lower: str, matches: list) -> list:
    """`_inner_match_lines` of a source, from its lower-cased text and `_arch_matches` of that.

    `_ARCH_TEXT_RE` is `_ARCH_INNER_RE` with one more alternative, `is_cuda`: at a position where the
    inner pattern matches, the text pattern matches too, so every line holding an inner match holds a
    reported text match (one at that position, or an earlier one of the same line that covers it: no
    match spans a line); a text match other than `is_cuda` is an inner match at its position (the same
    alternative is the first to match there). Only a line whose reported matches are all `is_cuda` is
    searched again."""
    lines, line, pos = [], 1, 0
    only_cuda: dict = {}  # line -> where it starts, for a line whose matches so far are all `is_cuda`
    for m in matches:
        i = m.start()
        line += lower.count("\n", pos, i)
        pos = i
        if lines and lines[-1] == line:
            continue
        if m.group() != "is_cuda":
            only_cuda.pop(line, None)
            lines.append(line)
        elif line not in only_cuda:
            only_cuda[line] = lower.rfind("\n", 0, i) + 1
    for line, start in only_cuda.items():
        end = lower.find("\n", start)
        if _ARCH_INNER_RE.search(lower, start, len(lower) if end < 0 else end):
            lines.append(line)
    return sorted(lines)


def _inner_match_lines(source: str) -> list:
    """The sorted 1-based numbers of the lines of `source` (cut at "\n") where `_ARCH_INNER_RE` matches
    lower-cased. None of its matches spans a line, so a group of lines holds a match exactly when one
    of them is listed."""
    lower = source.lower()  # lower-casing keeps every "\n", so line numbers are the source's
    found = set()
    for prefix in _INNER_PREFIXES:
        i = lower.find(prefix)
        while i >= 0:
            if _ARCH_INNER_RE.match(lower, i):
                found.add(i)
            i = lower.find(prefix, i + 1)
    if not found:
        return []
    starts = sorted(found)
    lines, line, pos = [], 1, 0
    for i in starts:
        line += lower.count("\n", pos, i)
        pos = i
        if not lines or lines[-1] != line:
            lines.append(line)
    return lines


def _longer_import(textmap: TextMap, pos: int) -> bool:
    line = textmap.lines[textmap.line_of(pos)]
    if "import" not in line:
        return False
    word = _IDENT_RE.match(textmap.source, pos)
    return bool(word) and word.group() not in _CONSTANT_NAMES


class Resolver:
    """Parses target modules on demand and resolves names to abstract values (memoized)."""

    def __init__(self, roots: list[Path], overlay: dict | None = None, within: Path | None = None):
        self.roots = [Path(r).resolve() for r in roots]
        # Only modules under `within` (the audited tree) are parsed: `import torch` stays external.
        self.within = Path(within).resolve() if within else None
        self.overlay = {Path(k).resolve(): v for k, v in (overlay or {}).items()}
        self._modules: dict[str, ModuleInfo | None] = {}
        # name -> (source, TextMap, token offsets, non-constant ones, `_inner_match_lines`) before its parse
        self._prepared: dict = {}
        # (name, path) -> the same, for the run: a module parsed again (`forget`) or first read by
        # `holds_tokens` without a token and parsed later as a dependency is not read and mapped again.
        # Dropped with the module's line map (`release`).
        self._kept: dict = {}
        self._paths: dict[str, Path | None] = {}
        self._values: dict = {}
        self._keys_of: dict = {}  # module (a key's first part) -> its keys in `_values`, for `forget`
        self._calls: dict = {}
        self._active: set = set()
        self.errors: dict[Path, str] = {}
        self._root_strs = [str(r) for r in self.roots]
        self._overlay_strs = {str(p) for p in self.overlay}
        self._overlay_dirs = {os.path.dirname(p) for p in self._overlay_strs}
        self._dirs: dict = {}  # directory -> whether it exists (path_of's probes)
        self._inlinable: dict = {}
        self._inner_lines: dict = {}  # module -> (its source, `_inner_match_lines` of it)
        self.missing: list[str] = []
        # module -> names it imports that hold an architecture value elsewhere (the driver's second pass)
        self.extra_hot: dict[str, frozenset] = {}

    # -- modules ------------------------------------------------------------------------
    def path_of(self, name: str) -> Path | None:
        """File of module `name` inside the audited tree, or None (string paths: pathlib was slow here)."""
        if name not in self._paths:
            rel = name.replace(".", os.sep)
            found = None
            within = str(self.within) + os.sep if self.within else ""
            for root in self._root_strs:
                base = os.path.join(root, rel)
                if not self._is_dir(os.path.dirname(base)):  # most names are not under most roots
                    continue
                for cand in (os.path.join(base, "__init__.py"), base + ".py"):
                    if within and not cand.startswith(within):
                        continue
                    if cand in self._overlay_strs or os.path.isfile(cand):
                        found = Path(cand)
                        break
                if found:
                    break
            self._paths[name] = found
        return self._paths[name]

    def _is_dir(self, directory: str) -> bool:
        if directory not in self._dirs:
            self._dirs[directory] = directory in self._overlay_dirs or os.path.isdir(directory)
        return self._dirs[directory]

    def read(self, path: Path) -> str:
        """Source text of `path` (the overlay's, else the file's, decoded as Python does); SourceSkip if unreadable."""
        if self.overlay:  # its keys are real paths (opening the file itself reports a link loop)
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
                source, textmap, hits, tokens, inner = self._prepared.pop(name, None) or self._prepare(name, path)
                tree, skipped, hot, hidden = parse_selected(source, str(path), tokens, ARCH_RE, textmap=textmap,
                                                    extra_hot=self.extra_hot.get(name, frozenset()))
            except SourceSkip as exc:  # unreadable, undecodable or too large: the module is unknown, never fatal
                self.errors[path] = str(exc)
            except (SyntaxError, ValueError, RecursionError) as exc:
                self.errors[path] = f"{type(exc).__name__}: {exc}"
            else:
                self._inner_lines[name] = (source, inner)
                info = ModuleInfo(name, path, source, tree, path.name == "__init__.py", arch_offsets=hits, hot=hot,
                                  textmap=textmap, hidden=hidden)
                collect_bindings(info, tree.body)
                for skipped_name in skipped:  # a def with no architecture text: bound, but opaque
                    info.bindings.setdefault(skipped_name, ("skipped",))
        self._modules[name] = info
        return info

    def _prepare(self, name: str, path: Path) -> tuple:
        key = (name, path)
        prepared = self._kept.get(key)
        if prepared is None:
            source = self.read(path)
            textmap = TextMap(source)
            prepared = self._kept[key] = (source, textmap, *_arch_scan(textmap))
        return prepared

    def holds_tokens(self, name: str, path: Path, source: str) -> bool:
        """Can module `name` (text `source`) hold an architecture condition of its own: an architecture
        token in code? (Kept for its parse.) Without one, only names it imports can make it one."""
        prepared = self._kept.get((name, path))
        if prepared is None or prepared[0] != source:
            textmap = TextMap(source)
            prepared = self._kept[(name, path)] = (source, textmap, *_arch_scan(textmap))
        if prepared[3]:
            self._prepared[name] = prepared
        return bool(prepared[3])

    def forget(self, name: str) -> None:
        """Parse module `name` again when next asked (its `extra_hot` names changed)."""
        self._modules.pop(name, None)
        for key in self._keys_of.pop(name, ()):
            self._values.pop(key, None)

    def arch_valued(self, value) -> bool:
        """Does `value` hold an architecture value (a flag, a capability, a helper returning one)?"""
        if isinstance(value, ArchBool):
            return value.depends_on_arch
        if isinstance(value, ArchNum):
            return True
        if isinstance(value, UserFunc) and self._can_inline(value.module, value.node):
            result = self.call_user(value, [], {}, 1)
            return isinstance(result, ArchNum) or isinstance(result, ArchBool) and result.depends_on_arch
        return False

    def exports_of(self, name: str) -> set:
        """Top-level names of module `name` without architecture text that hold an architecture value:
        other modules that import them read the architecture without naming it."""
        info = self.module(name)
        if info is None:
            return set()
        return {n for n in info.hot if n in info.bindings and info.bindings[n][0] in ("assign", "def")
                and not ARCH_RE.search(n) and self.arch_valued(self.global_value(name, n))}

    def release(self, name: str) -> None:
        """Drop what a scanned module's tree holds that no other module can resolve through: the
        module node, its line map, and the bodies of the defs and methods that are never inlined
        (`_can_inline`: no architecture text), which then stay bound as the same opaque functions.
        What another module reads through this one is the same before and after, so the order in
        which modules are scanned never changes a verdict."""
        info = self._modules.get(name)
        if info is None:
            return
        info.tree = info.textmap = None
        self._kept.pop((name, info.path), None)
        for bound, binding in list(info.bindings.items()):
            if binding[0] != "def" or binding[1].name != bound:
                continue
            node = binding[1]
            for sub in node.body if isinstance(node, ast.ClassDef) else [node]:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not self._can_inline(name, sub):
                    sub.body = [ast.Pass(lineno=sub.lineno, col_offset=sub.col_offset)]
        info.release_lines()

    def _can_inline(self, module: str, node) -> bool:
        if id(node) not in self._inlinable:
            info = self.module(module)
            params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            self._inlinable[id(node)] = bool(ARCH_RE.search(node.name)
                                             or self._inner_text(info, node.lineno, getattr(node, "end_lineno",
                                                                                            node.lineno))
                                             or any(a.arg == "arch" for a in params))
        return self._inlinable[id(node)]

    def _inner_text(self, info: ModuleInfo, first: int, last: int) -> bool:
        """`_ARCH_INNER_RE.search(info.text_of(node).lower())` for a node on lines `first`..`last`, from the
        lines of the module where the pattern matches (found once per module text instead of once a def)."""
        cached = self._inner_lines.get(info.name)
        if cached is None or cached[0] is not info.source:
            cached = self._inner_lines[info.name] = (info.source, _inner_match_lines(info.source))
        lines = cached[1]
        i = bisect.bisect_left(lines, first)
        return i < len(lines) and lines[i] <= last

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
        self._keys_of.setdefault(module, []).append(key)
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
            return UserClass(module, node)
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
        if self.path_of(absolute):
            value = _imported(name, self.global_value(absolute, name))
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
        return _imported(attr, self.global_value(module, attr))

    def where(self, module: str, node: ast.expr, local: dict | None = None) -> dict:
        """{"path", "line"} of the module-level binding a name expression reads (a table), or {}."""
        if not isinstance(node, ast.Name) or local and node.id in local and not isinstance(local[node.id], LazyImport):
            return {}
        name, seen = node.id, set()
        lazy = local.get(name) if local else None
        if isinstance(lazy, LazyImport):
            module, name = self.absolute(module, lazy.module, lazy.level), lazy.name
        while (module, name) not in seen:
            seen.add((module, name))
            info = self.module(module)
            binding = info.bindings.get(name) if info else None
            if binding is None:
                return {}
            if binding[0] == "from":
                module, name = self.absolute(module, binding[1], binding[2]), binding[3]
                continue
            if binding[0] in ("assign", "def"):
                return {"module": module, "file": str(info.path), "line": binding[1].lineno}
            return {}
        return {}

    # -- sglang platform facts ------------------------------------------------------------
    def platform_fact(self, module: str, name: str):
        key = ("platform", module, name)
        if key not in self._values:
            self._values[key] = self._platform_fact(module, name)
            self._keys_of.setdefault("platform", []).append(key)
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
        local = self._bind(func.node.args, ([UNKNOWN] if func.bound else []) + list(args), kwargs, func.module)
        value = self._block(func.node.body, local, func.module, depth, func.attrs)
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

    def _block(self, body: list, local: dict, module: str, depth: int, attrs: dict | None = None):
        """Value a statement list returns: assignments, `if ...: return` ladders, a final return."""
        ev = Evaluator(self, module, local, attrs, depth)
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
                            local[elt.id] = ((value.map(lambda v, i=i: v[i]) if isinstance(value, ArchNum) else None)
                                             or UNKNOWN)
                continue
            if isinstance(stmt, ast.If) and _returns(stmt.body):
                test = to_bool(ev.eval(stmt.test))
                # A branch that raises never returns: for a predicate that reads as "not supported".
                raises = isinstance(stmt.body[-1], ast.Raise)
                then = Const(False) if raises else self._block(stmt.body, dict(local), module, depth, attrs)
                rest = self._block(stmt.orelse + body[i + 1:], dict(local), module, depth, attrs)
                return ite(test, then, rest, override=asks_given(stmt.test))
            if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.Pass)):
                if isinstance(stmt, ast.ImportFrom):
                    for alias in stmt.names:
                        local[alias.asname or alias.name] = self.import_value(module, stmt.module, stmt.level,
                                                                              alias.name)
                continue
            return UNKNOWN
        return Const(None)


def _imported(name: str, value):
    """A value read from another module: a flag or setting there (a bool, None or a string, such as
    vLLM's `envs.VLLM_USE_X: bool = False` defaults) is what runs only by default, so it is unknown
    here unless its name is an architecture's; tables and numbers (capability thresholds) are kept."""
    if (isinstance(value, Const) and (value.value is None or isinstance(value.value, (bool, str)))
        and not ARCH_RE.search(name)):
        return UNKNOWN
    return value


def _returns(body: list) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise))
