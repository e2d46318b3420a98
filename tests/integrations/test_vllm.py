"""tpfuse inside vLLM 0.33's real code: plugin discovery, the pass in vLLM's pass manager, the rewrite.

vLLM runs in a child interpreter (engine_env) on 2 gloo ranks. Graphs traced from vLLM's own ops
(`vllm.all_reduce`, then `vllm_ir.fused_add_rms_norm` or `vllm_ir.rms_norm`) run before and after
the passes vLLM's PostGradPassManager was configured with. Rounding: after the rewrite the output
is tpfuse's (normalise the rounded residual, fp32 weight multiply: equal to
`all_reduce_residual_rmsnorm_ref` bit for bit on CPU); vLLM's unfused path normalises the
unrounded fp32 sum and rounds before the weight multiply, so the two agree within the bf16
tolerance of the float64 reference, and exactly on the residual when the sum is exact.
"""

from __future__ import annotations

import pickle
import subprocess
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

pytestmark = pytest.mark.gloo

H, TOKENS, WORLD = 256, 5, 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path, why = engine_env.engine_dir("vllm")
    if path is None:
        pytest.skip(f"vLLM 0.33.0 not available: {why}")
    tmp = tmp_path_factory.mktemp("vllm")
    stub = engine_env.distribution_stub(tmp / "stub")
    out = tmp / "out.pkl"
    proc = subprocess.run([sys.executable, str(engine_env.HERE / "vllm_ranks.py"), str(out)],
                          env=engine_env.child_env(path, stub, TPFUSE_CACHE_DIR=str(tmp / "no-table")),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out, "rb") as f:
        return pickle.load(f)


def _inputs(name):
    make = random_inputs if name == "random" else small_integer_inputs
    return [make(r, TOKENS, H, torch.bfloat16) for r in range(WORLD)], make(100, TOKENS, H, torch.bfloat16)


def test_plugin_inserts_the_pass_after_noop_elimination_once(results):
    for out in results:
        assert out["configure_wrapped_once"]
        assert out["passes"] == ["NoOpEliminationPass", "TpfuseAllReduceNormPass"]
        assert len(out["uuid"]) == 64 and out["uuid"] == results[0]["uuid"]


def test_each_allreduce_norm_pair_is_rewritten(results):
    for out in results:
        for name in ("random", "exact"):
            for kind in ("fused", "plain"):
                assert out[(name, kind, "count")] == 1
                assert out[(name, kind, "targets")] == ["<built-in function getitem>", "tpfuse.engine_all_reduce_residual_rmsnorm.default"]


@pytest.mark.parametrize("name", ["random", "exact"])
def test_rewritten_graph_is_tpfuse_and_matches_the_unfused_path(results, name):
    xs, residual = _inputs(name)
    weight = results[0]["weight"]
    for kind, res in (("fused", residual), ("plain", None)):
        want = all_reduce_residual_rmsnorm_ref(xs, res, weight)
        ref64 = all_reduce_residual_rmsnorm_ref([x.double() for x in xs], None if res is None else res.double(),
                                                weight.double(), acc_dtype=torch.float64)
        for out in results:
            got, unfused = out[(name, kind, "tpfuse")], out[(name, kind, "unfused")]
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (name, kind)
            for a, b in zip(got, results[0][(name, kind, "tpfuse")]):
                assert torch.equal(a, b)  # identical bits on every rank
            assert relative_error(unfused[0], ref64[0]) <= TOLERANCE[torch.bfloat16]
            assert relative_error(got[0], unfused[0].double()) <= TOLERANCE[torch.bfloat16]
            if name == "exact":  # small integers: the allreduce and the residual add are exact in both
                assert torch.equal(got[1], unfused[1])


def test_pass_construction_prepares_the_tp_group_once(results):
    for out in results:
        assert out["prepared"] == {"tp:0 256 bfloat16": 64}
        plans = [m for m in out["log"] if m.startswith("tpfuse: vllm group tp:0 (world size 2, gloo, cpu)")]
        assert len(plans) == 1, out["log"]
        assert "\n  tokens 1-64: reference (conservative default (no dispatch table" in plans[0], plans[0]
