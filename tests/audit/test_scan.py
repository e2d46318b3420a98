"""scan.py: statement walking, branch joins, class attributes, capability-keyed tables; every gate
idiom of the fixture engine, evaluated per architecture.

Expected sets are written from each idiom's documented meaning (gate-idioms.md: major numbers,
exact capabilities, `>=`), independently of the evaluator; `?` marks archs where a non-GPU clause
leaves it unknown.
"""

from __future__ import annotations

import textwrap

import pytest

from tpfuse.audit.driver import audit

from .conftest import find, names


def conditions(tmp_path, source: str, name: str = "m.py") -> dict:
    """{condition text: (scope, archs where true, archs where unknown)} of a one-file audit."""
    (tmp_path / name).write_text(textwrap.dedent(source))
    found = {}
    for f in audit(str(tmp_path / name)).findings:
        found[f.condition] = (f.scope, [a for a, v in f.values.items() if v],
                              [a for a, v in f.values.items() if v is None])
    return found


def test_a_flag_set_in_an_architecture_branch_holds_that_architecture(tmp_path):
    found = conditions(tmp_path, """
        import torch


        def pick():
            use_fast = False
            if torch.cuda.get_device_capability()[0] >= 10:
                use_fast = True
            if use_fast:
                return 1
            return 0
    """)
    assert found["use_fast"] == ("pick", names(lambda a: a.major >= 10), [])


def test_an_attribute_turned_off_on_one_architecture_excludes_it_in_other_methods(tmp_path):
    found = conditions(tmp_path, """
        import torch


        class Kernel:
            def __init__(self, n):
                self.fast = n > 1
                if torch.cuda.get_device_capability()[0] == 9:
                    self.fast = False

            def run(self):
                if self.fast:
                    return 1
                return 0
    """)
    scope, true, unknown = found["self.fast"]
    assert (scope == "Kernel.run" and true == [] and "sm90" not in unknown
            and set(unknown) == set(names(lambda a: a.major != 9)))


def test_a_class_field_default_is_not_the_value_its_methods_read(tmp_path):
    # sglang 0.5.10 ServerArgs: `tp_size: int = 1` is what a caller overrides; read as 1, the
    # auto-enable `... and is_sm90_supported() and self.tp_size > 1` was false everywhere and lost.
    found = conditions(tmp_path, """
        from dataclasses import dataclass

        import torch


        @dataclass
        class Args:
            tp_size: int = 1
            fused: bool = False

            def adjust(self):
                if not self.fused and torch.cuda.get_device_capability()[0] == 9 and self.tp_size > 1:
                    self.fused = True
    """)
    scope, true, unknown = found["not self.fused and torch.cuda.get_device_capability()[0] == 9 and self.tp_size > 1"]
    assert scope == "Args.adjust" and true == [] and unknown == names(lambda a: a.major == 9)


def test_a_value_computed_on_first_use_is_the_architecture_value(tmp_path):
    found = conditions(tmp_path, """
        import torch


        class Layer:
            def __init__(self):
                self._use_fused: bool | None = None

            def forward(self, x):
                if self._use_fused is None:
                    self._use_fused = x.is_contiguous() and torch.cuda.get_device_capability()[0] >= 10
                if self._use_fused:
                    return 1
                return 0
    """)
    scope, true, unknown = found["self._use_fused"]
    assert scope == "Layer.forward" and set(unknown) == set(names(lambda a: a.major >= 10))


def test_a_branch_on_another_vendor_picks_the_nvidia_value(tmp_path):
    found = conditions(tmp_path, """
        import torch
        from eng.utils import is_xpu

        _is_xpu = is_xpu()


        def sm_major():
            if _is_xpu:
                capability = (0, 0)
            else:
                capability = torch.cuda.get_device_capability()
            major = capability[0]
            if major >= 10:
                return "tcgen05"
            return "wgmma"
    """)
    assert found["major >= 10"] == ("sm_major", names(lambda a: a.major >= 10), [])


def test_a_default_argument_filled_from_the_device_is_the_device_value(tmp_path):
    found = conditions(tmp_path, """
        import torch


        def launch(x, enable_pdl=None):
            if enable_pdl is None:
                enable_pdl = torch.cuda.get_device_capability()[0] >= 9
            if enable_pdl:
                return 1
            return 0
    """)
    assert found["enable_pdl"] == ("launch", names(lambda a: a.major >= 9), [])


def test_a_handler_does_not_hide_the_device_value(tmp_path):
    found = conditions(tmp_path, """
        import torch


        def major():
            try:
                cap = torch.cuda.get_device_capability()
            except RuntimeError:
                cap = None
            if cap is not None and cap[0] == 12:
                return "sm12x"
            return "other"
    """)
    assert found["cap is not None and cap[0] == 12"][1] == names(lambda a: a.major == 12)


def test_a_constant_in_one_branch_of_an_unknown_test_is_not_the_value(tmp_path):
    # `if env: x = False` leaves x unknown: never the constant False, which would hide the gate.
    found = conditions(tmp_path, """
        import os
        import torch


        def run():
            fast = torch.cuda.get_device_capability()[0] >= 10
            ok = os.environ.get("X") == "1"
            if os.environ.get("OFF"):
                ok = False
            if fast and ok:
                return 1
            return 0
    """)
    scope, true, unknown = found["fast and ok"]
    assert true == [] and set(unknown) == set(names(lambda a: a.major >= 10))


CASES = [
    # (path, condition fragment, kind, category, expected enables)
    ("layers/fusion.py", "(_is_sm90_supported or _is_sm100_supported)", "return", "gate",
     names(lambda a: a.major in (9, 10), True)),
    ("layers/fusion.py", "server_args.tp_size > 1 and", "if", "gate", names(lambda a: a.major in (9, 10), True)),
    ("layers/fusion.py", "not (get_platform().is_sm90", "guard", "gate", names(lambda a: a.major in (9, 10))),
    ("layers/fusion.py", 'moe_runner_backend == "auto"', "if", "gate", names(lambda a: a.major == 10, True)),
    ("layers/fusion.py", "_is_cuda and is_sm100_supported()", "assign", "flag-definition",
     names(lambda a: a.major == 10)),
    ("layers/caps.py", "major == 10", "if", "gate", names(lambda a: a.major == 10)),
    ("layers/caps.py", "major >= 9 and major < 10", "elif", "gate", names(lambda a: a.major == 9)),
    ("layers/caps.py", "sm_version in (100, 103)", "return", "gate", ["sm100", "sm103"]),
    ("layers/caps.py", "is_device_capability(100)", "assign", "gate", ["sm100"]),
    ("layers/caps.py", "is_device_capability_family(100)", "assign", "gate", names(lambda a: a.major == 10)),
    ("layers/caps.py", "(8, 0) <= capability < (10, 0)", "assign", "gate",
     names(lambda a: (8, 0) <= (a.major, a.minor) < (10, 0))),
    ("layers/caps.py", "100 <= sm < 120", "assign", "gate", names(lambda a: 100 <= a.cc_int < 120)),
    # `if not hopper and not blackwell: return "fallback"` bails out to the fallback: the fast path is on 9.x and 10.x.
    ("layers/caps.py", "not torch.cuda.get_device_capability()[0] == 9", "guard", "gate",
     names(lambda a: a.major in (9, 10))),
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


# Idioms whose capability reaches the condition through a name, an attribute, a parameter, a table or a
# string (fixtures/fakeengine/v2/idioms.py).
DERIVED_IDIOMS = [
    ("sm == 90 or 100 <= sm < 110", "if", names(lambda a: a.cc_int == 90 or 100 <= a.cc_int < 110)),
    ("sm in (90, 100, 103, 120)", "assign", ["sm90", "sm100", "sm103", "sm120"]),  # `sm = sm or get_device_sm()`
    ("self.sm_version >= 100", "if", ["sm100", "sm103"]),  # attribute set in __init__, below the method
    ("capability.major in (9, "
     "10)", "return", names(lambda a: a.major in (9, 10))),  # supports_compute_capability(cls, capability)
    ("capability >= (10, 0) and capability < (11, 0)", "return", names(lambda a: a.major == 10)),
    ("cap in SUPPORTED_CAPS", "if", ["sm90", "sm100", "sm103"]),
    ("ONE_SHOT_MAX_MB.get(", "table", ["sm90", "sm100", "sm103"]),  # the gate is a missing key
    ("in _SUPPORTED_PAIRS", "return", ["sm90", "sm100"]),
    ('not _match_sm_version(device, ["100", "103"])', "guard", ["sm100", "sm103"]),
    ("not "
     "(current_platform.is_device_capability_family(100)", "guard", names(lambda a: a.major == 10 or a.cc_int == 90)),
    ("not get_platform().is_sm100", "guard", names(lambda a: a.major == 10)),
    ("(major, minor) != (9, 0)", "guard", ["sm90"]),
    ("get_platform().is_sm100 or get_platform().is_sm120", "return", names(lambda a: a.major in (10, 12))),
    ("sm in (100, 103, 120, 121)", "return", ["sm100", "sm103", "sm120", "sm121"]),
    # parameters named as the device's capability (FlashInfer's _compile_hca_kernel, green_ctx)
    ("compute_capability not in ((10, 0), (10, 3))", "guard", ["sm100", "sm103"]),
    ('get_device_arch() == "90a"', "if", ["sm90"]),  # f"{major * 10 + minor}{suffix}" with a ternary suffix
]


def test_a_table_lookup_with_a_fallback_value_is_not_a_missing_key_gate(tmp_path):
    # sglang 0.5.23 convrot_int8_jit.py words a message with `REASONS.get(capability, "...")`, a 0.5.10
    # benchmark picks a peak bandwidth with `{...}.get(cap, 320)`: an architecture the table does not
    # list gets a value of the same kind, nothing is turned off. A falsy default is the gate.
    found = conditions(tmp_path, """
        import torch

        REASONS = {(10, 3): "INT8 tensor-core throughput is a fraction of BF16 there"}
        MAX_OVERLAP_TOKENS = {9: 32, 10: 16}


        def refusal_reason():
            cap = torch.cuda.get_device_capability()
            return REASONS.get(cap, "the ops carry no code for it")


        def peak_bandwidth():
            cap = torch.cuda.get_device_capability()
            return {(9, 0): 3350, (8, 0): 2000}.get(cap, 320)


        def max_overlap_tokens():
            major = torch.cuda.get_device_capability()[0]
            return MAX_OVERLAP_TOKENS.get(major, 0)
    """)
    overlap = ("max_overlap_tokens", names(lambda a: a.major in (9, 10)), [])
    assert found == {"MAX_OVERLAP_TOKENS.get(major, 0)": overlap}


@pytest.mark.parametrize("part,kind,expected", DERIVED_IDIOMS, ids=[c[0][:30] for c in DERIVED_IDIOMS])
def test_derived_idiom(result, part, kind, expected):
    f = find(result, "v2/idioms.py", part)
    assert (f.kind, f.category, f.enables) == (kind, "gate", expected)
