"""resolve.py: modules parsed on demand, names resolved, what a scanned module keeps for others."""

from __future__ import annotations

import ast
import textwrap

from tpfuse.audit.driver import audit


def test_a_scanned_module_keeps_only_what_other_modules_read(tmp_path):
    # A whole-engine report keeps every module's hot defs for the modules that import them; the
    # rest of its trees goes (the peak memory of a whole sglang audit, benchmarks/results/README.md).
    pkg = tmp_path / "eng"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "utils.py").write_text(textwrap.dedent("""
        import torch


        def is_sm100():
            return torch.cuda.get_device_capability()[0] == 10


        def log_capability():
            print(torch.cuda.get_device_capability())


        class Config:
            @classmethod
            def supported(cls):
                return is_sm100()

            def describe(self):
                if is_sm100():
                    print("sm100")
    """))
    (pkg / "user.py").write_text("from .utils import Config, is_sm100\n\n\ndef f():\n    return Config.supported() and is_sm100()\n")
    result = audit(str(pkg), keep_trees=False)
    info = result.resolver.module("eng.utils")
    assert info.tree is None and info.bindings["log_capability"] == ("skipped",)
    assert info.bindings["is_sm100"][0] == "def"
    methods = [s.name for s in info.bindings["Config"][1].body if isinstance(s, ast.FunctionDef)]
    assert methods == ["supported"]
    assert [f.scope for f in result.findings if f.path == "user.py"] == ["f"]  # read through what was kept
