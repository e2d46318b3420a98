"""sglang 0.5.10's import hook (`tpfuse.integrations.sglang_legacy`): on stand-in modules with
0.5.10's names and attributes (installed once however often it is asked, it replaces the gate and
the op as the modules import, and keeps the original op), then on sglang 0.5.10's real modules on 2
gloo ranks in a child interpreter (engine_env: pinned, --no-deps, cached outside the repository;
tests/integrations/sglang_legacy_ranks.py says the order it follows).

On CPU tpfuse's measured choices are `reference` or `ring`, whose outputs equal
`all_reduce_residual_rmsnorm_ref` bit for bit on small-integer inputs; sglang's own path (its
allreduce, then its native add + RMSNorm) is computed in the child on the same inputs.
"""

from __future__ import annotations

import importlib
import sys

import engine_env
import pytest
import torch

from tpfuse.reference import (
    TOLERANCE,
    all_reduce_residual_rmsnorm_ref,
    random_inputs,
    relative_error,
    small_integer_inputs,
)


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


H, TOKENS, WORLD = 256, 5, 2


def _run(tmp, scenario: str):
    return engine_env.run_child("sglang-legacy", "sglang_legacy_ranks.py", tmp, scenario, tmp / "cache")


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang-legacy")
    return {"start": _run(tmp, "start"), "compiled_first": _run(tmp, "compiled_first")}


def _want(tokens=TOKENS, dtype=torch.bfloat16, weight=None):
    xs = [small_integer_inputs(r, tokens, H, dtype) for r in range(WORLD)]
    return all_reduce_residual_rmsnorm_ref(xs, small_integer_inputs(100, tokens, H, dtype), weight.to(dtype))


@pytest.mark.gloo
@pytest.mark.slow
def test_real_modules_are_patched_as_they_import_and_prepared_before_sglangs_capture(starts):
    for out in starts["start"]:
        assert out["hook_first"] and out["patched"] == {"gate": True, "op": True, "capture": True}
        assert out["prepared_before_sglang_capture"] == [["tp:0"]]  # set up, then sglang's capture ran
        assert out["prepared"] == {"tp:0 256 bfloat16": 2048} and out["down"] == {"tp:0": ""}
        calibrated = [m for m in out["log"] if m.startswith("tpfuse: calibrated sglang group tp:0: 4 of 4 bucket(s)")]
        assert len(calibrated) == 1, out["log"]  # the runner's captured batch sizes 1, 2, 4, 8
        assert out["gate_before_capture"] is True  # the gate alone: the op prepares or falls back
        assert out["gate"] == {0: False, 1: True, TOKENS: True, 2048: True, 2049: False}
        assert out["gate_config_reads"] == 0  # sglang's own clauses were read once, before


@pytest.mark.gloo
@pytest.mark.slow
def test_layer_boundary_is_tpfuse_bit_for_bit_eager_and_fullgraph(starts):
    results = starts["start"]
    want = _want(weight=results[0]["weight"])
    xs = [random_inputs(r, TOKENS, H, torch.bfloat16).double() for r in range(WORLD)]
    want64 = all_reduce_residual_rmsnorm_ref(xs, random_inputs(100, TOKENS, H, torch.bfloat16).double(),
                                             results[0]["weight"].double(), acc_dtype=torch.float64)
    for out in results:
        for key in ("exact", "compiled"):
            assert torch.equal(out[key][0], want[0]) and torch.equal(out[key][1], want[1]), key
        assert all(torch.equal(a, b) for a, b in zip(out["random"], results[0]["random"]))  # identical on ranks
        for got, ref in zip(out["random"], want64):
            assert relative_error(got, ref) <= TOLERANCE[torch.bfloat16]


@pytest.mark.gloo
@pytest.mark.slow
def test_calls_beyond_the_prepared_sizes_run_sglangs_own_path_inside_the_op(starts):
    results = starts["start"]
    want16 = _want(dtype=torch.float16, weight=results[0]["weight"].float())
    for out in results:
        # another dtype: prepared at its first eager call and served by tpfuse
        assert torch.equal(out["other_dtype"][0], want16[0]) and torch.equal(out["other_dtype"][1], want16[1])
        # more tokens than prepared: sglang's allreduce and native norm, not the un-reduced tensor normalised
        assert all(torch.equal(a, b) for a, b in zip(out["over_max"], out["over_max_engine"]))
        assert any("3000 tokens exceed the 2048 prepared" in m for m in out["log"]), out["log"]


@pytest.mark.gloo
@pytest.mark.slow
def test_a_compiled_first_call_takes_sglangs_path_and_the_next_eager_call_prepares(starts):
    results = starts["compiled_first"]
    want = _want(weight=results[0]["weight"])
    for out in results:
        assert out["states"] == {}  # nothing prepared it: the op served sglang's own path
        assert all(torch.equal(a, b) for a, b in zip(out["compiled_first"], out["compiled_first_engine"]))
        assert out["states_after"] == {"tp:0": ([(H, torch.bfloat16)], "")}
        assert torch.equal(out["eager_after"][0], want[0]) and torch.equal(out["eager_after"][1], want[1])
