"""resolve.py: modules parsed on demand, names resolved, what a scanned module keeps for others."""

from __future__ import annotations

import ast
import textwrap

from tpfuse.audit.driver import audit


def test_a_scanned_module_keeps_what_other_modules_can_read_and_drops_the_rest(tmp_path):
    # A report keeps every module's defs for the modules that import them, but the body of a def
    # that is never inlined (no architecture text) goes: the peak memory of a whole-engine audit
    # (benchmarks/results/README.md), with the same verdicts whatever order modules are scanned in.
    pkg = tmp_path / "eng"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "utils.py").write_text(textwrap.dedent("""
        import torch

        _FAST = torch.cuda.get_device_capability()[0] >= 10


        def is_sm100():
            return torch.cuda.get_device_capability()[0] == 10


        def report():
            if _FAST:
                print("fast path")
            return 1
    """))
    (pkg / "user.py").write_text("from .utils import is_sm100, report\n\n\ndef f():\n    return report() and "
                                 "is_sm100()\n")
    result = audit(str(pkg), keep_trees=False)
    info = result.resolver.module("eng.utils")
    assert info.tree is None
    assert [type(s).__name__ for s in info.bindings["report"][1].body] == ["Pass"]  # bound, opaque
    assert isinstance(info.bindings["is_sm100"][1].body[0], ast.Return)  # inlined by user.py
    by_file = {f.path: f for f in result.findings}
    alone = audit(str(pkg / "user.py")).findings
    assert [f.values for f in alone] == [by_file["user.py"].values]
