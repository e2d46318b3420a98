"""native.py: C++/CUDA preprocessor and runtime capability tests and CMake arch lists, report-only."""

from __future__ import annotations

from .conftest import find, names


def test_native_findings_are_report_only(result):
    cu = find(result, "csrc/kernel.cu", "__CUDA_ARCH__ >= 900")
    assert cu.report_only and cu.language == "cuda" and cu.enables == ["sm90"]
    cmake = find(result, "CMakeLists.txt", "10.0f;11.0f")
    assert cmake.report_only and cmake.enables == names(lambda a: a.major in (10, 11))


def test_cpp_runtime_capability_comparisons(result):
    f = find(result, "csrc/runtime_caps.cpp", "sm >= 100 && sm < 120")
    assert f.report_only and f.kind == "runtime-cpp" and f.enables == names(lambda a: 100 <= a.cc_int < 120)
    assert find(result, "csrc/runtime_caps.cpp", "cap == 90").enables == ["sm90"]
