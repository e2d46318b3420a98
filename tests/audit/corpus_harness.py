"""The labelled corpus (tests/audit/corpus/*.txt) as a throwaway engine, audited and scored.

Each case is a conditional from a public engine tree (sglang, vLLM, FlashInfer, TensorRT-LLM),
written as a function body, labelled by hand with where its feature is on (a predicate over the
architecture, from the idiom's documented meaning) and a category (gate / inverse / none).
`score()` writes the cases into a temporary package (Python cases as functions of one module per
engine; C++/CUDA and CMake cases as files), audits it once and compares: recall and precision of
gates that exclude `arch`, and the share of cases whose category and architecture set match exactly.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from tpfuse.audit.arch import ARCHS, parse_arch
from tpfuse.audit.driver import audit

CORPUS = Path(__file__).parent / "corpus"

# What the cases reference and the engines define elsewhere: sglang's get_platform() (facts from
# the seeds), FlashInfer's _match_sm_version, vLLM's module tables, cached flags.
_PREAMBLE = '''\
import os

import pytest
import torch


class PlatformContext:
    pass


def get_platform():
    return PlatformContext()


def _match_sm_version(device, sm_versions):
    major, minor = get_compute_capability(device)
    return f"{major}{minor}" in sm_versions


def get_device_arch():
    major, minor = torch.cuda.get_device_capability()
    suffix = "a" if major >= 9 else ""
    return f"{major * 10 + minor}{suffix}"


_SUPPORTED_CAPABILITIES = (90, 100)
QWEN4_EXP_GEMM_PLANS_BY_CAPABILITY = {90: {"m": 1}, 100: {"m": 2}}
_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB = {90: 4, 100: 8, 103: 8}
_is_hip = is_hip()
_is_xpu = is_xpu()
_is_sm90_supported = is_sm90_supported()
_is_sm100_supported = is_sm100_supported()
_is_sm100_flag = is_sm100_supported()
_is_sm120_flag = get_platform().is_sm120
'''


@dataclass
class Case:
    origin: str
    label: str
    category: str
    code: str
    start: int = 0
    end: int = 0

    def expected(self) -> list:
        return [a.name for a in ARCHS if eval(self.label, {}, {"a": a})]  # noqa: S307 - labels are test data


def load(name: str) -> list:
    cases = []
    text = "\n".join(line for line in (CORPUS / name).read_text().splitlines() if not line.startswith("# "))
    for block in text.split("\n---\n"):
        block = block.strip("\n")
        if not block:
            continue
        header, _, code = block.partition("\n")
        origin, label, category = (p.strip() for p in header.split("|"))
        cases.append(Case(origin, label, category, code))
    return cases


def _python_module(cases: list) -> str:
    lines = _PREAMBLE.splitlines()
    for i, case in enumerate(cases):
        lines += ["", ""]
        param = next((p for p in ("device_capability", "capability") if re.search(rf"\b{p}\b", case.code) and f"{p} =" not in case.code), None)
        if param:  # a backend's supports_compute_capability(cls, capability)
            lines += [f"class Backend{i}:", "    @classmethod", f"    def supports_compute_capability(cls, {param}):"]
            indent = "        "
        elif case.code.startswith("@params "):  # a function whose parameters carry the capability
            params, _, case.code = case.code.partition("\n")
            lines.append(f"def case_{i}({params.removeprefix('@params ')}):")
            indent = "    "
        else:
            lines.append(f"def case_{i}(device, self=None):")
            indent = "    "
        case.start = len(lines) + 1
        lines += textwrap.indent(case.code, indent).splitlines()
        case.end = len(lines)
    return "\n".join(lines) + "\n"


def build(root: Path) -> tuple[list, list]:
    pkg = root / "corpus_engine"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    py = load("python_cases.txt")
    (pkg / "cases.py").write_text(_python_module(py))
    native = load("native_cases.txt")
    for i, case in enumerate(native):
        name = f"csrc/case_{i}.cu" if " cu " in f" {case.origin} " else f"cmake/case_{i}/CMakeLists.txt"
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(case.code + "\n")
        case.start, case.end, case.path = 1, case.code.count("\n") + 1, name
    return py, native


def _predict(findings: list):
    """(category, enables) the audit gives a case: its gate (the last, e.g. the `if` reading a flag), else inverse."""
    for category in ("gate", "inverse"):
        hits = [f for f in findings if f.category == category]
        if hits:
            return category, hits[-1]
    return "none", None


def score(root: Path, arch_name: str = "sm120") -> dict:
    arch = parse_arch(arch_name)
    py, native = build(root)
    result = audit(str(root / "corpus_engine"))
    out = {}
    for lang, cases in (("python", py), ("native", native)):
        tp = fp = fn = exact = 0
        misses = []
        for case in cases:
            path = getattr(case, "path", "cases.py")
            found = [f for f in result.findings if f.path == path and case.start <= f.line <= case.end]
            category, finding = _predict(found)
            expected = case.expected()
            positive = case.category == "gate" and arch.name not in expected
            predicted = category == "gate" and finding.values[arch.name] is False
            tp += positive and predicted
            fp += predicted and not positive
            fn += positive and not predicted
            got = [e.rstrip("?") for e in finding.enables] if finding else None
            ok = category == case.category and (category == "none" or got == expected)
            exact += ok
            if not ok or positive != predicted:
                misses.append({"origin": case.origin, "label": case.label, "category": case.category,
                               "got_category": category, "got": got})
        out[lang] = {
            "cases": len(cases), "positives": tp + fn, "tp": tp, "fp": fp, "fn": fn,
            "recall": tp / (tp + fn) if tp + fn else 1.0, "precision": tp / (tp + fp) if tp + fp else 1.0,
            "exact": exact / len(cases), "misses": misses,
        }
    return out
