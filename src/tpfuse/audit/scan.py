"""Walk a module's statements, evaluate every condition that involves the GPU architecture.

Condition sites: `if`/`elif`/`while` tests, `assert`s, ternaries, boolean `return`s and
assignments, lookups in capability-keyed tables (`TABLE.get(cap)`: the gate is a missing key), and
capability decorators (FlashInfer `@supported_compute_capability([...])`, `pytest.mark.skipif`).
Function-local bindings are tracked in statement order (`major, minor =
torch.cuda.get_device_capability()` then `if major == 10`), a nested def sees the names of the defs
around it, imports inside a def are resolved when a condition reads them, and `self.X = <arch
expr>` (and a class's own methods) are visible to the class's methods. Only expressions that
mention an architecture-looking name, or a name already bound to an architecture value, are
evaluated, which keeps a whole-engine audit to a few seconds. Each site whose value differs
between architectures becomes a `Site`, with the evidence verdict.py reads its category from: its
role, what its guarded code does (`effect`) and whether its architecture atoms turn something off
where they name an architecture (`turns_off`).
"""

from __future__ import annotations

import ast
import bisect
import re
from dataclasses import dataclass

from tpfuse.audit import classify, hardware
from tpfuse.audit.arch import ARCHS, ArchBool, ArchNum, compare
from tpfuse.audit.evaluate import Evaluator, atoms, to_bool
from tpfuse.audit.parse import split_lines
from tpfuse.audit.resolve import Resolver
from tpfuse.audit.values import UNKNOWN, Const, External, LazyImport, Obj, UserFunc


@dataclass
class Site:
    """One architecture-dependent condition; `value` is the gate's value (negated for guards)."""

    module: str
    node: ast.expr
    kind: str
    scope: str
    value: ArchBool
    role: str  # verdict.ROLES
    guards: str
    polarity: int
    stmt: ast.AST
    local: dict | None
    attrs: dict | None
    note: str | None = None
    requires: tuple = ()  # hardware features the guarded code uses (hardware.py)
    effect: str = "enable"  # verdict.EFFECTS
    turns_off: bool = False
    table: dict | None = None  # a capability-keyed table the condition looks up (verdict.ArchCondition.table)


_CALL_RE = re.compile(r"(?<![.\w])([A-Za-z_]\w*)\s*\(")
_BUILTIN_NAMES = frozenset(dir(__builtins__) if isinstance(__builtins__, dict) else dir(__builtins__))
_MAX_CALLED = 8  # called functions read per site: the direct callees are where a kernel is compiled or launched
_INIT_METHODS = ("__init__", "__post_init__", "setUp")
_WORD_RE = re.compile(r"[A-Za-z_]\w*")
# After a ternary's `else` comes no colon (an else clause's does).
_CLAUSE_COLON_RE = re.compile(r"[ \t]*:")
_ARCH_VALUES = (ArchBool, ArchNum, Obj)
_LOCAL_ARCH = (*_ARCH_VALUES, LazyImport)  # a local name bound to an import is resolved when read


def _ternary_or_skip(source: str) -> list:
    """Offsets of every `else` not followed by a colon (a ternary's) and every `skip` in `source`,
    found with str.find (a regex alternation is tried at every position of the text: several
    times slower on an engine)."""
    out = []
    for word in ("else", "skip"):
        i = source.find(word)
        while i >= 0:
            if word == "skip" or not _CLAUSE_COLON_RE.match(source, i + 4):
                out.append(i)
            i = source.find(word, i + 4)
    return out


def _names(targets: list) -> list:
    out = []
    for t in targets:
        for e in t.elts if isinstance(t, ast.Tuple) else [t]:
            out.append(e.id if isinstance(e, ast.Name) else getattr(e, "attr", ""))
    return out


def _one_family(value: ArchBool) -> bool:
    """True (or undecided) on one major family only: a check that singles out one architecture."""
    return len({a.major for a, v in zip(ARCHS, value.values) if v is not False}) == 1


def _exits(body: list) -> bool:
    """Does the block never fall through (it ends in a return, raise, continue or break)?"""
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))


def _snapshot(local, attrs) -> list:
    return [dict(d) if d is not None else None for d in (local, attrs)]


def _restore(local, attrs, snapshot: list) -> None:
    for d, was in zip((local, attrs), snapshot):
        if d is not None:
            d.clear()
            d.update(was)


def _opaque(value):
    """UNKNOWN for a value nothing is known of (an unresolved external name or call)."""
    return UNKNOWN if isinstance(value, External) else value


def _per_arch(value) -> tuple | None:
    """(values per architecture, None where unknown, and whether they are booleans) of a value that
    has one per architecture, or None for an object, a function or a module."""
    if isinstance(value, ArchBool):
        return value.values, True
    if isinstance(value, ArchNum):
        return value.values, False
    if isinstance(value, Const) and isinstance(value.value, (bool, int, float, str, tuple)):
        return (value.value,) * len(ARCHS), isinstance(value.value, bool)
    return None


def _join(test, body, other):
    """A name's value after `if test:` where the body left it `body` and the else branch (or the
    code before the `if`) left it `other`.

    On each architecture where `test` is known the branch taken gives the value; elsewhere the two
    must agree, or the value is unknown there (a boolean can be unknown on some architectures only,
    a number or string cannot: it is then unknown). Under a test that does not depend on the
    architecture (a parameter, an environment flag), a branch that leaves the name unknown does not
    hide an architecture value of the other, as the default path is the one audited
    (`def f(fast=None): if fast is None: fast = is_sm100()`, `if backend == "auto": backend = ...`),
    nor an object or a function, but does hide a constant; None counts as unknown there (a value
    computed on first use)."""
    if isinstance(test, Const):
        return body if test.value else other
    if isinstance(test, ArchBool) and not test.depends_on_arch and test.values[0] is not None:
        return body if test.values[0] else other  # the same on every architecture: `if _is_hip:`
    if body == other:
        return body
    arch_test = isinstance(test, ArchBool) and test.depends_on_arch
    if not arch_test and (_absent(body) or _absent(other)):
        known = other if _absent(body) else body
        if _absent(known):
            return UNKNOWN
        return known if _device_value(known) or not isinstance(known, Const) and _per_arch(known) is None else UNKNOWN
    tests = test.values if arch_test else (None,) * len(ARCHS)
    unknown = ((None,) * len(ARCHS), None)
    a = unknown if body is UNKNOWN else _per_arch(body)
    b = unknown if other is UNKNOWN else _per_arch(other)
    if a is None or b is None:  # an object, a function, None: the one branch that bound something decides
        return other if body is UNKNOWN else body if other is UNKNOWN else UNKNOWN
    values = tuple(x if t is True else y if t is False else x if x == y else None for t, x, y in zip(tests, a[0], b[0]))
    weak = arch_test and test.weak or any(getattr(v, "weak", False) for v in (body, other))
    if all(v is None for v in values):
        return UNKNOWN
    if all(isinstance(v, bool) or v is None for v in values):
        return ArchBool(values, weak)
    if None in values:
        return UNKNOWN
    if len(set(values)) == 1:
        return Const(values[0])
    return ArchNum(values, weak)


def _falls_back(ev, call: ast.Call, table) -> bool:
    """`TABLE.get(cap, 320)`, `REASONS.get(cap, "no code for it")`: the default and every value are
    truthy, so an architecture the table does not list gets a value of the same kind (a tuned size,
    a message) and nothing is turned off; `.get(cap, {})`, `.get(cap, 0)` or `.get(cap)` stay gates."""
    if len(call.args) < 2 or not isinstance(table, dict):
        return False
    default = ev.eval(call.args[1])
    return isinstance(default, Const) and bool(default.value) and all(bool(v) for v in table.values())


def _absent(value) -> bool:
    """Unknown, or None: the `self.x = None` of a value computed on first use (`if self.x is None:`)."""
    return value is UNKNOWN or isinstance(value, Const) and value.value is None


def _device_value(value) -> bool:
    """An architecture flag, or a number or string per architecture."""
    if isinstance(value, ArchBool):
        return value.depends_on_arch
    return isinstance(value, ArchNum)


class ModuleScanner:
    """Collects the `Site`s of one module."""

    def __init__(self, resolver: Resolver, module: str, rel: str):
        self.resolver = resolver
        self.module = module
        self.info = resolver.module(module)
        self.lines = split_lines(self.info.source, keepends=False) if self.info else []
        # Where the module sits in its package, not under TARGET: a test file audited alone is still a test.
        self.is_test = classify.is_test_path(rel) or classify.is_test_path(module.replace(".", "/") + ".py")
        self.sites: list[Site] = []
        # Per-line text tests instead of AST walks: walking every expression of every statement
        # dominated the run time. Lines that may hold a ternary or a skip call, and lines that
        # mention an architecture-looking name, over-approximated from the text.
        textmap = self.info.textmap if self.info else None
        self._expr_lines = {textmap.line_of(pos) + 1 for pos in _ternary_or_skip(textmap.source)} if textmap else set()
        # The resolver found the architecture tokens when it parsed the module (one pass over the text).
        self._arch_lines = {textmap.line_of(pos) + 1 for pos in self.info.arch_offsets} if textmap else set()
        self._expr_sorted = sorted(self._expr_lines)
        self._arch_sorted = sorted(self._arch_lines)
        self._line_words: dict = {}
        self._arch_globals: set | None = None
        self._funcs: list = []  # enclosing defs, innermost last
        self._classes: list = []  # enclosing classes, innermost last
        self._decorated = None  # the def whose decorators are being read
        self._log: list = []  # (dict, name) of every binding of a local or attribute, in order (`_set`)

    def _words(self, first: int, last: int) -> set:
        """The identifiers on lines `first`..`last` (1-based), each line read once per module."""
        cache, lines = self._line_words, self.lines
        if first == last and first <= len(lines):
            words = cache.get(first)
            if words is None:
                words = cache[first] = frozenset(_WORD_RE.findall(lines[first - 1]))
            return words
        key = (first, last)  # a statement's lines are read for each of its tests: its union once
        out = cache.get(key)
        if out is not None:
            return out
        out = set()
        for i in range(first, min(last, len(lines)) + 1):
            words = cache.get(i)
            if words is None:
                words = cache[i] = frozenset(_WORD_RE.findall(lines[i - 1]))
            out |= words
        cache[key] = out
        return out

    def _globals(self) -> set:
        """Module-level names bound by assignment to an architecture value."""
        if self._arch_globals is None:
            # Only assignments whose text names an architecture token or an earlier such name can
            # hold one (evaluating every module-level table was a tenth of a whole-engine audit).
            found: set = set()
            for name, binding in self.info.bindings.items():
                if binding[0] != "assign":
                    continue
                node = binding[1]
                lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
                if not any(n in self._arch_lines for n in lines):
                    if not found or found.isdisjoint(self._words(node.lineno, node.end_lineno or node.lineno)):
                        continue
                if isinstance(self.resolver.global_value(self.module, name), (ArchBool, ArchNum)):
                    found.add(name)
            self._arch_globals = found
        return self._arch_globals

    def _mentions_arch(self, expr, local, attrs) -> bool:
        first, last = expr.lineno, expr.end_lineno or expr.lineno
        i = bisect.bisect_left(self._arch_sorted, first)
        if i < len(self._arch_sorted) and self._arch_sorted[i] <= last:
            return True
        words = self._words(first, last)
        if local and any(isinstance(local[w], _LOCAL_ARCH) for w in local.keys() & words):
            return True
        if attrs and any(isinstance(attrs[w], (ArchBool, ArchNum)) for w in attrs.keys() & words):
            return True
        # A call of this module's arch-related def or a read of an arch flag (parse.py's hot names).
        return not words.isdisjoint(self.info.hot) or not words.isdisjoint(self._globals())

    def _may_hold_arch(self, stmt, attrs) -> bool:
        """Can anything in this def depend on the architecture? (Skipping the rest halves the run time.)"""
        first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
        i = bisect.bisect_left(self._arch_sorted, first)
        if i < len(self._arch_sorted) and self._arch_sorted[i] <= last:
            return True
        # The def's words are what is tested; a name that is not even a substring of its text is not one
        # of them, so a def that holds none is skipped without splitting each of its lines into words.
        text = "\n".join(self.lines[first - 1: last])
        if self._holds_any(text, self.info.hot, first, last) or self._holds_any(text, self._globals(), first, last):
            return True
        return bool(attrs) and self._holds_any(text, [w for w, v in attrs.items() if isinstance(v, _ARCH_VALUES)],
                                               first, last)

    def _holds_any(self, text: str, names, first: int, last: int) -> bool:
        """Is one of `names` a word of lines `first`..`last` (whose text is `text`)?"""
        return any(w in text for w in names) and not self._words(first, last).isdisjoint(names)

    def scan(self) -> list[Site]:
        if self.info is not None:
            self._block(self.info.tree.body, [], None, None, None)
        self.sites.sort(key=lambda site: (site.node.lineno, site.node.col_offset))
        return self.sites

    # -- evaluation --------------------------------------------------------------------
    def _evaluator(self, local, attrs) -> Evaluator:
        return Evaluator(self.resolver, self.module, local, attrs,
                         class_name=self._classes[-1] if self._classes else None)

    def _value(self, expr, local, attrs):
        if not self._mentions_arch(expr, local, attrs):
            return UNKNOWN
        return self._evaluator(local, attrs).eval(expr)

    def _site(self, expr, kind, scope, local, attrs, stmt, *, guards, polarity=1, role=None, effect="enable",
              value=None, table=None):
        if value is None:
            value = self._value(expr, local, attrs)
        if not isinstance(value, ArchBool) or not value.depends_on_arch:
            return value
        gate_value = value if polarity > 0 else value.not_()
        if callable(guards):  # described only for recorded sites: unparsing every if-body was costly
            guards = guards()
        turns_off = False
        end = getattr(stmt, "end_lineno", stmt.lineno) if kind not in ("if", "elif") else expr.end_lineno
        if role is None:
            role = self._role(scope, kind, stmt)
            turns_off = role == "code" and self._inverse(expr, polarity, local, attrs)
            if role == "code" and not turns_off and effect == "enable" and kind not in ("guard", "assert", "decorator"):
                effect = self._quirk_effect(kind, stmt, gate_value, end) or effect
        note = None
        hint = classify.hardware_hint(self.lines, stmt.lineno, end)
        if hint:
            note = f"nearby text cites {hint!r}: the exclusion may be intentional"
        requires = tuple(hardware.needed(self._guarded_text(kind, stmt))) if role == "code" and not turns_off else ()
        self.sites.append(Site(
            self.module, expr, kind, ".".join(scope) or "<module>", gate_value, role, guards, polarity, stmt,
            dict(local) if local is not None else None, dict(attrs) if attrs is not None else None, note, requires,
            effect, turns_off, table,
        ))
        return value

    def _quirk_effect(self, kind: str, stmt, value: ArchBool, end: int) -> str | None:
        """'tune' when the site tunes or works around rather than gates: a flag named as a requirement
        or tuning, any choice inside a tuning heuristic, or a check of one architecture family whose
        nearby text says it works around something there."""
        if kind == "assign":
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(classify.QUIRK_FLAG_RE.search(n) for n in _names(targets)):
                return "tune"
        if self._funcs and classify.TUNING_FUNC_RE.search(self._funcs[-1].name):
            return "tune"  # a choice inside a tuning heuristic, or a def computing a tuning knob (`_compute_cluster_n`)
        if _one_family(value) and classify.workaround_hint(self.lines, stmt.lineno, end):
            return "tune"
        return None

    def _guarded_text(self, kind: str, stmt) -> str:
        """The code a site guards, and the bodies of the target functions that code calls (one level)."""
        if kind in ("if", "elif", "while") and isinstance(stmt, (ast.If, ast.While)):
            first, last = stmt.body[0].lineno, stmt.body[-1].end_lineno
        elif kind == "guard" and self._funcs:
            first, last = stmt.end_lineno + 1, self._funcs[-1].end_lineno
        elif kind == "decorator" and self._decorated is not None:
            first, last = self._decorated.lineno, self._decorated.end_lineno
        else:
            first, last = stmt.lineno, getattr(stmt, "end_lineno", stmt.lineno)
        text = "\n".join(self.lines[first - 1: last])
        called = []
        for name in dict.fromkeys(_CALL_RE.findall(text)):
            value = self.resolver.global_value(self.module, name) if name not in _BUILTIN_NAMES else None
            if isinstance(value, UserFunc):
                owner = self.resolver.module(value.module)
                if owner is not None:
                    called.append(owner.text_of(value.node))
            if len(called) >= _MAX_CALLED:
                break
        return "\n".join([text, *called])

    def _role(self, scope, kind, stmt) -> str:
        if self.is_test:
            return "test"
        if any(classify.PRED_NAME_RE.match(s) for s in scope) and "supports_compute_capability" not in scope:
            return "helper-definition"
        if kind == "assign":
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names = _names(targets)
            if names and all(classify.FLAG_NAME_RE.search(n) for n in names):
                return "flag-definition"
        if kind in ("if", "elif") and isinstance(stmt, ast.If):
            if any(classify.is_skip_stmt(s) for s in stmt.body):
                return "test-skip"
            if all(classify.is_log_stmt(s) for s in stmt.body):
                return "log"
        return "code"

    def _inverse(self, expr, polarity, local, attrs) -> bool:
        """An inverse gate: every architecture atom turns the feature *off* where it names an
        architecture (`if is_sm120: x.use_pdl = False`, `return not _is_sm120`, a helper or flag
        false on a few newer architectures only, such as `use_swizzle()` = `not _is_sm120`). A
        lower bound (`if major < 9: raise`, `has_device_capability(90)`) is a requirement: it
        neither makes nor unmakes an inverse gate."""
        seen = False
        ev = self._evaluator(local, attrs)
        for atom, pol, _ in atoms(expr, polarity):
            value = to_bool(ev.eval(atom))
            if not value.depends_on_arch:
                continue
            if isinstance(atom, ast.Compare) and len(atom.ops) == 1 and isinstance(atom.ops[0], (ast.NotEq, ast.NotIn)):
                pol, value = -pol, value.not_()
            acting = value if pol > 0 else value.not_()  # as the atom acts on the gate
            off = [v is False for v in acting.values]
            if off == sorted(off, reverse=True):
                continue  # false on a prefix of the archs, oldest first: a minimum capability
            if pol < 0:
                seen = True
            elif not isinstance(atom, ast.Compare) and off.count(False) > off.count(True):
                seen = True  # a helper or flag false on a few archs only: it excludes them
            else:
                return False
        return seen

    # -- statements --------------------------------------------------------------------
    def _block(self, body, scope, local, attrs, func):
        for stmt in body:
            self._stmt(stmt, scope, local, attrs, func)

    def _stmt(self, stmt, scope, local, attrs, func, kind="if"):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self._decorators(stmt, scope, local, attrs)
            params = classify.capability_params(stmt)
            if not params and not self._may_hold_arch(stmt, attrs):
                return
            # A nested def reads the names of the defs around it (a closure); a method does not see its class body.
            inner = dict(local) if func is not None and local is not None else {}
            inner.update({a.arg: UNKNOWN for a in stmt.args.posonlyargs + stmt.args.args + stmt.args.kwonlyargs})
            inner.update(params)
            for extra in (stmt.args.vararg, stmt.args.kwarg):
                if extra:
                    inner[extra.arg] = UNKNOWN
            self._funcs.append(stmt)
            self._block(stmt.body, scope + [stmt.name], inner, attrs, stmt.name)
            self._funcs.pop()
            return
        if isinstance(stmt, ast.ClassDef):
            self._decorators(stmt, scope, local, attrs)
            class_attrs: dict = {}
            for method in stmt.body:  # `cls.is_sm120()` / `self._fast()` inline the class's own methods
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    class_attrs[method.name] = UserFunc(self.module, method, class_attrs, bound=True)
            # `self.sm = get_device_sm()` in __init__ is visible to methods written above it.
            first = [s for s in stmt.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and s.name in _INIT_METHODS]
            self._classes.append(stmt.name)
            self._block(first + [s for s in stmt.body if s not in first], scope + [stmt.name], class_attrs,
                        class_attrs, None)
            self._classes.pop()
            return
        self._expressions(stmt, scope, local, attrs)
        if isinstance(stmt, ast.If):
            table = self._table_site(stmt.test, "table", scope, local, attrs, stmt)
            bail = classify.guard_kind(stmt.body, stmt.test)
            if bail:
                rest = f"rest of {'.'.join(scope) or 'module'}"
                guards = f"{rest} (otherwise {'raises' if bail == 'raise' else 'returns early'})"
                test = self._site(stmt.test, "guard", scope, local, attrs, stmt, guards=guards, polarity=-1,
                                  table=table)
            elif classify.disables(stmt.body):
                guards = lambda: f"what the branch turns off: {classify.effects(stmt.body)}"  # noqa: E731
                test = self._site(stmt.test, kind, scope, local, attrs, stmt, guards=guards, polarity=-1,
                                  effect="disable", table=table)
            else:
                orelse = stmt.orelse if not (len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If)) else []
                tune = classify.tunes(stmt.body) and (not orelse or classify.tunes(orelse))
                test = self._site(stmt.test, kind, scope, local, attrs, stmt,
                                  guards=lambda: classify.effects(stmt.body),
                                  effect="tune" if tune else "enable", table=table)
            # Each branch starts from the bindings before the `if`; after it, a name is what either
            # branch left it (`_join`): `use_fast = False; if major >= 10: use_fast = True`.
            mark, before = len(self._log), _snapshot(local, attrs)
            self._block(stmt.body, scope, local, attrs, func)
            if len(self._log) == mark and not stmt.orelse:
                return  # nothing bound: nothing to join
            after_body = _snapshot(local, attrs)
            _restore(local, attrs, before)
            if len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If):
                self._stmt(stmt.orelse[0], scope, local, attrs, func, kind="elif")
            else:
                self._block(stmt.orelse, scope, local, attrs, func)
            if bool(stmt.orelse) and _exits(stmt.orelse):
                _restore(local, attrs, after_body)
            elif not _exits(stmt.body):  # after a body that returns or raises, only the else branch goes on
                if test is UNKNOWN:  # not evaluated as it names no architecture: `if _is_xpu:` still picks a branch
                    test = lambda: self._evaluator(before[0], before[1]).eval(stmt.test)  # noqa: E731
                self._join_into(local, attrs, test, after_body, mark)
        elif isinstance(stmt, ast.While):
            self._site(stmt.test, "while", scope, local, attrs, stmt, guards=lambda: classify.effects(stmt.body))
            self._maybe(stmt.body + stmt.orelse, scope, local, attrs, func)
        elif isinstance(stmt, ast.Assert):
            guards = f"rest of {'.'.join(scope) or 'module'} (otherwise AssertionError)"
            self._site(stmt.test, "assert", scope, local, attrs, stmt, guards=guards, polarity=1)
        elif isinstance(stmt, ast.Return) and stmt.value is not None:
            table = self._table_site(stmt.value, "table", scope, local, attrs, stmt)
            self._site(stmt.value, "return", scope, local, attrs, stmt, guards=f"{func or 'function'}() result",
                       table=table)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            self._assign(stmt, scope, local, attrs)
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and local is not None:
            self._set(local, stmt.target.id, UNKNOWN)
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            if local is not None:
                for node in ast.walk(stmt.target):
                    if isinstance(node, ast.Name):
                        self._set(local, node.id, UNKNOWN)
            self._maybe(stmt.body + stmt.orelse, scope, local, attrs, func)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            self._block(stmt.body, scope, local, attrs, func)
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            mark, before = len(self._log), _snapshot(local, attrs)
            self._block(stmt.body + stmt.orelse, scope, local, attrs, func)
            for handler in stmt.handlers:  # each handler runs instead of part of the body
                after = _snapshot(local, attrs)
                _restore(local, attrs, before)
                self._block(handler.body, scope, local, attrs, func)
                if _exits(handler.body):
                    _restore(local, attrs, after)
                else:
                    self._join_into(local, attrs, UNKNOWN, after, mark, prefer_branch=True)
            self._block(stmt.finalbody, scope, local, attrs, func)
        elif isinstance(stmt, ast.ImportFrom) and local is not None:
            for alias in stmt.names:
                if alias.name != "*":  # resolved when a condition reads it: most imports inside a def never matter here
                    self._set(local, alias.asname or alias.name, LazyImport(stmt.module, stmt.level, alias.name))
        elif isinstance(stmt, ast.Match):
            for case in stmt.cases:
                self._maybe(case.body, scope, local, attrs, func)

    def _maybe(self, body, scope, local, attrs, func):
        """A block that may run or not (a loop body, a `case`): its bindings join those before it."""
        mark, before = len(self._log), _snapshot(local, attrs)
        self._block(body, scope, local, attrs, func)
        if len(self._log) > mark:
            after = _snapshot(local, attrs)
            _restore(local, attrs, before)
            self._join_into(local, attrs, UNKNOWN, after, mark)

    def _set(self, d: dict, name: str, value) -> None:
        """Bind `name` in `d` (the def's locals or the class's attributes), logged for `_join_into`."""
        self._log.append((d, name))
        d[name] = value

    def _join_into(self, local, attrs, test, branch: list, mark: int, *, prefer_branch: bool = False) -> None:
        """Bindings after a branch on `test` (a value, or a function that evaluates it when needed) that
        left `branch` (a `_snapshot`), the other way the current ones; only the names bound since
        `mark` (the log's length before the branch) can differ. With `prefer_branch` (a try body
        against its handler) the branch's value wins wherever it knows one: on a GPU the device's
        value is the one that runs."""
        written = {(id(d), name) for d, name in self._log[mark:]}
        for d, branch_d in zip((local, attrs), branch):
            if d is None:
                continue
            for key, name in written:
                if key != id(d):
                    continue
                a, b = _opaque(branch_d.get(name, UNKNOWN)), _opaque(d.get(name, UNKNOWN))
                if a is b:
                    continue
                if prefer_branch:
                    self._set(d, name, b if a is UNKNOWN else a)
                    continue
                if callable(test):
                    test = test()
                self._set(d, name, _join(test, a, b))

    def _assign(self, stmt, scope, local, attrs):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        guards = lambda: " = ".join(ast.unparse(t) for t in targets)  # noqa: E731
        table = self._table_site(stmt.value, "table", scope, local, attrs, stmt, guards=guards)
        value = self._site(stmt.value, "assign", scope, local, attrs, stmt, guards=guards, table=table)
        # A literal in a def (`use_fast = False`, joined later) is its value; in a class body it is only a
        # default that an instance, a dataclass caller or a subclass overrides (`tp_size: int = 1`).
        if value is UNKNOWN and isinstance(stmt.value, ast.Constant) and local is not attrs:
            value = Const(stmt.value.value)
        for target in targets:
            if isinstance(target, ast.Name) and local is not None:
                self._set(local, target.id, value)
            elif isinstance(target, ast.Tuple) and local is not None:
                for i, elt in enumerate(target.elts):
                    if isinstance(elt, ast.Name):
                        part = value.map(lambda v, i=i: v[i]) if isinstance(value, ArchNum) else None
                        self._set(local, elt.id, part or UNKNOWN)
            elif (isinstance(target, ast.Attribute) and attrs is not None and isinstance(target.value, ast.Name)
                  and target.value.id in ("self", "cls")):
                self._set(attrs, target.attr, value)

    def _table_site(self, expr, kind, scope, local, attrs, stmt, *, guards=None) -> dict | None:
        """A lookup of the device's capability in a constant table: `TABLE.get(cap, {})` anywhere in
        `expr` (no conditional at all: the gate is a missing key) becomes a `table` site, and the
        table's location and keys, also for `cap in TABLE`, are returned for the condition's record.
        A lookup with a fallback value (`_falls_back`) is neither."""
        words = self._words(expr.lineno, expr.end_lineno or expr.lineno)
        if ("get" not in words and "in" not in words) or not self._mentions_arch(expr, local, attrs):
            return None  # the words test first: most statements hold neither a `.get(` nor an `in`
        ev = self._evaluator(local, attrs)
        found = None
        for node in ast.walk(expr):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and node.args):
                container, key = node.func.value, node.args[0]
            elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
                container, key = node.comparators[0], node.left
            else:
                continue
            if isinstance(container, (ast.Tuple, ast.List, ast.Set)):
                continue  # a literal in the condition itself, not a table elsewhere
            table, cap = ev.eval(container), ev.eval(key)
            if not (isinstance(table, Const) and isinstance(table.value, (dict, frozenset, set, tuple))
                    and isinstance(cap, ArchNum)):
                continue
            keys = table.value
            if isinstance(node, ast.Call) and _falls_back(ev, node, keys):
                continue
            present = compare("In", cap, keys)
            if present is None:
                continue
            found = {"name": ast.unparse(container), **self.resolver.where(self.module, container, local),
                     "keys": sorted((repr(k) for k in keys), key=str)[:32]}
            if isinstance(node, ast.Call) and present.depends_on_arch:
                self._site(node, kind, scope, local, attrs, stmt, guards=guards or (lambda: ast.unparse(expr)[:60]),
                           value=present, table=found)
        return found

    def _decorators(self, stmt, scope, local, attrs):
        self._decorated = stmt
        for deco in stmt.decorator_list:
            if not isinstance(deco, ast.Call):
                continue
            name = classify.call_name(deco)
            where = f"{stmt.name}()"
            if name == "supported_compute_capability" and deco.args:
                listed = self._evaluator(local, attrs).eval(deco.args[0])
                values = getattr(listed, "value", None)
                if isinstance(values, tuple) and all(isinstance(v, int) for v in values):
                    value = ArchBool.where(lambda a, vs=values: a.cc_int in vs)
                    self._site(deco, "decorator", scope, local, attrs, deco, guards=where, value=value)
            elif name in classify.SKIP_CALLS and deco.args:
                self._site(deco.args[0], "decorator", scope, local, attrs, deco, guards=where, role="test-skip")

    def _expressions(self, stmt, scope, local, attrs):
        """Ternaries anywhere in the statement's own expressions (not in nested statements)."""
        # Its expressions lie within its lines (a decorator above a def is not read here): without a
        # line that may hold a ternary or a skip in them, there is nothing to look at.
        i = bisect.bisect_left(self._expr_sorted, stmt.lineno)
        if i == len(self._expr_sorted) or self._expr_sorted[i] > (stmt.end_lineno or stmt.lineno):
            return
        name = ""
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            name = next(iter(_names(targets)), "")
        for field_name, value in ast.iter_fields(stmt):
            if field_name in ("body", "orelse", "finalbody", "handlers", "decorator_list", "cases"):
                continue
            for node in value if isinstance(value, list) else [value]:
                if isinstance(node, ast.expr) and any(
                    line in self._expr_lines for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                ):
                    self._ternaries(node, scope, local, attrs, stmt, False, name)

    def _ternaries(self, node, scope, local, attrs, stmt, in_message, name):
        if isinstance(node, ast.Call) and classify.call_name(node) in classify.LOG_CALLS | {"format"}:
            in_message = True
        if isinstance(node, ast.JoinedStr):
            in_message = True
        if isinstance(node, ast.Call) and classify.call_name(node) in classify.SKIP_CALLS and node.args:
            self._site(node.args[0], "call", scope, local, attrs, node, guards=f"{classify.call_name(node)}(...)",
                       role="test-skip")
        if isinstance(node, ast.IfExp):
            guards = lambda: f"{ast.unparse(node.body)[:40]} (else {ast.unparse(node.orelse)[:40]})"  # noqa: E731
            role = "message" if in_message or isinstance(stmt, ast.Raise) else None
            if any(classify.call_name(b) in classify.SKIP_CALLS
                   for b in (node.body, node.orelse) if isinstance(b, ast.Call)):
                role = "test-skip"  # `pytest.skip(...) if not family(100) else None`
            effect = "tune" if classify.tuning_choice(node, name) else "enable"
            self._site(node.test, "ternary", scope, local, attrs, node, guards=guards, role=role, effect=effect)
        if isinstance(node, ast.Dict):  # `{"num_stages": 3 if is_sm121() else 4}`: the key names the value
            for k, v in zip(node.keys, node.values):
                key = k.value if isinstance(k, ast.Constant) and isinstance(k.value, str) else name
                self._ternaries(v, scope, local, attrs, stmt, in_message, key)
                if k is not None:
                    self._ternaries(k, scope, local, attrs, stmt, in_message, name)
            return
        if isinstance(node, ast.Call):
            for child in [node.func, *node.args]:
                self._ternaries(child, scope, local, attrs, stmt, in_message, name)
            for kw in node.keywords:
                self._ternaries(kw.value, scope, local, attrs, stmt, in_message, kw.arg or name)
            return
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.Lambda):
                self._ternaries(child, scope, local, attrs, stmt, in_message, name)
