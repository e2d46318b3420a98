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
CAPABILITY_PARAMS = frozenset({"compute_capability", "device_capability", "capability", "cuda_capability",
                               "device_arch"})
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
    return (isinstance(node, (ast.Dict, ast.List, ast.Tuple))
            and not (getattr(node, "keys", None) or getattr(node, "elts", None)))


def is_negative_test(test: ast.expr) -> bool:
    """`not X`, `x != y`, `x not in t`, or and/or of such: how a "not supported here" check reads."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return True
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.NotEq, ast.NotIn)):
        return True
    # `not a or not b` and, by De Morgan, `not a and not b` (= `not (a or b)`).
    return isinstance(test, ast.BoolOp) and all(is_negative_test(v) for v in test.values)


def _preparing(stmt: ast.stmt) -> bool:
    """A statement that only prepares a bail-out: the message's assignment, a log call, an `assert`."""
    return is_log_stmt(stmt) or isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Assert)) or (
        isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
        and isinstance(stmt.value.func, ast.IfExp))  # `(logger.warning if explicit else logger.info)(message)`


def guard_kind(body: list, test: ast.expr | None = None) -> str | None:
    """'raise' / 'return' when an if-body only bails out (the feature is what follows), else None.

    The body ends in a raise, or in a return of a falsy value (`return False`, `return None, "why"`
    keeps the failure first), after statements that only build its message or log it; any return
    under a negative test bails out too (`if not is_sm120(): return original_kernel`,
    `if cap != (12, 0): return "device is not SM120"`). A body of asserts only refuses as a raise does."""
    effects = [s for s in body if not is_log_stmt(s)]
    if effects and all(isinstance(s, ast.Assert) for s in effects):
        return "raise"
    if not effects or not all(_preparing(s) for s in effects[:-1]):
        return None
    last = effects[-1]
    if isinstance(last, ast.Raise):
        return "raise"
    if isinstance(last, ast.Return):
        value = last.value
        if isinstance(value, ast.Tuple) and value.elts:
            value = value.elts[0]
        if _falsy(value) or (test is not None and is_negative_test(test)):
            return "return"
    return None


_OFF_NAME_RE = re.compile(r"disable|skip|^no_|_off$|fallback|unsupported|workaround", re.IGNORECASE)
_OFF_CALL_RE = re.compile(r"disable|deactivate|turn_off|_off$", re.IGNORECASE)
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
        elif (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
              and call_name(stmt.value) in ("append", "add", "extend")):
            owner = stmt.value.func.value if isinstance(stmt.value.func, ast.Attribute) else None
            if owner is None or not _OFF_LIST_RE.search(_target_name(owner)):
                return False
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and _switches_off(stmt.value):
            continue
        else:
            return False
    return True


def _switches_off(call: ast.Call) -> bool:
    """`disable_pdl()`, `set_options(use_x=False)`, `update_constraints({"is_persistent": False})`: a call
    named as turning something off, or whose every argument turns options off."""
    name = call_name(call)
    if name in SKIP_CALLS or name in LOG_CALLS:
        return False
    if _OFF_CALL_RE.search(name):
        return True
    values = list(call.args) + [k.value for k in call.keywords]
    flat = []
    for v in values:
        flat.extend(v.values if isinstance(v, ast.Dict) else [v])
    return (bool(flat)
            and all(isinstance(v, ast.Constant) and v.value in (False, None) and v.value is not True for v in flat))


def _numeric(node) -> bool:
    """A tuning value: a number (not a bool, nor 0 / 1, which read as flags), or a tuple/list/dict of numbers."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool) and node.value not in (0, 1)
    if isinstance(node, (ast.Tuple, ast.List)):
        return (bool(node.elts)
                and all(_numeric(e) or isinstance(e, ast.Constant) and e.value in (0, 1) for e in node.elts))
    if isinstance(node, ast.Dict):
        return bool(node.values) and all(_numeric(v) for v in node.values)
    return False


# Names whose number selects a feature rather than tunes one (`fa_version = 4`, `backend_id = 2`).
_FEATURE_NAME_RE = re.compile(r"version|backend|impl|mode|kind|method|algo|use_|enable|disable|flag|dtype|format|level",
                              re.IGNORECASE)
# Names of tuning knobs: 0 and 1 are sizes or counts there (`NUM_STAGES = 1`), not flags.
TUNING_NAME_RE = re.compile(r"warps|stages|block|tile|split|chunk|segment|cluster|thread|cta|wave|unroll|pipeline|"
                            r"rows_per|cols_per|num_|^n_|_size$|^bt$|^bk$|^bm$|^bn$|^blk", re.IGNORECASE)
# Flags named as a requirement or a workaround (`_prefill_needs_fp32_state`, `tuned_large_head`): set on the
# architectures that need it, they change a default there and enable nothing elsewhere.
QUIRK_FLAG_RE = re.compile(r"needs?_|_needs|requires?_|workaround|must_|force_|tuned|tuning|heuristic|prefer",
                           re.IGNORECASE)


def _number_for(node, name: str = "") -> bool:
    return _numeric(node) or bool(TUNING_NAME_RE.search(name)) and (
        isinstance(node, ast.Constant) and node.value in (0, 1) and node.value is not True and node.value is not False
        or isinstance(node, (ast.BinOp, ast.Call)) or isinstance(node, ast.IfExp) and tuning_choice(node, name))


def tunes(body: list) -> bool:
    """Does a branch only set tuning values (`num_warps = 4`, `BT = 8`, `return 36864, 4096`,
    `update_constraints({"num_warps": w})`)? Then it changes a default and enables nothing: a
    per-architecture tuning or workaround, not a gate."""
    effects = [s for s in body if not is_log_stmt(s)]
    for s in effects:
        if isinstance(s, ast.Return) and s.value is not None and _numeric(s.value):
            continue
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and s.value.args and all(
                isinstance(a, ast.Dict) and a.keys and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                                          and TUNING_NAME_RE.search(k.value) for k in a.keys)
                for a in s.value.args):
            continue
        if not (isinstance(s, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and s.value is not None):
            return False
        targets = s.targets if isinstance(s, ast.Assign) else [s.target]
        names = [_target_name(e) for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        if any(_FEATURE_NAME_RE.search(n) for n in names):
            return False
        if not (_numeric(s.value) or names and all(_number_for(s.value, n) for n in names)):
            return False
    return bool(effects)


def tuning_choice(node: ast.IfExp, name: str = "") -> bool:
    """`16 if is_sm103 else 8`: a ternary between two tuning values (0 and 1 count for a tuning name)."""
    return all(_numeric(b) or bool(TUNING_NAME_RE.search(name)) and (
        isinstance(b, ast.Constant) and b.value in (0, 1) and not isinstance(b.value, bool)
        or isinstance(b, ast.IfExp) and tuning_choice(b, name)) for b in (node.body, node.orelse))


WORKAROUND_RE = re.compile(r"does not support|doesn't support|not (?:yet )?supported|workaround|work around|\bbug\b|"
                           r"broken|miscompil|slower|regress|\bhangs?\b|deadlock|illegal|incorrect|wrong result|"
                           r"unstable|instead of|falls? back", re.IGNORECASE)
# Functions that choose among tuned options (`_heuristic_func_mm_fp4`, `_get_tuned_matmul_arch_family`).
TUNING_FUNC_RE = re.compile(r"heuristic|tuned|tuning|autotune|measured|knob|_pick_|cluster_n\b|num_warps|num_stages",
                            re.IGNORECASE)


def workaround_hint(lines: list, start: int, end: int) -> bool:
    """Do the comments and messages within 2 lines of the site say it works around something?"""
    window = "\n".join(lines[max(0, start - 3): min(len(lines), end + 2)])
    return bool(WORKAROUND_RE.search(window))


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


# Parameter names of a capability's integer forms: `sm_major` / `arch_major` / `device_sm_major` (a
# major), `sm_version` / `device_sm` (major*10+minor), `device_arch` (a capability in any form).
_MAJOR_PARAM_RE = re.compile(r"(?:^|_)(?:sm|arch|cc|capability|compute_capability)_major$")


def capability_params(func) -> dict:
    """Parameters that carry the device's capability, by their names (the caller passes the device's):
    vLLM's `supports_compute_capability(cls, capability)`, FlashInfer's `_compile_kernel(...,
    compute_capability)`, `(major, minor)` pairs, `sm_version`, `sm_major` / `arch_major`."""
    params = [a.arg for a in func.args.posonlyargs + func.args.args + func.args.kwonlyargs]
    out = {}
    capability_func = bool(CAPABILITY_FUNC_RE.search(func.name))
    for name in params:
        if name in CAPABILITY_PARAMS or capability_func and CAPABILITY_PARAM_RE.fullmatch(name):
            out[name] = CAP_ANY
        elif name in SM_INT_PARAMS:
            out[name] = CAP_INT
        elif _MAJOR_PARAM_RE.search(name):
            out[name] = CAP_MAJOR
    if "major" in params and "minor" in params:
        out["major"], out["minor"] = CAP_MAJOR, CAP_TUPLE.map(lambda v: v[1])
    return out
