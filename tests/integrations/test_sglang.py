"""tpfuse inside sglang 0.5.23's real code: plugin discovery, hooks, gate, RMSNorm forward, cleanup.

The engine runs in a child interpreter (engine_env: pinned, --no-deps, cached outside the
repository) on 2 gloo ranks; the results are compared here with tpfuse's reference. The
reference strategy is what tpfuse dispatches on CPU, so the engine's output must equal
`all_reduce_residual_rmsnorm_ref` bit for bit (fp32 sum in rank order, tpfuse's rounding points).
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import engine_env
import pytest
import torch

from tpfuse.reference import all_reduce_residual_rmsnorm_ref, random_inputs, small_integer_inputs

pytestmark = pytest.mark.gloo

H, TOKENS, WORLD = 256, 5, 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path, why = engine_env.engine_dir("sglang")
    if path is None:
        pytest.skip(f"sglang 0.5.23 not available: {why}")
    tmp = tmp_path_factory.mktemp("sglang")
    stub = engine_env.distribution_stub(tmp / "stub")
    out = tmp / "out.pkl"
    proc = subprocess.run([sys.executable, str(engine_env.HERE / "sglang_ranks.py"), str(out)],
                          env=engine_env.child_env(path, stub, TPFUSE_CACHE_DIR=str(tmp / "no-table")), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out, "rb") as f:
        return pickle.load(f)


def test_plugin_discovered_and_every_hook_applied_once(results):
    from tpfuse.integrations.sglang import TARGETS

    for out in results:
        assert out["hooks"] == {target: 1 for target in TARGETS}  # load_plugins twice, plugin() again: once
        assert out["patched"] == sorted(TARGETS)
        assert out["gate_rebound"], "the gate bound by name in fusions/allreduce.py must be the hooked one"


def test_gate_is_static_and_follows_what_was_prepared(results):
    for out in results:
        assert out["gate_before_prepare"] is False  # no warm-up, no fusion: every rank alike
        assert out["prepared"] == {"tp:0 256 bfloat16": 2048, "tp:0 128 bfloat16": 2048}  # FUSE_ALLREDUCE_MAX_BATCH_SIZE
        assert out["gate"] == {0: False, 1: True, TOKENS: True, 2048: True, 2049: False}


def test_rmsnorm_forward_with_allreduce_fusion_is_tpfuse_bit_for_bit(results):
    weight = results[0]["weight"]
    xs = [random_inputs(r, TOKENS, H, torch.bfloat16) for r in range(WORLD)]
    want = all_reduce_residual_rmsnorm_ref(xs, random_inputs(100, TOKENS, H, torch.bfloat16), weight)
    xi = [small_integer_inputs(r, TOKENS, H, torch.bfloat16) for r in range(WORLD)]
    want_exact = all_reduce_residual_rmsnorm_ref(xi, small_integer_inputs(100, TOKENS, H, torch.bfloat16), weight)
    for out in results:
        assert out["calls"] == ["tp:0"] * 3, "each forward must reach tpfuse's op for sglang's fusion group"
        for key, ref in (("random", want), ("moe_group", want), ("exact", want_exact)):
            normed, new_residual = out[key]
            assert torch.equal(normed, ref[0]) and torch.equal(new_residual, ref[1]), key


def test_plan_logged_once_and_cleanup_closes(results):
    for out in results:
        plans = [m for m in out["log"] if m.startswith("tpfuse: sglang group tp:0")]
        assert len(plans) == 2 and "hidden 128 bfloat16" in plans[1], out["log"]
        plans = [m for m in plans if "hidden 256 bfloat16" in m]
        assert len(plans) == 1, out["log"]
        # No dispatch table (an empty TPFUSE_CACHE_DIR): one run, the conservative default's reason.
        assert "\n  tokens 1-2048: reference (conservative default (no dispatch table" in plans[0], plans[0]
        assert out["after_cleanup"] == {}


def test_stand_down_falls_through_to_sglang_and_says_why(results):
    for out in results:
        assert out["down_gate"] is False and out["down_calls"] == 0
        # sglang's own op ran (it exists for CUDA only, hence its error on CPU), not tpfuse's.
        assert out["down_op"].startswith("Could not run 'sglang::flashinfer_allreduce_residual_rmsnorm' with arguments from the 'CPU' backend")
        assert [m for m in out["log"] if "stands down" in m] == [
            "tpfuse: stands down in sglang: --flashinfer-allreduce-fusion-backend cutedsl owns its own fused path"]
