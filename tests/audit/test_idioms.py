"""Every gate idiom that the fixture engine uses, evaluated per architecture.

Expected sets are written from the idiom's documented meaning (major numbers, exact capabilities,
`>=`), independently of the evaluator; `?` marks archs where a non-GPU clause leaves it unknown.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tpfuse.audit.arch import ARCHS, parse_arch
from tpfuse.audit.driver import audit

FIXTURES = Path(__file__).parent / "fixtures"


def names(pred, unknown=False):
    return [a.name + ("?" if unknown else "") for a in ARCHS if pred(a)]


@pytest.fixture(scope="module")
def result():
    return audit(str(FIXTURES / "fakeengine"))


def find(result, path, condition_part, kind=None):
    hits = [f for f in result.findings if f.path == path and condition_part in f.condition and (kind is None or f.kind == kind)]
    assert len(hits) == 1, [(f.line, f.condition) for f in result.findings if f.path == path]
    return hits[0]


CASES = [
    # (path, condition fragment, kind, category, expected enables)
    ("layers/fusion.py", "(_is_sm90_supported or _is_sm100_supported)", "return", "gate", names(lambda a: a.major in (9, 10), True)),
    ("layers/fusion.py", "server_args.tp_size > 1 and", "if", "gate", names(lambda a: a.major in (9, 10), True)),
    ("layers/fusion.py", "not (get_platform().is_sm90", "guard", "gate", names(lambda a: a.major in (9, 10))),
    ("layers/fusion.py", 'moe_runner_backend == "auto"', "if", "gate", names(lambda a: a.major == 10, True)),
    ("layers/fusion.py", "_is_cuda and is_sm100_supported()", "assign", "flag-definition", names(lambda a: a.major == 10)),
    ("layers/caps.py", "major == 10", "if", "gate", names(lambda a: a.major == 10)),
    ("layers/caps.py", "major >= 9 and major < 10", "elif", "gate", names(lambda a: a.major == 9)),
    ("layers/caps.py", "sm_version in (100, 103)", "return", "gate", ["sm100", "sm103"]),
    ("layers/caps.py", "is_device_capability(100)", "assign", "gate", ["sm100"]),
    ("layers/caps.py", "is_device_capability_family(100)", "assign", "gate", names(lambda a: a.major == 10)),
    ("layers/caps.py", "(8, 0) <= capability < (10, 0)", "assign", "gate", names(lambda a: (8, 0) <= (a.major, a.minor) < (10, 0))),
    ("layers/caps.py", "100 <= sm < 120", "assign", "gate", names(lambda a: 100 <= a.cc_int < 120)),
    # `if not hopper and not blackwell: return "fallback"` bails out to the fallback: the fast path is on 9.x and 10.x.
    ("layers/caps.py", "not torch.cuda.get_device_capability()[0] == 9", "guard", "gate", names(lambda a: a.major in (9, 10))),
    ("layers/caps.py", "== (9, 0)", "ternary", "gate", ["sm90"]),
    ("layers/caps.py", "props.major == 10", "assign", "flag-definition", names(lambda a: a.major == 10)),
    ("layers/caps.py", "self.is_blackwell", "if", "gate", names(lambda a: a.major == 10)),
    ("aliases.py", "_use_fast_norm", "if", "gate", names(lambda a: a.major == 10)),
    ("aliases.py", "utils.is_sm100_supported()", "if", "gate", names(lambda a: a.major == 10)),
    ("aliases.py", "utils.is_blackwell()", "if", "gate", names(lambda a: a.major in (10, 11, 12))),
    ("aliases.py", "utils.is_sm120()", "if", "gate", ["sm120"]),
    ("layers/nongates.py", "is_sm100_supported()", "if", "log", names(lambda a: a.major == 10)),
    ("layers/nongates.py", "is_sm100_supported()", "ternary", "message", names(lambda a: a.major == 10)),
    ("layers/nongates.py", "[0] >= 10", "return", "helper-definition", names(lambda a: a.major >= 10)),
    ("layers/flashinfer_style.py", "supported_compute_capability([100, 103])", "decorator", "gate", ["sm100", "sm103"]),
    ("layers/flashinfer_style.py", "is_sm12x_family(device)", "if", "gate", names(lambda a: a.major == 12)),
    ("layers/flashinfer_style.py", "major == 12", "return", "helper-definition", names(lambda a: a.major == 12)),
    ("tests/kernels_check.py", "!= 10", "decorator", "test-skip", names(lambda a: a.major != 10)),
]


@pytest.mark.parametrize("path,part,kind,category,expected", CASES, ids=[f"{c[0]}:{c[1][:25]}" for c in CASES])
def test_idiom(result, path, part, kind, category, expected):
    finding = find(result, path, part, kind)
    assert finding.category == category
    assert finding.enables == expected


def test_rocm_branch_is_not_an_nvidia_gate(result):
    # `_is_hip and cap >= (9, 4)`: is_hip() is false on every NVIDIA arch, so the condition never
    # depends on the architecture (gate-idioms.md section 6).
    assert not [f for f in result.findings if "(9, 4)" in f.condition]


def test_always_true_conditions_are_not_gates(result):
    # `>= (9, 0)` and `has_device_capability(90)` include SM12x: nothing to report for sm120.
    sm120 = parse_arch("sm120")
    for part in (">= (9, 0)", "has_device_capability(90)", "get_device_sm() >= 90"):
        hits = [f for f in result.findings if part in f.condition]
        assert hits and all(f.values["sm120"] is True for f in hits)
        assert not [f for f in result.selected(sm120) if part in f.condition]


def test_native_findings_are_report_only(result):
    cu = find(result, "csrc/kernel.cu", "__CUDA_ARCH__ >= 900")
    assert cu.report_only and cu.language == "cuda" and cu.enables == ["sm90"]
    cmake = find(result, "CMakeLists.txt", "10.0f;11.0f")
    assert cmake.report_only and cmake.enables == names(lambda a: a.major in (10, 11))


def test_syntax_error_file_is_reported_and_skipped(result):
    assert [s["path"] for s in result.skipped] == ["broken.py"]
    assert "SyntaxError" in result.skipped[0]["error"]


def test_selection_with_like(result):
    sm120, sm100, sm90 = parse_arch("sm120"), parse_arch("sm100"), parse_arch("sm90")
    like_sm100 = result.selected(sm120, sm100)
    assert all(f.values["sm120"] is False and f.values["sm100"] is not False for f in like_sm100)
    assert any("major >= 9 and major < 10" in f.condition for f in result.selected(sm120, sm90))
    assert not any("major >= 9 and major < 10" in f.condition for f in like_sm100)
    assert all(f.category == "gate" for f in result.selected(sm120))


def test_ids_are_stable_and_unique(result):
    again = audit(str(FIXTURES / "fakeengine"))
    assert [f.id for f in again.findings] == [f.id for f in result.findings]
    assert len({f.id for f in result.findings}) == len(result.findings)
