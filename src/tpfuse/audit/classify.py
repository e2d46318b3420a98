"""Is an architecture condition a feature gate, and what does it guard?

Categories: `gate` (turns a feature, backend or code path on or off), and the non-gates that a
text search mistakes for gates: `helper-definition` (the body of an arch predicate itself),
`flag-definition` (a cached flag named after an architecture, e.g. `_is_sm100_supported = ...`:
the gates are where it is read), `test` / `test-skip`, `log` (a branch
that only logs) and `message` (a condition inside a log or error message).
"""

from __future__ import annotations

import ast
import re

from tpfuse.audit.predicates import CAP_ANY, CAP_INT, CAP_MAJOR, CAP_TUPLE

# Function names that define predicates rather than use them.
PRED_NAME_RE = re.compile(
    r"^_?(is|has|check|get)_\w*(sm_?\d|sm\d+x|blackwell|hopper|ampere|capability|device_version|device_sm)\w*$|"
    r"^_?check_cuda_device_version$",
    re.IGNORECASE,
)
# Functions whose capability parameter is the device's (vLLM attention backends' classmethod).
CAPABILITY_FUNC_RE = re.compile(r"supports?_(compute_)?capabilit|is_supported_capabilit|capability_supported")
CAPABILITY_PARAM_RE = re.compile(r"(device_|compute_)?capability|cap|cc")
# Parameter names that are the device's capability in any function (FlashInfer, vLLM) ...
CAPABILITY_PARAMS = frozenset({"compute_capability", "device_capability", "capability", "cuda_capability"})
# ... and its integer form (major*10+minor).
SM_INT_PARAMS = frozenset({"sm_version", "device_sm", "sm_arch"})
# Flag names spelled after an architecture (cached predicates).
FLAG_NAME_RE = re.compile(r"(^|_)(sm_?\d{2,3}[af]?|sm\d+x|blackwell|hopper|ampere)(_|$)|^_?is_sm", re.IGNORECASE)
LOG_CALLS = {
    "debug", "info", "warning", "warn", "error", "exception", "critical", "warning_once", "info_once",
    "debug_once", "print", "print_once", "log", "log_info_on_rank0", "print_warning_once",
}
SKIP_CALLS = {"skip", "skipTest", "skipif", "skipIf", "skipUnless", "xfail"}
# Words that, near an exclusion, say it is deliberate.
HARDWARE_WORDS = re.compile(
    r"tcgen05|\btmem\b|wgmma|\btma\b|multicast|cvt\.rs|illegal instruction|datacenter|"
    r"not supported on|unsupported on|lacks?\b|corrupt",
    re.IGNORECASE,
)


def call_name(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def is_test_path(rel: str) -> bool:
    parts = rel.replace("\\", "/").split("/")
    name = parts[-1]
    return (
        any(p in ("test", "tests", "testing") for p in parts[:-1])
        or name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"
    )


def is_log_stmt(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Pass) or (
        isinstance(stmt, ast.Expr) and (isinstance(stmt.value, ast.Constant) or call_name(stmt.value) in LOG_CALLS)
    )


def is_skip_stmt(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and call_name(stmt.value) in SKIP_CALLS or (
        isinstance(stmt, ast.Raise) and stmt.exc is not None and "SkipTest" in call_name(stmt.exc)
    )


def _short(text: str, limit: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _falsy(node: ast.expr | None) -> bool:
    if node is None:
        return True
    if isinstance(node, ast.Constant):
        return not node.value
    return isinstance(node, (ast.Dict, ast.List, ast.Tuple)) and not (getattr(node, "keys", None) or getattr(node, "elts", None))


def is_negative_test(test: ast.expr) -> bool:
    """`not X`, `x != y`, `x not in t`, or and/or of such: how a "not supported here" check reads."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return True
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.NotEq, ast.NotIn)):
        return True
    # `not a or not b` and, by De Morgan, `not a and not b` (= `not (a or b)`).
    return isinstance(test, ast.BoolOp) and all(is_negative_test(v) for v in test.values)


def guard_kind(body: list, test: ast.expr | None = None) -> str | None:
    """'raise' / 'return' when an if-body only bails out (the feature is what follows), else None.

    A return of a falsy value bails out; so does any single return under a negative test
    (`if not is_sm120(): return original_kernel`, `if cap != (12, 0): return "device is not SM120"`)."""
    effects = [s for s in body if not is_log_stmt(s)]
    if len(effects) == 1 and isinstance(effects[0], ast.Raise):
        return "raise"
    if len(effects) == 1 and isinstance(effects[0], ast.Return):
        if _falsy(effects[0].value) or (test is not None and is_negative_test(test)):
            return "return"
    return None


_OFF_NAME_RE = re.compile(r"disable|skip|^no_|_off$|fallback|unsupported|workaround", re.IGNORECASE)
_OFF_LIST_RE = re.compile(r"unsupported|reasons|errors|missing|blocked|disabled|incompatible", re.IGNORECASE)


def _target_name(node: ast.AST) -> str:
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return str(node.slice.value)
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")


def disables(body: list) -> bool:
    """Does an if-body only turn something off? (`x.use_pdl = False`, `opts["disable_x"] = True`,
    `unsupported.append(...)`): then the feature is on where the condition is false."""
    effects = [s for s in body if not is_log_stmt(s)]
    if not effects:
        return False
    for stmt in effects:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
            names = [_target_name(t) for t in stmt.targets]
            if stmt.value.value is True and names and all(_OFF_NAME_RE.search(n) for n in names):
                continue
            if not stmt.value.value and stmt.value.value is not True and not any(_OFF_NAME_RE.search(n) for n in names):
                continue
            return False
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and call_name(stmt.value) in ("append", "add", "extend"):
            owner = stmt.value.func.value if isinstance(stmt.value.func, ast.Attribute) else None
            if owner is None or not _OFF_LIST_RE.search(_target_name(owner)):
                return False
        else:
            return False
    return True


def effects(body: list, limit: int = 2) -> str:
    """What an if-body does, in a line: `enable_x = True; return {...}`."""
    out = []
    for stmt in body:
        if is_log_stmt(stmt):
            continue
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            value = ast.unparse(stmt.value) if stmt.value is not None else ""
            out.append(_short(f"{' = '.join(ast.unparse(t) for t in targets)} = {value}"))
        elif isinstance(stmt, ast.Return):
            out.append(_short(f"return {ast.unparse(stmt.value) if stmt.value else 'None'}"))
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            out.append(_short(f"{ast.unparse(stmt.value.func)}(...)"))
        elif isinstance(stmt, ast.Raise):
            out.append(_short(f"raise {call_name(stmt.exc) if stmt.exc else ''}"))
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            out.append(_short(ast.unparse(stmt)))
        elif isinstance(stmt, ast.If):
            out.append(_short(f"if {ast.unparse(stmt.test)}: ...", 50))
        else:
            out.append(type(stmt).__name__.lower())
        if len(out) >= limit:
            break
    return "; ".join(out) or "nothing"


def hardware_hint(lines: list[str], start: int, end: int) -> str | None:
    """A hardware reason cited in the comments/messages within 3 lines of the site, if any."""
    # 3 lines: the comment above a condition or the message right below it.
    window = "\n".join(lines[max(0, start - 4): min(len(lines), end + 3)])
    m = HARDWARE_WORDS.search(window)
    return m.group(0) if m else None


def capability_params(func) -> dict:
    """Parameters that carry the device's capability, by their names (the caller passes the device's):
    vLLM's `supports_compute_capability(cls, capability)`, FlashInfer's `_compile_kernel(...,
    compute_capability)`, `(major, minor)` pairs, `sm_version`, `arch_major`."""
    params = [a.arg for a in func.args.posonlyargs + func.args.args + func.args.kwonlyargs]
    out = {}
    capability_func = bool(CAPABILITY_FUNC_RE.search(func.name))
    for name in params:
        if name in CAPABILITY_PARAMS or capability_func and CAPABILITY_PARAM_RE.fullmatch(name):
            out[name] = CAP_ANY
        elif name in SM_INT_PARAMS:
            out[name] = CAP_INT
        elif name == "arch_major":
            out[name] = CAP_MAJOR
    if "major" in params and "minor" in params:
        out["major"], out["minor"] = CAP_MAJOR, CAP_TUPLE.map(lambda v: v[1])
    return out
