"""The labelled corpus (tests/audit/corpus/*.txt): conditions quoted from real engine trees, scored.

A case is a condition quoted from a released engine tree (sglang 0.5.23 and 0.5.10, vLLM 0.33.0,
FlashInfer fb28d72) with the few lines it reads: its function's signature and the statements that
bind the names it tests, the module-level flags and imports it uses, and, where the value comes
from another module, that module's binding (a `=== path` section). The condition's line carries a
`#<` (or `//<`) marker. Its header says where it comes from (package, version, file:line), which
idiom family it belongs to (FAMILIES), where the feature it guards is on (a Python expression over
`a`, an `Arch`, written from the engine's documented meaning of the predicates it calls, never from
the audit's output) and its category: gate, inverse, quirk or none (not an architecture gate).

`score()` writes every case as a tree of its own (each directory a package), audits the tree and
the case's file alone, and compares the verdict of the marked line with the label: recall and
precision of gates that exclude `arch`, the share of cases whose category and architecture set
match exactly, and whether the file and the tree gave identical verdicts. `score_trees()` scores the
same labels on the real trees when they are on disk (`trees()` says where).
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from tpfuse.audit.arch import ARCHS, parse_arch
from tpfuse.audit.driver import audit
from tpfuse.audit.verdict import verdict

CORPUS = Path(__file__).parent / "corpus"
FAMILIES = {
    "F1": "an integer capability in a name a helper computed, compared in ranges, by membership or negated",
    "F2": "platform objects, and module-level constants built from them that other modules test",
    "F3": "tables keyed by capability (a missing key turns the feature off)",
    "F4": "tuple comparisons that refuse (followed by a raise or return)",
    "F5": "inverse gates (a check that turns a feature off where it names an architecture)",
    "F6": "quirks (a per-architecture tuning or workaround that enables nothing elsewhere)",
    "F0": "the other idioms (named helpers, torch capability tuples, decorators, #if, CMake lists)",
}
CATEGORIES = ("gate", "inverse", "quirk", "none")
# Where the released trees are unpacked under `trees()`' base, and where a case's Python path starts in
# them: the wheels' packages (`pip download --no-deps`), FlashInfer's git snapshot (flashinfer/, csrc/, include/).
TREE_DIRS = {"sglang 0.5.23": ("sglang-0.5.23/sglang", ""), "sglang 0.5.10": ("sglang-0.5.10/sglang", ""),
             "vllm 0.33.0": ("vllm-0.33.0/vllm", ""), "flashinfer fb28d72": ("flashinfer", "flashinfer/")}
_MARK_RE = re.compile(r"\s*(?:#<|//<)\s*$|/\*<\*/")
_HEADER_RE = re.compile(r"^--- (?P<origin>\S+ \S+) (?P<path>\S+):(?P<line>\d+)(?: \((?P<note>[^)]*)\))?"
                        r" \| (?P<family>F\d) \| (?P<label>.+?) \| (?P<category>\w+)\s*$")


@dataclass
class Case:
    origin: str  # "sglang 0.5.23"
    path: str  # the file in that tree, under its top package ("srt/layers/...")
    origin_line: int
    family: str
    label: str
    category: str
    note: str = ""
    files: dict = field(default_factory=dict)  # path under the case's root ("sglang/srt/...") -> text
    main: str = ""
    line: int = 0  # the marked line in `main`

    @property
    def engine(self) -> str:
        return self.origin.split()[0]

    @property
    def where(self) -> str:
        return f"{self.origin} {self.path}:{self.origin_line}"

    @property
    def language(self) -> str:
        return "python" if self.main.endswith(".py") else "native"

    def expected(self) -> list:
        return [a.name for a in ARCHS if eval(self.label, {}, {"a": a})]  # noqa: S307 - labels are test data


def load(name: str) -> list:
    """The cases of one corpus file; ValueError naming the case for a malformed one."""
    cases, case, current = [], None, None
    for number, line in enumerate((CORPUS / name).read_text().split("\n"), 1):
        if line.startswith("# ") or line == "#":
            continue
        if line.startswith("--- "):
            m = _HEADER_RE.match(line)
            if not m:
                raise ValueError(f"{name}:{number}: malformed case header {line!r}")
            case = Case(m["origin"], m["path"], int(m["line"]), m["family"], m["label"], m["category"], m["note"] or "")
            cases.append(case)
            current = None
            continue
        if case is None:
            continue
        if line.startswith("=== "):
            current = line[4:].strip()
            case.files[current] = []
            case.main = case.main or current
            continue
        if current is None:
            raise ValueError(f"{name}:{number}: code before the case's first `=== path` line")
        if _MARK_RE.search(line) and current == case.main:
            case.line = len(case.files[current]) + 1
        case.files[current].append(line)
    for c in cases:
        c.files = {p: "\n".join(lines).rstrip("\n") + "\n" for p, lines in c.files.items()}
        if not c.line or c.category not in CATEGORIES or c.family not in FAMILIES:
            raise ValueError(f"{name}: case {c.where} has no marked line, or an unknown category or family")
    return cases


def build(case: Case, root: Path) -> Path:
    """The case's files under `root`, every directory below the top package a package; the top package."""
    for rel, text in case.files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    top = root / case.main.split("/")[0]
    for dirpath, _, files in os.walk(top):
        if "__init__.py" not in files:
            (Path(dirpath) / "__init__.py").write_text("")
    return top


def marked_span(text: str, line: int) -> tuple:
    """(first, last) line of the condition a marked line starts: the statement beginning there, up to its
    body for a compound statement (an if's test, not its body); the line alone in C/C++ or CMake."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return line, line
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and node.lineno == line:
            end = node.test.end_lineno if isinstance(node, (ast.If, ast.While)) else node.end_lineno
            if best is None or end > best:
                best = end
    return line, best or line


def _in_span(findings: list, span: tuple) -> list:
    return [f for f in findings if f.line <= span[1] and f.end_line >= span[0]]


def _prediction(findings: list, arch) -> tuple:
    """(category, enabled architectures) the audit gives a marked line: its gate, else inverse, quirk, none."""
    order = ("gate", "inverse", "quirk")
    hits = sorted((f for f in findings if verdict(f, arch).category in order), key=lambda f: order.index(f.category))
    if not hits:
        return "none", None, None
    f = hits[0]
    return f.category, [e.rstrip("?") for e in f.enables], f


def _tally(rows: list) -> dict:
    out = {}
    for lang in ("python", "native"):
        sel = [r for r in rows if r["language"] == lang]
        tp = sum(r["positive"] and r["predicted"] for r in sel)
        fp = sum(r["predicted"] and not r["positive"] for r in sel)
        fn = sum(r["positive"] and not r["predicted"] for r in sel)
        out[lang] = {
            "cases": len(sel), "positives": tp + fn, "tp": tp, "fp": fp, "fn": fn,
            "recall": tp / (tp + fn) if tp + fn else 1.0, "precision": tp / (tp + fp) if tp + fp else 1.0,
            "exact": sum(r["exact"] for r in sel) / len(sel) if sel else 1.0,
            "identical": all(r.get("identical", True) for r in sel),
            "misses": [r for r in sel if not r["exact"] or r["positive"] != r["predicted"]
                       or not r.get("identical", True)],
        }
    return out


def _row(case: Case, findings: list, arch) -> dict:
    category, got, finding = _prediction(findings, arch)
    expected = case.expected()
    positive = case.category == "gate" and arch.name not in expected
    predicted = category == "gate" and verdict(finding, arch).reported
    exact = category == case.category and (category == "none" or got == expected)
    return {"where": case.where, "family": case.family, "language": case.language, "label": case.label,
            "category": case.category, "got_category": category, "got": got, "positive": positive,
            "predicted": predicted, "exact": exact}


def score(root: Path, arch_name: str = "sm120", cases: list | None = None) -> dict:
    """Each case audited as its own tree and as its file alone (the corpus is self-contained)."""
    arch = parse_arch(arch_name)
    cases = cases if cases is not None else load("python_cases.txt") + load("native_cases.txt")
    rows = []
    for i, case in enumerate(cases):
        top = build(case, root / f"case{i}")
        rel = case.main.split("/", 1)[1]
        tree = audit(str(top))
        in_file = [f for f in tree.findings if f.path == rel]
        span = marked_span(case.files[case.main], case.line) if case.language == "python" else (case.line, case.line)
        row = _row(case, _in_span(in_file, span), arch)
        if case.language == "python":
            alone = audit(str(root / f"case{i}" / case.main), native=False).findings
            row["identical"] = [(f.id, f.line, f.kind, f.category, f.enables) for f in alone] == [
                (f.id, f.line, f.kind, f.category, f.enables) for f in in_file]
        rows.append(row)
    return _tally(rows) | {"rows": rows}


def trees() -> dict:
    """{origin: directory} of the released trees on disk (`$TPFUSE_AUDIT_TREES`, default
    ~/.cache/tpfuse-audit-trees)."""
    base = Path(os.environ.get("TPFUSE_AUDIT_TREES") or Path.home() / ".cache" / "tpfuse-audit-trees")
    return {origin: base / sub for origin, (sub, _) in TREE_DIRS.items() if (base / sub).is_dir()}


def score_trees(arch_name: str = "sm120", cases: list | None = None) -> dict:
    """The same labels scored on the real trees, each audited whole once (only the trees on disk)."""
    arch = parse_arch(arch_name)
    cases = cases if cases is not None else load("python_cases.txt") + load("native_cases.txt")
    roots = trees()
    rows = []
    for origin, top in roots.items():
        mine = [c for c in cases if c.origin == origin]
        if not mine:
            continue
        result = audit(str(top))
        by_path: dict = {}
        for f in result.findings:
            by_path.setdefault(f.path, []).append(f)
        prefix = TREE_DIRS[origin][1]
        for case in mine:
            span, path = (case.origin_line, case.origin_line), case.path
            if case.language == "python":
                path = prefix + case.path
                span = marked_span((top / path).read_text(encoding="utf-8"), case.origin_line)
            rows.append(_row(case, _in_span(by_path.get(path, []), span), arch))
    return _tally(rows) | {"rows": rows, "trees": sorted(roots)}
