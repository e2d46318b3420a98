"""The engine plugins without an engine: the switch, inertness, idempotence, standing down, doctor rows,
the 0.5.10 import hook (on a stand-in module), and Communicator(cpu_group=...) on 2 gloo ranks."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from tpfuse import env
from tpfuse.reference import all_reduce_residual_rmsnorm_ref, small_integer_inputs
from tpfuse.spawn import run_ranks


@pytest.mark.parametrize("value, want", [("", set()), ("0", set()), ("all", {"sglang", "vllm"}), ("1", {"sglang", "vllm"}),
                                         ("vllm", {"vllm"}), (" SGLang , vllm ", {"sglang", "vllm"})])
def test_engines_switch(monkeypatch, value, want):
    monkeypatch.setenv("TPFUSE_ENGINES", value)
    assert env.engines_enabled() == want


def test_engines_switch_rejects_unknown_names(monkeypatch):
    monkeypatch.setenv("TPFUSE_ENGINES", "sglang,trtllm")
    with pytest.raises(ValueError, match=r"TPFUSE_ENGINES='sglang,trtllm': unknown engine\(s\) trtllm; use sglang, vllm or all"):
        env.engines_enabled()


def test_plugins_are_inert_when_off(monkeypatch):
    monkeypatch.delenv("TPFUSE_ENGINES", raising=False)
    from tpfuse.integrations import sglang, sglang_legacy, vllm

    before = set(sys.modules)
    sglang.plugin()
    vllm.plugin()
    assert not sglang_legacy.install()
    assert not sglang._registered and not vllm._installed
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("sglang", "vllm")}


class AllReduceFusionPass:  # named like vLLM's own pass: the plugin matches it by class name
    def __init__(self, disabled):
        self.disabled = disabled


class NoOpEliminationPass:
    pass


def test_vllm_pass_stands_down_where_vllm_fuses_itself():
    from tpfuse.integrations import vllm

    manager = types.SimpleNamespace(passes=[NoOpEliminationPass(), AllReduceFusionPass(disabled=False)])
    vllm.add_pass(manager, config=None)  # returns before importing anything of vLLM
    assert [type(p).__name__ for p in manager.passes] == ["NoOpEliminationPass", "AllReduceFusionPass"]
    assert vllm.own_fusion_active(manager.passes)
    assert not vllm.own_fusion_active([NoOpEliminationPass(), AllReduceFusionPass(disabled=True)])  # e.g. SM120


def test_doctor_rows(monkeypatch, tmp_path):
    from tpfuse.integrations import doctor

    monkeypatch.setenv("TPFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TPFUSE_CALIBRATE", raising=False)
    monkeypatch.setattr(doctor, "_version", lambda dist: {"sglang": "0.5.23"}.get(dist))
    monkeypatch.setattr(doctor, "_entry_point", lambda group: "tpfuse.integrations.sglang:plugin" if group == "sglang.srt.plugins" else None)
    monkeypatch.setenv("TPFUSE_ENGINES", "sglang")
    rows = {r["engine"]: r for r in doctor.engine_rows(environ={})}
    assert rows["sglang"]["enabled"] and rows["sglang"]["would"].startswith("it replaces the fused allreduce")
    assert rows["sglang"]["would"].endswith("; at start-up it calibrates the captured batch sizes the dispatch table "
                                            f"lacks, within 15 s, and saves them (0 dispatch table(s) in {tmp_path})")
    monkeypatch.setenv("TPFUSE_CALIBRATE", "0")
    (tmp_path / "dispatch-0123456789abcdef.json").write_text("{}")
    rows = {r["engine"]: r for r in doctor.engine_rows(environ={})}
    assert rows["sglang"]["would"].endswith("at start-up it does not calibrate (TPFUSE_CALIBRATE=0): the conservative "
                                            f"default serves sizes the table lacks (1 dispatch table(s) in {tmp_path})")
    monkeypatch.setenv("TPFUSE_CALIBRATE", "later")
    rows = {r["engine"]: r for r in doctor.engine_rows(environ={})}
    assert rows["sglang"]["would"].endswith("at start-up it stands down: TPFUSE_CALIBRATE='later': use 1 "
                                            "(on, 15 s), 0 (off) or a budget in seconds such as 30s")
    assert rows["vllm"]["installed"] is None and rows["vllm"]["would"] == "nothing: the engine is not installed here"
    rows = {r["engine"]: r for r in doctor.engine_rows(environ={"SGLANG_PLUGINS": "other"})}
    assert not rows["sglang"]["enabled"] and "SGLANG_PLUGINS='other' does not list tpfuse" in rows["sglang"]["would"]
    monkeypatch.setenv("TPFUSE_ENGINES", "")
    rows = {r["engine"]: r for r in doctor.engine_rows(environ={})}
    assert rows["sglang"]["would"].startswith("nothing (inert); set TPFUSE_ENGINES=sglang to enable")


def test_legacy_import_hook_patches_the_modules_as_they_import(monkeypatch, tmp_path):
    # Stand-ins with the 0.5.10 module names and attributes; the hook must replace them on import.
    pkg = tmp_path / "sglang" / "srt" / "layers"
    pkg.mkdir(parents=True)
    for part in (tmp_path / "sglang", tmp_path / "sglang" / "srt", pkg):
        (part / "__init__.py").write_text("")
    (pkg / "communicator.py").write_text("def apply_flashinfer_allreduce_fusion(batch_size):\n    return False\n")
    (pkg / "flashinfer_comm_fusion.py").write_text("def flashinfer_allreduce_residual_rmsnorm(*a, **k):\n    return None, None\n")
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


H = 64


def _cpu_group_rank(rank, world_size):
    import torch.distributed as dist

    from tpfuse import Communicator

    data_group, cpu_group = dist.new_group([0, 1]), dist.new_group([0, 1], backend="gloo")
    seen = []
    original = dist.all_gather_object
    dist.all_gather_object = lambda out, obj, group=None: seen.append(group) or original(out, obj, group=group)
    try:
        with Communicator(data_group, cpu_group=cpu_group) as comm:
            handshakes = list(seen)
            x, res = small_integer_inputs(rank, 3, H, torch.bfloat16), small_integer_inputs(100, 3, H, torch.bfloat16)
            got = comm.all_reduce_residual_rmsnorm(x, res, torch.ones(H, dtype=torch.bfloat16))
    finally:
        dist.all_gather_object = original
    return {"handshakes_on_cpu": bool(handshakes) and all(g is cpu_group for g in handshakes), "out": got}


@pytest.mark.gloo
def test_communicator_handshakes_on_cpu_group():
    results = run_ranks(_cpu_group_rank, 2, timeout_s=120)
    xs = [small_integer_inputs(r, 3, H, torch.bfloat16) for r in range(2)]
    want = all_reduce_residual_rmsnorm_ref(xs, small_integer_inputs(100, 3, H, torch.bfloat16), torch.ones(H, dtype=torch.bfloat16))
    for out in results:
        assert out["handshakes_on_cpu"]
        assert torch.equal(out["out"][0], want[0]) and torch.equal(out["out"][1], want[1])
