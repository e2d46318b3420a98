"""sglang 0.5.10's import hook (`tpfuse.integrations.sglang_legacy`), on stand-in modules with
0.5.10's names and attributes: installed once however often it is asked, it replaces the gate and
the op as the modules import, and keeps the original op."""

from __future__ import annotations

import importlib
import sys


def test_legacy_import_hook_patches_the_modules_as_they_import(monkeypatch, tmp_path):
    # Stand-ins with the 0.5.10 module names and attributes; the hook must replace them on import.
    pkg = tmp_path / "sglang" / "srt" / "layers"
    pkg.mkdir(parents=True)
    for part in (tmp_path / "sglang", tmp_path / "sglang" / "srt", pkg):
        (part / "__init__.py").write_text("")
    (pkg / "communicator.py").write_text("def apply_flashinfer_allreduce_fusion(batch_size):\n    return False\n")
    (pkg / "flashinfer_comm_fusion.py").write_text("def flashinfer_allreduce_residual_rmsnorm(*a, **k):\n"
                                                   "    return None, None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TPFUSE_ENGINES", "sglang")
    for name in [m for m in sys.modules if m.split(".")[0] == "sglang"]:
        monkeypatch.delitem(sys.modules, name)
    from tpfuse.integrations import sglang_legacy

    finders = list(sys.meta_path)
    try:
        assert sglang_legacy.install() and sglang_legacy.install()
        assert sum(isinstance(f, sglang_legacy._Finder) for f in sys.meta_path) == 1
        comm = importlib.import_module("sglang.srt.layers.communicator")
        fused = importlib.import_module("sglang.srt.layers.flashinfer_comm_fusion")
        assert comm.apply_flashinfer_allreduce_fusion is sglang_legacy.gate
        assert fused.flashinfer_allreduce_residual_rmsnorm is sglang_legacy.op
        assert fused.flashinfer_allreduce_residual_rmsnorm.__wrapped__(1) == (None, None)  # the original, kept
    finally:
        sys.meta_path[:] = finders
        for name in [m for m in sys.modules if m.split(".")[0] == "sglang"]:
            del sys.modules[name]
