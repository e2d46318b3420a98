"""Report-only scanning of C/C++/CUDA arch tests (preprocessor and runtime) and CMake arch lists.

`#if`/`#elif` lines (joined across `\\` continuations) that mention `__CUDA_ARCH__` are translated
to a Python expression and evaluated per architecture with `__CUDA_ARCH__` = major*100+minor*10;
`__CUDA_ARCH_FEAT_SM<N>_ALL` / `__CUDA_ARCH_SPECIFIC__` style macros are treated as true for the
architecture they name and other identifiers as unknown. CMake: quoted arch lists such as
`cuda_archs_loose_intersection(X "10.0f;12.0a" ...)` or `set(CUDA_ARCHS "9.0;10.0")` are read as
sets (an `f` suffix means the whole major family). Runtime C++ comparisons of an integer
capability (`if (sm >= 100 && sm < 120)`, `getSMVersion() == 90`) are read with the integer
being major*10+minor. These findings are never patched: what a kernel
is compiled for is a build decision, reported so the reader knows the Python gate is not the only one.
"""

from __future__ import annotations

import ast
import re

from tpfuse.audit.arch import ARCHS, ArchBool, ArchNum, compare
from tpfuse.audit.verdict import ArchCondition, number_repeats, stable_id

_PP_RE = re.compile(r"^\s*#\s*(if|elif)\b(.*)$")
_FEAT_RE = re.compile(r"__CUDA_ARCH_FEAT_SM(\d+)_ALL")
_CMAKE_LIST_RE = re.compile(r'"((?:\s*(?:sm_)?\d{1,2}\.?\d[af]?\s*;)+\s*(?:sm_)?\d{1,2}\.?\d[af]?\s*'
                            r'|(?:sm_)?\d{1,2}\.\d[af]?)"')
_CMAKE_CONTEXT_RE = re.compile(r"arch|CUDA_ARCHS|ARCHITECTURES", re.IGNORECASE)


def _translate(expr: str) -> str:
    """A C/C++ condition as Python expression text: `defined(X)` -> `__defined__X`, &&/||/! -> and/or/not."""
    expr = re.sub(r"//.*$|/\*.*?\*/", "", expr)
    expr = re.sub(r"defined\s*\(\s*(\w+)\s*\)|defined\s+(\w+)", lambda m: f"__defined__{m.group(1) or m.group(2)}",
                  expr)
    # C++ spellings Python cannot parse, as opaque names: `ns::f<T, W>()` -> `ns__f()`, `p->x` -> `p.x`
    expr = re.sub(r"<[\w\s,:*&]*>(?=\s*(?:\(|::))", "", expr).replace("::", "__").replace("->", ".")
    expr = expr.replace("&&", " and ").replace("||", " or ")
    expr = re.sub(r"!(?!=)", " not ", expr)
    return expr


def _bool(v) -> ArchBool:
    if isinstance(v, ArchBool):
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return ArchBool.const(bool(v))
    return ArchBool.const(None)


def evaluate(expr: str, name_value, number_ok=lambda n: True) -> ArchBool | None:
    """The one C++ mini-evaluator: `expr` per architecture, or None if it does not parse.

    `name_value(identifier)` gives an identifier's value (an `ArchNum`, an `ArchBool`, or None for
    unknown); a comparison of an `ArchNum` with an integer is decided when `number_ok(integer)`
    (the runtime form accepts only SM integers), anything else is unknown (Kleene logic)."""
    try:
        tree = ast.parse(_translate(expr).strip(), mode="eval")
    except SyntaxError:
        return None

    def ev(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return name_value(node.id)
        if isinstance(node, ast.BoolOp):
            out = _bool(ev(node.values[0]))
            for v in node.values[1:]:
                out = out.and_(_bool(ev(v))) if isinstance(node.op, ast.And) else out.or_(_bool(ev(v)))
            return out
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return _bool(ev(node.operand)).not_()
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right = ev(node.left), ev(node.comparators[0])
            number = right if isinstance(left, ArchNum) else left if isinstance(right, ArchNum) else None
            if isinstance(number, int) and not isinstance(number, bool) and number_ok(number):
                return compare(type(node.ops[0]).__name__, left, right)
        return None

    return _bool(ev(tree.body))


_CUDA_ARCH = ArchNum.of(lambda a: a.cuda_arch)


def _preprocessor_name(name: str):
    """`__CUDA_ARCH__` is major*100+minor*10 and defined; `__CUDA_ARCH_FEAT_SM<N>_ALL` holds on sm<N> only."""
    if name == "__CUDA_ARCH__":
        return _CUDA_ARCH
    if name == "__defined____CUDA_ARCH__":
        return ArchBool.const(True)
    m = _FEAT_RE.search(name)
    if m:
        return ArchBool.where(lambda a: a.cc_int == int(m.group(1)))
    if name.startswith("__defined__") and name.endswith("_IDE__"):
        return ArchBool.const(False)  # __CLION_IDE__, __VSCODE_IDE__: defined by editors, never by a compiler
    return None


def _cmake_set(text: str) -> ArchBool:
    items = [i.strip().lower().removeprefix("sm_") for i in text.split(";") if i.strip()]
    wanted = []
    for item in items:
        family = item.endswith("f")
        digits = item.rstrip("af").replace(".", "")
        major, minor = int(digits[:-1]), int(digits[-1])
        wanted.append((major, minor, family))
    return ArchBool.where(lambda a: any(a.major == m and (f and a.minor >= n or a.minor == n) for m, n, f in wanted))


def _finding(rel, line, kind, condition, value: ArchBool, language, guards):
    return ArchCondition(
        id=stable_id(rel, kind, condition), path=rel, line=line, end_line=line, column=1, scope="<file>", kind=kind,
        condition=condition, guards=guards, values={a.name: value.at(a) for a in ARCHS}, weak=True,
        language=language, report_only=True,
    )


# Runtime capability integers in C++: `if (sm >= 100 && sm < 120)`,
# `return smVersion == 100 || smVersion == 103;`, `TVM_FFI_ICHECK(sm_version >= 100)`.
_CAP_NAME = (r"(?:sm|sm_?version|smVersion|sm_?ver|sm_?arch|cap|cc|capability|cuda_device_capability"
             r"|compute_capability|device_sm|arch)")
_CAP_CALL_RE = re.compile(r"\b(?:getSMVersion|get_sm_version|GetCudaComputeCapability|getSmVersion)\s*\(\s*\)")
_RUNTIME_RE = re.compile(
    r"^\s*(?:\}\s*else\s+)?(?:if|while)\s*\((.*)\)\s*\{?\s*$|^\s*return\s+(.*);\s*$|^\s*\w*CHECK\w*\s*\((.*)\)\s*;?\s*$"
)
_CC = ArchNum.of(lambda a: a.cc_int)
_CAP_CMP_RE = re.compile(rf"\b{_CAP_NAME}\b\s*(?:==|!=|>=|<=|>|<)\s*\d+|\d+\s*(?:==|!=|>=|<=|>|<)\s*\b{_CAP_NAME}\b")


def _runtime_value(expr: str) -> ArchBool | None:
    """A C++ condition over an integer capability: `sm` is major*10+minor (90, 100, 120)."""
    expr = _CAP_CALL_RE.sub(" sm ", expr)
    expr = re.sub(rf"[\w.>-]*?(?:\.|->)({_CAP_NAME})\b", r"\1", expr)  # `gemm_config.sm_version`, `cfg->sm`
    names = set(re.findall(rf"\b{_CAP_NAME}\b", expr))
    # 70..199: an SM integer (major*10+minor); other numbers compared with such a name are not one.
    return evaluate(expr, lambda n: _CC if n in names else None, lambda n: 70 <= n < 200)


_COMMENT_RE = re.compile(r"//.*$|/\*.*?\*/")
_STATEMENT_START_RE = re.compile(r"^\s*(?:\}\s*else\s+)?(?:if|while)\s*\(|^\s*return\b|^\s*\w*CHECK\w*\s*\(")
_MAX_JOINED = 6  # lines of one runtime condition read together (a long `if (...` split over lines)


def _statement(lines: list, i: int) -> str:
    """Line `i` without comments, joined with the lines that close its parentheses (or end its return)."""
    text = _COMMENT_RE.sub("", lines[i])
    j = i
    while j + 1 < len(lines) and j - i < _MAX_JOINED and (
            text.count("(") > text.count(")")
            or text.lstrip().startswith("return") and not text.rstrip().endswith(";")):
        j += 1
        text += " " + _COMMENT_RE.sub("", lines[j]).strip()
    return text


def _runtime_findings(rel: str, lines: list) -> list:
    out = []
    for i, line in enumerate(lines):
        if not _STATEMENT_START_RE.match(line):
            continue
        text = _statement(lines, i)
        if not (_CAP_CMP_RE.search(text) or _CAP_CALL_RE.search(text)):
            continue
        m = _RUNTIME_RE.match(text)
        if not m:
            continue
        expr = next(g for g in m.groups() if g is not None)
        value = _runtime_value(expr)
        if value is None or not value.depends_on_arch:
            continue
        out.append(_finding(rel, i + 1, "runtime-cpp", " ".join(expr.split()), value, "cuda",
                            "code run under this condition"))
    number_repeats(out)
    return out


def scan_native(rel: str, text: str) -> list:
    """Report-only findings of one C/C++/CUDA or CMake file."""
    lines = text.split("\n")
    out = []
    is_cmake = rel.endswith(("CMakeLists.txt", ".cmake"))
    i = 0
    while i < len(lines):
        start = i
        line = lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i]
        i += 1
        if is_cmake:
            if not _CMAKE_CONTEXT_RE.search(line):
                continue
            for m in _CMAKE_LIST_RE.finditer(line):
                value = _cmake_set(m.group(1))
                if value.depends_on_arch:
                    out.append(_finding(rel, start + 1, "cmake-arch-list", " ".join(line.split())[:160], value, "cmake",
                                        "what is compiled"))
            continue
        m = _PP_RE.match(line)
        if not m or "__CUDA_ARCH" not in m.group(2):
            continue
        value = evaluate(m.group(2), _preprocessor_name)
        if value is None or not value.depends_on_arch:
            continue
        cond = " ".join(_COMMENT_RE.sub("", m.group(2)).split())
        out.append(_finding(rel, start + 1, "preprocessor", cond, value, "cuda", "code compiled under this #if"))
    number_repeats(out)
    if not is_cmake:
        out.extend(_runtime_findings(rel, lines))
    return out
