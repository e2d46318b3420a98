"""scan.py: statement walking, branch joins, class attributes, capability-keyed tables."""

from __future__ import annotations

import textwrap

from tpfuse.audit.arch import ARCHS
from tpfuse.audit.driver import audit


def names(pred) -> list:
    return [a.name for a in ARCHS if pred(a)]


def conditions(tmp_path, source: str, name: str = "m.py") -> dict:
    """{condition text: (scope, archs where true, archs where unknown)} of a one-file audit."""
    (tmp_path / name).write_text(textwrap.dedent(source))
    found = {}
    for f in audit(str(tmp_path / name)).findings:
        found[f.condition] = (f.scope, [a for a, v in f.values.items() if v], [a for a, v in f.values.items() if v is None])
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
    assert scope == "Kernel.run" and true == [] and "sm90" not in unknown and set(unknown) == set(names(lambda a: a.major != 9))


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
