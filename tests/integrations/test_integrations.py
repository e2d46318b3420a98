"""`tpfuse.integrations`: every plugin is inert unless TPFUSE_ENGINES names its engine; then it
registers, installs and imports nothing of an engine."""

from __future__ import annotations

import sys


def test_plugins_are_inert_when_off(monkeypatch):
    monkeypatch.delenv("TPFUSE_ENGINES", raising=False)
    from tpfuse.integrations import sglang, sglang_legacy, vllm

    before = set(sys.modules)
    sglang.plugin()
    vllm.plugin()
    assert not sglang_legacy.install()
    assert not sglang._registered and not vllm._installed
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("sglang", "vllm")}
