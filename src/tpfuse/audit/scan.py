"""Walk a module's statements, evaluate every condition that involves the GPU architecture.

Condition sites: `if`/`elif`/`while` tests, `assert`s, ternaries, boolean `return`s and
assignments, and capability decorators (FlashInfer `@supported_compute_capability([...])`,
`pytest.mark.skipif`). Function-local bindings are tracked in statement order (`major, minor =
torch.cuda.get_device_capability()` then `if major == 10`), and `self.X = <arch expr>` is visible
to later methods of the class. Only expressions that mention an architecture-looking name, or a
name already bound to an architecture value, are evaluated, which keeps a whole-engine audit to a
few seconds. Each site whose value differs between architectures becomes a `Site`.
"""

from __future__ import annotations

import ast
import bisect
import re
from dataclasses import dataclass

from tpfuse.audit import classify, hardware
from tpfuse.audit.arch import ArchBool, ArchNum
from tpfuse.audit.evaluate import Evaluator, to_bool
from tpfuse.audit.resolve import ARCH_RE, Resolver
from tpfuse.audit.values import UNKNOWN, Const, Obj, UserFunc


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


_CALL_RE = re.compile(r"(?<![.\w])([A-Za-z_]\w*)\s*\(")
_BUILTIN_NAMES = frozenset(dir(__builtins__) if isinstance(__builtins__, dict) else dir(__builtins__))
_MAX_CALLED = 8  # called functions read per site: the direct callees are where a kernel is compiled or launched
_INIT_METHODS = ("__init__", "__post_init__", "setUp")
_WORD_RE = re.compile(r"[A-Za-z_]\w*")
# A ternary always spells `else`. No \b: leading anchors disable sre's literal-prefix scan (4x slower).
_TERNARY_RE = re.compile(r"else|skip")
# ARCH_RE without the anchors, for whole-file scans (one finditer instead of a search per line).
# Matched against the lower-cased source, without anchors: a case-insensitive or anchored
# alternation was 5x slower (over-approximation is fine here; the AST decides).
_ARCH_TEXT_RE = re.compile(ARCH_RE.pattern.replace("^_?", "").lower())


def _match_lines(pattern: re.Pattern, source: str, starts: list) -> set:
    """1-based numbers of the lines where `pattern` matches (a multi-line match marks its first line)."""
    return {bisect.bisect_right(starts, m.start()) for m in pattern.finditer(source)}


class ModuleScanner:
    """Collects the `Site`s of one module."""

    def __init__(self, resolver: Resolver, module: str, rel: str):
        self.resolver = resolver
        self.module = module
        self.info = resolver.module(module)
        self.lines = self.info.source.splitlines() if self.info else []
        # Where the module sits in its package, not under TARGET: a test file audited alone is still a test.
        self.is_test = classify.is_test_path(rel) or classify.is_test_path(module.replace(".", "/") + ".py")
        self.sites: list[Site] = []
        # Per-line text tests instead of AST walks: walking every expression of every statement
        # dominated the run time. Lines that may hold a ternary or a skip call, and lines that
        # mention an architecture-looking name, over-approximated from the text.
        source = self.info.source if self.info else ""
        starts = [0]
        for line in self.lines:
            starts.append(starts[-1] + len(line) + 1)
        self._expr_lines = _match_lines(_TERNARY_RE, source, starts)
        # The resolver found the architecture tokens when it parsed the module (one pass over the text).
        self._arch_lines = {bisect.bisect_right(starts, pos) for pos in self.info.arch_offsets} if self.info else set()
        self._expr_sorted = sorted(self._expr_lines)
        self._arch_sorted = sorted(self._arch_lines)
        self._arch_globals: set | None = None
        self._funcs: list = []  # enclosing defs, innermost last
        self._decorated = None  # the def whose decorators are being read

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
                    text = "\n".join(self.lines[node.lineno - 1: node.end_lineno or node.lineno])
                    if not found or found.isdisjoint(_WORD_RE.findall(text)):
                        continue
                if isinstance(self.resolver.global_value(self.module, name), (ArchBool, ArchNum)):
                    found.add(name)
            self._arch_globals = found
        return self._arch_globals

    def _mentions_arch(self, expr, local, attrs) -> bool:
        first, last = expr.lineno, expr.end_lineno or expr.lineno
        if any(line in self._arch_lines for line in range(first, last + 1)):
            return True
        words = set(_WORD_RE.findall("\n".join(self.lines[first - 1: last])))
        if local and any(isinstance(local.get(w), (ArchBool, ArchNum, Obj)) for w in words):
            return True
        if attrs and any(isinstance(attrs.get(w), (ArchBool, ArchNum)) for w in words):
            return True
        # A call of this module's arch-related def or a read of an arch flag (parse.py's hot names).
        return bool(words & self.info.hot) or bool(words & self._globals())

    def _may_hold_arch(self, stmt, attrs) -> bool:
        """Can anything in this def depend on the architecture? (Skipping the rest halves the run time.)"""
        import bisect

        first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
        i = bisect.bisect_left(self._arch_sorted, first)
        if i < len(self._arch_sorted) and self._arch_sorted[i] <= last:
            return True
        words = set(_WORD_RE.findall("\n".join(self.lines[first - 1: last])))
        if words & self.info.hot or words & self._globals():
            return True
        return bool(attrs) and any(isinstance(attrs.get(w), (ArchBool, ArchNum, Obj)) for w in words)

    def scan(self) -> list[Site]:
        if self.info is not None:
            self._block(self.info.tree.body, [], None, None, None)
        self.sites.sort(key=lambda site: (site.node.lineno, site.node.col_offset))
        return self.sites

    # -- evaluation --------------------------------------------------------------------
    def _value(self, expr, local, attrs):
        if not self._mentions_arch(expr, local, attrs):
            return UNKNOWN
        return Evaluator(self.resolver, self.module, local, attrs).eval(expr)

    def _site(self, expr, kind, scope, local, attrs, stmt, *, guards, polarity=1, role=None, effect="enable", value=None):
        if value is None:
            value = self._value(expr, local, attrs)
        if not isinstance(value, ArchBool) or not value.depends_on_arch:
            return value
        gate_value = value if polarity > 0 else value.not_()
        if callable(guards):  # described only for recorded sites: unparsing every if-body was costly
            guards = guards()
        turns_off = False
        if role is None:
            role = self._role(scope, kind, stmt)
            turns_off = role == "code" and self._inverse(expr, polarity, local, attrs)
        note = None
        hint = classify.hardware_hint(self.lines, stmt.lineno, getattr(stmt, "end_lineno", stmt.lineno) if kind not in ("if", "elif") else expr.end_lineno)
        if hint:
            note = f"nearby text cites {hint!r}: the exclusion may be intentional"
        requires = tuple(hardware.needed(self._guarded_text(kind, stmt))) if role == "code" and not turns_off else ()
        self.sites.append(Site(
            self.module, expr, kind, ".".join(scope) or "<module>", gate_value, role, guards, polarity, stmt,
            dict(local) if local is not None else None, dict(attrs) if attrs is not None else None, note, requires,
            effect, turns_off,
        ))
        return value

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
            names = [t.id if isinstance(t, ast.Name) else getattr(t, "attr", "") for t in targets]
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
        architecture (`if is_sm120: x.use_pdl = False`, `return not _is_sm120`). A lower bound
        (`if major < 9: raise`) is a requirement, not an inverse gate."""
        from tpfuse.audit.plan import atoms

        seen = False
        ev = Evaluator(self.resolver, self.module, local, attrs)
        for atom, pol, _ in atoms(expr, polarity):
            value = to_bool(ev.eval(atom))
            if not value.depends_on_arch:
                continue
            if isinstance(atom, ast.Compare) and len(atom.ops) == 1 and isinstance(atom.ops[0], (ast.NotEq, ast.NotIn)):
                pol, value = -pol, value.not_()
            maybe = [v is not False for v in value.values]
            if pol < 0 and maybe == sorted(maybe, reverse=True):
                continue  # true on a prefix of the archs, oldest first: a minimum capability
            if pol > 0:
                return False
            seen = True
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
            inner = {a.arg: UNKNOWN for a in stmt.args.posonlyargs + stmt.args.args + stmt.args.kwonlyargs}
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
            # `self.sm = get_device_sm()` in __init__ is visible to methods written above it.
            first = [s for s in stmt.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name in _INIT_METHODS]
            self._block(first + [s for s in stmt.body if s not in first], scope + [stmt.name], class_attrs, class_attrs, None)
            return
        self._expressions(stmt, scope, local, attrs)
        if isinstance(stmt, ast.If):
            bail = classify.guard_kind(stmt.body, stmt.test)
            if bail:
                rest = f"rest of {'.'.join(scope) or 'module'}"
                guards = f"{rest} (otherwise {'raises' if bail == 'raise' else 'returns early'})"
                self._site(stmt.test, "guard", scope, local, attrs, stmt, guards=guards, polarity=-1)
            elif classify.disables(stmt.body):
                guards = lambda: f"what the branch turns off: {classify.effects(stmt.body)}"  # noqa: E731
                self._site(stmt.test, kind, scope, local, attrs, stmt, guards=guards, polarity=-1)
            else:
                self._site(stmt.test, kind, scope, local, attrs, stmt, guards=lambda: classify.effects(stmt.body))
            self._block(stmt.body, scope, local, attrs, func)
            if len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If):
                self._stmt(stmt.orelse[0], scope, local, attrs, func, kind="elif")
            else:
                self._block(stmt.orelse, scope, local, attrs, func)
        elif isinstance(stmt, ast.While):
            self._site(stmt.test, "while", scope, local, attrs, stmt, guards=lambda: classify.effects(stmt.body))
            self._block(stmt.body + stmt.orelse, scope, local, attrs, func)
        elif isinstance(stmt, ast.Assert):
            guards = f"rest of {'.'.join(scope) or 'module'} (otherwise AssertionError)"
            self._site(stmt.test, "assert", scope, local, attrs, stmt, guards=guards, polarity=1)
        elif isinstance(stmt, ast.Return) and stmt.value is not None:
            self._site(stmt.value, "return", scope, local, attrs, stmt, guards=f"{func or 'function'}() result")
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            self._assign(stmt, scope, local, attrs)
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and local is not None:
            local[stmt.target.id] = UNKNOWN
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            if local is not None:
                for node in ast.walk(stmt.target):
                    if isinstance(node, ast.Name):
                        local[node.id] = UNKNOWN
            self._block(stmt.body + stmt.orelse, scope, local, attrs, func)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            self._block(stmt.body, scope, local, attrs, func)
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            self._block(stmt.body, scope, local, attrs, func)
            for handler in stmt.handlers:
                self._block(handler.body, scope, local, attrs, func)
            self._block(stmt.orelse + stmt.finalbody, scope, local, attrs, func)
        elif isinstance(stmt, ast.ImportFrom) and local is not None:
            for alias in stmt.names:
                if alias.name != "*":
                    name = alias.asname or alias.name
                    local[name] = self.resolver.import_value(self.module, stmt.module, stmt.level, alias.name) if ARCH_RE.search(alias.name) else UNKNOWN
        elif isinstance(stmt, ast.Match):
            for case in stmt.cases:
                self._block(case.body, scope, local, attrs, func)

    def _assign(self, stmt, scope, local, attrs):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        guards = lambda: " = ".join(ast.unparse(t) for t in targets)  # noqa: E731
        table = self._table_lookup(stmt.value, local, attrs)
        if table is not None:
            # `LIMITS.get(cap, {})`: no conditional at all, the gate is a missing key.
            self._site(stmt.value, "table", scope, local, attrs, stmt, guards=guards, value=table)
        value = self._site(stmt.value, "assign", scope, local, attrs, stmt, guards=guards)
        for target in targets:
            if isinstance(target, ast.Name) and local is not None:
                local[target.id] = value
            elif isinstance(target, ast.Tuple) and local is not None:
                for i, elt in enumerate(target.elts):
                    if isinstance(elt, ast.Name):
                        part = value.map(lambda v, i=i: v[i]) if isinstance(value, ArchNum) else None
                        local[elt.id] = part or UNKNOWN
            elif isinstance(target, ast.Attribute) and attrs is not None and isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"):
                attrs[target.attr] = value

    def _table_lookup(self, expr, local, attrs) -> ArchBool | None:
        """Whether the key of `TABLE.get(<capability>, default)` is in the constant table, per arch."""
        if not (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "get" and expr.args):
            return None
        if not self._mentions_arch(expr, local, attrs):
            return None
        ev = Evaluator(self.resolver, self.module, local, attrs)
        table, key = ev.eval(expr.func.value), ev.eval(expr.args[0])
        if not (isinstance(table, Const) and isinstance(table.value, dict) and isinstance(key, ArchNum)):
            return None
        return ArchBool(tuple((tuple(k) if isinstance(k, list) else k) in table.value for k in key.values))

    def _decorators(self, stmt, scope, local, attrs):
        self._decorated = stmt
        for deco in stmt.decorator_list:
            if not isinstance(deco, ast.Call):
                continue
            name = classify.call_name(deco)
            where = f"{stmt.name}()"
            if name == "supported_compute_capability" and deco.args:
                listed = Evaluator(self.resolver, self.module, local, attrs).eval(deco.args[0])
                values = getattr(listed, "value", None)
                if isinstance(values, tuple) and all(isinstance(v, int) for v in values):
                    value = ArchBool.where(lambda a, vs=values: a.cc_int in vs)
                    self._site(deco, "decorator", scope, local, attrs, deco, guards=where, value=value)
            elif name in classify.SKIP_CALLS and deco.args:
                self._site(deco.args[0], "decorator", scope, local, attrs, deco, guards=where, role="test-skip")

    def _expressions(self, stmt, scope, local, attrs):
        """Ternaries anywhere in the statement's own expressions (not in nested statements)."""
        import bisect

        if not isinstance(stmt, (ast.If, ast.While, ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Match)):
            i = bisect.bisect_left(self._expr_sorted, stmt.lineno)
            if i == len(self._expr_sorted) or self._expr_sorted[i] > (stmt.end_lineno or stmt.lineno):
                return
        for field_name, value in ast.iter_fields(stmt):
            if field_name in ("body", "orelse", "finalbody", "handlers", "decorator_list", "cases"):
                continue
            for node in value if isinstance(value, list) else [value]:
                if isinstance(node, ast.expr) and any(
                    line in self._expr_lines for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                ):
                    self._ternaries(node, scope, local, attrs, stmt, in_message=False)

    def _ternaries(self, node, scope, local, attrs, stmt, in_message):
        if isinstance(node, ast.Call) and classify.call_name(node) in classify.LOG_CALLS | {"format"}:
            in_message = True
        if isinstance(node, ast.JoinedStr):
            in_message = True
        if isinstance(node, ast.Call) and classify.call_name(node) in classify.SKIP_CALLS and node.args:
            self._site(node.args[0], "call", scope, local, attrs, node, guards=f"{classify.call_name(node)}(...)", role="test-skip")
        if isinstance(node, ast.IfExp):
            guards = lambda: f"{ast.unparse(node.body)[:40]} (else {ast.unparse(node.orelse)[:40]})"  # noqa: E731
            role = "message" if in_message or isinstance(stmt, ast.Raise) else None
            if any(classify.call_name(b) in classify.SKIP_CALLS for b in (node.body, node.orelse) if isinstance(b, ast.Call)):
                role = "test-skip"  # `pytest.skip(...) if not family(100) else None`
            self._site(node.test, "ternary", scope, local, attrs, node, guards=guards, role=role)
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.Lambda,)):
                self._ternaries(child, scope, local, attrs, stmt, in_message)
