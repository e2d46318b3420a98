"""Abstract interpretation of one Python expression over the audited architectures.

`Evaluator.eval(node)` maps an `ast` expression to an abstract value (values.py, arch.py): names
are looked up in the local scope, then the module's globals through the `Resolver` (resolve.py),
which follows imports inside the target and falls back to the seeds (predicates.py). Calls to
functions defined in the target are inlined when their text mentions an architecture (one body at
a time, bounded depth), so `_check_cuda_device_version(device_capability_majors=[10])` or a small
`def is_sm120(): return get_device_capability() == (12, 0)` evaluate to the right set. Nothing is
executed; anything the evaluator cannot decide is `UNKNOWN` (or an unknown `ArchBool`).
"""

from __future__ import annotations

import ast
import operator

from tpfuse.audit.arch import ArchBool, ArchNum, compare
from tpfuse.audit.predicates import ALWAYS, ASSUMED_CUDA_VERSION, SEED_GLOBALS, VLLM_PLATFORM, fallback, getter_guess
from tpfuse.audit.values import (
    UNKNOWN,
    Const,
    External,
    LazyImport,
    ModuleRef,
    Obj,
    Partial,
    SeedFn,
    UserClass,
    UserFunc,
)

_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Div: operator.truediv,
}


def _map(fn, seq):
    return tuple(map(_BUILTINS[fn.last] if isinstance(fn, External) else fn.value, seq.value))


# Pure builtins applied to literals, as in `tuple(map(int, torch.version.cuda.split(".")[:2]))`.
_BUILTINS = {
    "int": lambda a, *r: int(a.value, *(x.value for x in r)) if isinstance(a, Const) else int(a),
    "tuple": lambda a: tuple(a.value),
    "list": lambda a: tuple(a.value),
    "map": _map,
    "frozenset": lambda a: frozenset(a.value),
    "set": lambda a: frozenset(a.value),
}


def _norm_key(k):
    return tuple(k) if isinstance(k, list) else k


def to_bool(value) -> ArchBool:
    """Truth value of an abstract value; unknown (None everywhere) when it cannot be told."""
    if isinstance(value, ArchBool):
        return value
    if isinstance(value, Const):
        return ArchBool.const(bool(value.value))
    if isinstance(value, ArchNum):
        return ArchBool(tuple(bool(v) for v in value.values))
    return ArchBool.const(None)


def _device_value(value) -> bool:
    return isinstance(value, (ArchNum, Obj))


def _given(value) -> bool:
    """A value nothing is known of: an unread argument or an unresolved name."""
    return value is UNKNOWN or isinstance(value, External)


def asks_given(test: ast.expr) -> bool:
    """`x is None` / `x is not None`: does the test ask whether a value was given?"""
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot))
            and any(isinstance(n, ast.Constant) and n.value is None for n in (test.left, test.comparators[0])))


def ite(test: ArchBool, a, b, *, override: bool = False):
    """`a if test else b` for abstract values; `override`: the test asks whether a value was given
    (`asks_given`), so a branch nothing is known of is that value, given in place of the device's."""
    if all(v is True for v in test.values):
        return a
    if all(v is False for v in test.values):
        return b
    if a == b:
        return a
    if all(v is None for v in test.values):
        # `cap = get_device_capability() if torch.cuda.is_available() else None`: where the code
        # runs on a GPU, the value is the device's; the None branch is "no GPU".
        if _device_value(a) and isinstance(b, Const) and b.value is None:
            return a
        if _device_value(b) and isinstance(a, Const) and a.value is None:
            return b
        # `arch = _get_device_arch() if _arch is None else _arch`, or `if override is not None: return
        # _parse_arch_str(override)` before `return major * 10 + minor`: the other branch is a value
        # given from outside (a caller's argument, an environment variable) in place of the
        # device's; the default path is the one audited, as for `sm = sm or get_device_sm()`.
        if override and _device_value(a) and _given(b):
            return a
        if override and _device_value(b) and _given(a):
            return b
    if (isinstance(a, Const) and isinstance(b, Const) and None not in test.values and not isinstance(a.value, bool)
        and not isinstance(b.value, bool)):
        # `"a" if major >= 9 else ""`: a value per architecture, e.g. for f"{sm}{suffix}" == "90a"
        return ArchNum(tuple(a.value if t else b.value for t in test.values))
    if isinstance(a, (ArchBool, Const)) and isinstance(b, (ArchBool, Const)):
        return test.and_(to_bool(a)).or_(test.not_().and_(to_bool(b)))
    return UNKNOWN


def atoms(node: ast.expr, polarity: int, parent_or: bool = False):
    """(atom, polarity, parent_is_or) for the leaves of and/or/not trees."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield from atoms(node.operand, -polarity)
    elif isinstance(node, ast.BoolOp):
        for value in node.values:
            yield from atoms(value, polarity, isinstance(node.op, ast.Or))
    else:
        yield node, polarity, parent_or


def seed_for(name: str):
    """The seeded value of a bare name: ALWAYS, the seeded globals, then the helper fallback."""
    if name in ALWAYS:
        return ALWAYS[name]
    if name in SEED_GLOBALS:
        return SEED_GLOBALS[name]
    return fallback(name)


# node type -> the Evaluator method that reads it (False: none)
_HANDLERS: dict = {}


class Evaluator:
    """Evaluates expressions of module `module` with local bindings `local` and `self.` attributes `attrs`."""

    def __init__(self, resolver, module: str, local: dict | None = None, attrs: dict | None = None, depth: int = 0,
                 overrides: dict | None = None, class_name: str | None = None):
        self.overrides = overrides or {}
        self.resolver = resolver
        self.module = module
        self.local = local
        self.attrs = attrs
        self.depth = depth
        self.class_name = class_name  # the class whose methods are being read (`cls.X` where X is inherited)

    def eval(self, node):
        if self.overrides and id(node) in self.overrides:
            return self.overrides[id(node)]
        kind = type(node)
        method = _HANDLERS.get(kind)
        if method is None:  # the method named after the node type, looked up once per type
            method = _HANDLERS[kind] = getattr(Evaluator, "_" + kind.__name__, False)
        return method(self, node) if method else UNKNOWN

    # -- leaves -------------------------------------------------------------------------
    def _Constant(self, node):
        return Const(node.value)

    def _Tuple(self, node):
        items = [self.eval(e) for e in node.elts]
        if all(isinstance(i, Const) for i in items):
            return Const(tuple(i.value for i in items))
        if all(isinstance(i, (Const, ArchNum)) for i in items):  # (major, minor) after unpacking
            weak = any(isinstance(i, ArchNum) and i.weak for i in items)
            return ArchNum.of(lambda a: tuple(i.at(a) if isinstance(i, ArchNum) else i.value for i in items), weak=weak)
        return UNKNOWN

    _List = _Set = _Tuple

    def _Dict(self, node):
        keys = [self.eval(k) if k is not None else UNKNOWN for k in node.keys]
        if not all(isinstance(k, Const) for k in keys):
            return UNKNOWN
        # A table keyed by capability is a gate through its keys; a value that cannot be read
        # (`64 * MiB` of an unread name, a kernel class) stands as `...`, which is truthy.
        values = [self.eval(v) for v in node.values]
        try:
            return Const({k.value: v.value if isinstance(v, Const) else ... for k, v in zip(keys, values)})
        except TypeError:
            return UNKNOWN

    def _JoinedStr(self, node):
        """f"{major}{minor}" (FlashInfer's _match_sm_version) -> a string per architecture."""
        parts = []
        for value in node.values:
            if isinstance(value, ast.FormattedValue):
                if value.format_spec is not None or value.conversion not in (-1, ord("s")):
                    return UNKNOWN
                value = self.eval(value.value)
            else:
                value = self.eval(value)
            if not isinstance(value, (Const, ArchNum)):
                return UNKNOWN
            parts.append(value)
        if not any(isinstance(p, ArchNum) for p in parts):
            return UNKNOWN
        return ArchNum.of(lambda a: "".join(str(p.at(a) if isinstance(p, ArchNum) else p.value) for p in parts))

    def _Name(self, node):
        if self.local is not None and node.id in self.local:
            value = self.local[node.id]
            if isinstance(value, LazyImport):
                value = self.local[node.id] = self.resolver.import_value(self.module, value.module, value.level,
                                                                         value.name)
            return value
        return self.resolver.global_value(self.module, node.id)

    def _Attribute(self, node):
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") and self.attrs is not None:
            return self.attrs.get(node.attr, UNKNOWN)
        return self.attribute(self.eval(node.value), node.attr)

    def attribute(self, base, attr: str):
        if isinstance(base, ModuleRef):
            return self.resolver.module_attr(base.name, attr)
        if isinstance(base, External):
            if base.dotted.endswith("torch.version") or base.dotted == "version":
                return Const(ASSUMED_CUDA_VERSION) if attr == "cuda" else Const(None) if attr == "hip" else UNKNOWN
            return seed_for(attr) or External(f"{base.dotted}.{attr}")
        if isinstance(base, Obj):
            return base.attr(attr)
        if isinstance(base, UserClass):
            return base.method(attr) or UNKNOWN
        if isinstance(base, ArchNum) and attr in ("major", "minor"):
            return base.map(lambda v: v[0 if attr == "major" else 1]) or UNKNOWN
        return UNKNOWN

    def _Slice(self, node):
        parts = [self.eval(p) if p is not None else Const(None) for p in (node.lower, node.upper, node.step)]
        return Const(slice(*(p.value for p in parts))) if all(isinstance(p, Const) for p in parts) else UNKNOWN

    def _Subscript(self, node):
        base, index = self.eval(node.value), self.eval(node.slice)
        if isinstance(base, Const) and isinstance(index, Const):
            try:
                return Const(base.value[index.value])
            except Exception:  # noqa: BLE001 - a literal subscript that fails is not a gate
                return UNKNOWN
        if isinstance(base, ArchNum) and isinstance(index, Const) and isinstance(index.value, int):
            return base.map(lambda v: v[index.value]) or UNKNOWN
        return UNKNOWN

    # -- operators ----------------------------------------------------------------------
    def _BinOp(self, node):
        fn = _BINOPS.get(type(node.op))
        left, right = self.eval(node.left), self.eval(node.right)
        if fn is None:
            return UNKNOWN
        if isinstance(left, Const) and isinstance(right, Const):
            try:
                return Const(fn(left.value, right.value))
            except Exception:  # noqa: BLE001 - a literal expression that raises is simply not a gate
                return UNKNOWN
        if isinstance(left, ArchNum) and isinstance(right, Const):
            return left.map(lambda v: fn(v, right.value)) or UNKNOWN
        if isinstance(left, Const) and isinstance(right, ArchNum):
            return right.map(lambda v: fn(left.value, v)) or UNKNOWN
        if isinstance(left, ArchNum) and isinstance(right, ArchNum):
            try:
                return ArchNum(tuple(fn(a, b) for a, b in zip(left.values, right.values)), left.weak or right.weak)
            except Exception:  # noqa: BLE001
                return UNKNOWN
        return UNKNOWN

    def _UnaryOp(self, node):
        value = self.eval(node.operand)
        if isinstance(node.op, ast.Not):
            return to_bool(value).not_()
        if isinstance(node.op, ast.USub) and isinstance(value, Const) and isinstance(value.value, (int, float)):
            return Const(-value.value)
        return UNKNOWN

    def _BoolOp(self, node):
        items = [self.eval(v) for v in node.values]
        if (isinstance(node.op, ast.Or) and isinstance(items[-1], ArchNum)
            and all(_given(i) for i in items[:-1])):
            # `sm = sm or get_device_sm()`: a caller's value when given, otherwise the device's.
            return items[-1]
        result = to_bool(items[0])
        for value in items[1:]:
            value = to_bool(value)
            result = result.and_(value) if isinstance(node.op, ast.And) else result.or_(value)
        return result

    def _Compare(self, node):
        left = self.eval(node.left)
        result = ArchBool.const(True)
        for op, comp in zip(node.ops, node.comparators):
            right = self.eval(comp)
            result = result.and_(self._compare_pair(type(op).__name__, left, right))
            left = right
        return result

    def _compare_pair(self, op: str, left, right) -> ArchBool:
        if op in ("Is", "IsNot"):
            # `cap is None` / `cap is not None` for the device's capability: it exists on every audited GPU.
            if (_device_value(left) and isinstance(right, Const) and right.value is None
                    or _device_value(right) and isinstance(left, Const) and left.value is None):
                return ArchBool.const(op == "IsNot")
            return ArchBool.const(None)
        if isinstance(left, ArchBool) and isinstance(right, Const) and op in ("Eq", "NotEq"):
            same = left if bool(right.value) else left.not_()
            return same if op == "Eq" else same.not_()
        if isinstance(left, (ArchNum, Const)) and isinstance(right, (ArchNum, Const)):
            lv = left if isinstance(left, ArchNum) else left.value
            rv = right if isinstance(right, ArchNum) else right.value
            return compare(op, lv, rv) or ArchBool.const(None)
        return ArchBool.const(None)

    def _IfExp(self, node):
        return ite(to_bool(self.eval(node.test)), self.eval(node.body), self.eval(node.orelse),
                   override=asks_given(node.test))

    # -- calls --------------------------------------------------------------------------
    def _Call(self, node):
        func_node = node.func
        if (isinstance(func_node, ast.Attribute) and isinstance(func_node.value, ast.Name)
            and func_node.value.id in ("self", "cls")):
            # a method of the class being scanned (`cls.is_sm120()`, `self._use_fast()`): bound in its attributes;
            # one it inherits from a platform class means what a platform's method of that name means
            func = self.attrs.get(func_node.attr, UNKNOWN) if self.attrs is not None else UNKNOWN
            if not isinstance(func, UserFunc) and self.class_name and "platform" in self.class_name.lower():
                func = VLLM_PLATFORM.attr(func_node.attr)
            if not isinstance(func, (UserFunc, SeedFn)):
                return UNKNOWN
        elif isinstance(func_node, ast.Attribute):
            base = self.eval(func_node.value)
            if isinstance(base, Const) and isinstance(base.value, str) and func_node.attr == "split":
                args = [self.eval(a) for a in node.args]
                if all(isinstance(a, Const) for a in args):
                    return Const(tuple(base.value.split(*(a.value for a in args))))
            if isinstance(base, Const) and isinstance(base.value, dict) and func_node.attr == "get" and node.args:
                key = self.eval(node.args[0])
                default = self.eval(node.args[1]) if len(node.args) > 1 else Const(None)
                if isinstance(key, ArchNum) and isinstance(default, Const):
                    return key.map(lambda k: base.value.get(_norm_key(k), default.value)) or UNKNOWN
            if isinstance(base, ArchNum):
                if func_node.attr == "to_int":
                    return base.map(lambda v: v[0] * 10 + v[1]) or UNKNOWN
                return UNKNOWN
            func = self.attribute(base, func_node.attr) if base is not UNKNOWN else UNKNOWN
        else:
            func = self.eval(func_node)
        if func is UNKNOWN and isinstance(func_node, (ast.Name, ast.Attribute)):
            # an undefined or unreadable getter named as one (`get_jit_cuda_arch()`): the capability, guessed
            guess = getter_guess(func_node.id if isinstance(func_node, ast.Name) else func_node.attr)
            if guess is not None:
                return guess
        if func is UNKNOWN:
            return UNKNOWN
        args = [UNKNOWN if isinstance(a, ast.Starred) else self.eval(a) for a in node.args]
        kwargs = {k.arg: self.eval(k.value) for k in node.keywords if k.arg}
        return self.call(func, args, kwargs)

    def call(self, func, args: list, kwargs: dict):
        if isinstance(func, SeedFn):
            return func.call(args, kwargs)
        if isinstance(func, Partial):
            return self.call(func.func, list(func.args) + args, {**func.kwargs, **kwargs})
        if isinstance(func, UserFunc):
            value = self.resolver.call_user(func, args, kwargs, self.depth + 1)
            if value is UNKNOWN or isinstance(value, External):  # External: a name it returns is bound nowhere readable
                return getter_guess(func.name) or value
            return value
        if isinstance(func, External):
            seed = seed_for(func.last)
            if seed is not None:
                return self.call(seed, args, kwargs)
            guess = getter_guess(func.last)
            if guess is not None:
                return guess
            if func.last in ("tuple", "int") and args and isinstance(args[0], ArchNum):
                return args[0]
            if func.last == "str" and args and isinstance(args[0], ArchNum):
                return args[0].map(str) or UNKNOWN
            if func.last in _BUILTINS and all(isinstance(a, (Const, External)) for a in args):
                try:
                    return Const(_BUILTINS[func.last](*args))
                except Exception:  # noqa: BLE001
                    return UNKNOWN
        if isinstance(func, External) or func is UNKNOWN:
            return UNKNOWN
        return UNKNOWN
