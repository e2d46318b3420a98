"""Is an architecture condition a feature gate, and what does it guard?

Categories: `gate` (turns a feature, backend or code path on or off), and the non-gates the
research lists as false positives (gate-idioms.md section 6): `helper-definition` (the body of an
arch predicate itself), `flag-definition` (a cached flag named after an architecture, e.g.
`_is_sm100_supported = ...`: the gates are where it is read), `test` / `test-skip`, `log` (a branch
that only logs) and `message` (a condition inside a log or error message).
"""

from __future__ import annotations

import ast
import re

# Function names that define predicates rather than use them.
PRED_NAME_RE = re.compile(
    r"^_?(is|has|check|get)_\w*(sm_?\d|sm\d+x|blackwell|hopper|ampere|capability|device_version|device_sm)\w*$|"
    r"^_?check_cuda_device_version$",
    re.IGNORECASE,
)
# Flag names spelled after an architecture (cached predicates).
FLAG_NAME_RE = re.compile(r"(^|_)(sm_?\d{2,3}[af]?|sm\d+x|blackwell|hopper|ampere)(_|$)|^_?is_sm", re.IGNORECASE)
LOG_CALLS = {
    "debug", "info", "warning", "warn", "error", "exception", "critical", "warning_once", "info_once",
    "debug_once", "print", "print_once", "log", "log_info_on_rank0", "print_warning_once",
}
SKIP_CALLS = {"skip", "skipTest", "skipif", "skipIf", "skipUnless", "xfail"}
# Words that, near an exclusion, say it is deliberate (gate-idioms.md section 3.14).
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


def guard_kind(body: list) -> str | None:
    """'raise' / 'return' when an if-body only bails out (the feature is what follows), else None."""
    effects = [s for s in body if not is_log_stmt(s)]
    if len(effects) == 1 and isinstance(effects[0], ast.Raise):
        return "raise"
    if len(effects) == 1 and isinstance(effects[0], ast.Return) and _falsy(effects[0].value):
        return "return"
    return None


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
