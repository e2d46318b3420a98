"""tpfuse inside vLLM 0.33's real code: plugin discovery, the pass in vLLM's pass manager, a layer
boundary compiled through Dynamo (fullgraph) and AOTAutograd with vLLM's own passes, the compile
cache's key, and the op's fallback.

vLLM runs in a child interpreter (engine_env) on 2 gloo ranks (vllm_ranks.py). Starts: a first
one with no dispatch table (the pass's construction calibrates the capture sizes and saves the
table), a second on the same cache (loads it), and one whose Communicator fails on rank 1 only.

Rounding: after the rewrite the output is tpfuse's (normalise the rounded residual, fp32 weight
multiply: equal to `all_reduce_residual_rmsnorm_ref` bit for bit on CPU); vLLM's unfused path
normalises the unrounded fp32 sum and rounds before the weight multiply, so the two agree within
the bf16 tolerance of the float64 reference, and exactly on the residual. Where the op falls back
(vLLM's own allreduce and norm), the output equals vLLM's unfused path bit for bit.

Without vLLM (plain tier): the pass stands down where vLLM fuses the allreduce itself.
"""

from __future__ import annotations

import types

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

H, TOKENS, WORLD = 256, 5, 2
SERVED = [f"{name} {kind}" for name in ("random", "exact") for kind in ("fused", "plain")] + ["closed"]
TPFUSE_GRAPH = ["<built-in function getitem>", "aten.detach.default",
                "tpfuse.engine_all_reduce_residual_rmsnorm.default"]


def _run(tmp, scenario, cache):
    return engine_env.run_child("vllm", "vllm_ranks.py", tmp, scenario, cache)


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    return {"first": _run(tmp, "start", tmp / "cache"), "second": _run(tmp, "start", tmp / "cache"),
            "one_rank": _run(tmp, "one_rank_fails", tmp / "cache-one-rank")}


def _plan_runs(line: str) -> list[str]:
    """The runs of a plan line ("tokens 1-8: ring (measured)", ...), the last ending at 64 tokens."""
    return line.split("bfloat16: ", 1)[1].split("; ")


def _inputs(name, tokens=TOKENS, dtype=torch.bfloat16):
    make = random_inputs if name.startswith("random") else small_integer_inputs
    return [make(r, tokens, H, dtype) for r in range(WORLD)], make(100, tokens, H, dtype)


@pytest.mark.gloo
@pytest.mark.slow
def test_plugin_inserts_the_pass_after_noop_elimination_once(starts):
    for out in starts["first"]:
        assert out["wrapped_once"] == [True, True]
        assert out["passes"] == ["NoOpEliminationPass", "TpfuseAllReduceNormPass"]
        assert len(out["uuid"]) == 64 and out["uuid"] == starts["first"][0]["uuid"]


@pytest.mark.gloo
@pytest.mark.slow
def test_compile_cache_key_follows_the_switch_the_strategy_and_the_table(starts):
    first, second = starts["first"][0], starts["second"][0]
    assert first["key_off"][0] == first["key_on"][0]  # vLLM's environment factors
    assert first["key_on"][1] != first["key_off"][1]  # switching tpfuse on after a plain start: another key
    assert second["key_off"] == first["key_off"]  # switching it off again: the plain key, never tpfuse's graphs
    assert first["key_after_table"][1] != first["key_on"][1]  # the calibration saved a table
    assert second["key_on"] == first["key_after_table"]  # the next start's key: the same table
    assert first["key_strategy"][1] != first["key_after_table"][1]  # TPFUSE_STRATEGY changes the key
    for start in ("first", "second"):  # every rank alike
        assert all(out["key_on"] == starts[start][0]["key_on"] for out in starts[start])


@pytest.mark.gloo
@pytest.mark.slow
def test_first_start_calibrates_and_the_second_loads(starts):
    for out in starts["first"]:
        lines = [m for m in out["log"] if m.startswith("tpfuse: calibrat")]
        assert lines[0].startswith("tpfuse: calibrating vllm group tp:0 for hidden 256 bfloat16 at 4 token "
                                   "bucket(s) (1, 2, 4, 8) within a 15 s budget"), out["log"]
        assert lines[1].startswith("tpfuse: calibrated vllm group tp:0: 4 of 4 bucket(s)"), lines
    for out in starts["second"]:
        assert not [m for m in out["log"] if m.startswith("tpfuse: calibrat")], out["log"]
    for out in starts["first"] + starts["second"]:
        assert out["prepared"] == {"tp:0 256 bfloat16": 64}  # max_num_batched_tokens
        plans = [m for m in out["log"] if m.startswith("tpfuse: vllm group tp:0 (world size 2, gloo, cpu)")]
        assert len(plans) == 1 and _plan_runs(plans[0])[-1].startswith(
            "tokens 9-64: reference (conservative default (the dispatch table has no bucket"), plans
        assert all(run.endswith("(measured)") for run in _plan_runs(plans[0])[:-1]), plans


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.parametrize("start", ["first", "second"])
def test_compiled_graph_holds_only_tpfuses_op_and_matches_the_unfused_path(starts, start):
    results = starts[start]
    weight = results[0]["weight", torch.bfloat16]
    for case in SERVED:
        xs, residual = _inputs(case)
        res = None if case.endswith("plain") else residual
        want = all_reduce_residual_rmsnorm_ref(xs, res, weight)
        ref64 = all_reduce_residual_rmsnorm_ref([x.double() for x in xs], None if res is None else res.double(),
                                                weight.double(), acc_dtype=torch.float64)
        for out in results:
            graph = out[(case, "graph")]
            assert "vllm.all_reduce.default" in graph["before"] and graph["count"] == 1
            assert graph["after"] == TPFUSE_GRAPH, graph
            got, unfused = out[(case, "tpfuse")], out[(case, "unfused")]
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), case
            assert relative_error(unfused[0], ref64[0]) <= TOLERANCE[torch.bfloat16]
            assert relative_error(got[0], unfused[0].double()) <= TOLERANCE[torch.bfloat16]
            assert torch.equal(got[1], unfused[1]) or case.startswith("random")


@pytest.mark.gloo
@pytest.mark.slow
def test_calls_not_prepared_for_and_a_graph_without_communicator_run_vllms_own_path(starts):
    for out in starts["first"]:
        for case in ("float16", "65 tokens"):  # rewritten, then served by the op's fallback
            assert out[(case, "graph")]["after"] == TPFUSE_GRAPH
            got, unfused = out[(case, "tpfuse")], out[(case, "unfused")]
            assert torch.equal(got[0], unfused[0]) and torch.equal(got[1], unfused[1]), case
        # The graph compiled with tpfuse, run once tpfuse has no Communicator (what a cached graph
        # meets where the set-up stood down): vLLM's allreduce and norm, not a crash.
        got, unfused = out[("closed", "no communicator")], out[("closed", "unfused")]
        assert torch.equal(got[0], unfused[0]) and torch.equal(got[1], unfused[1])
        warnings = [m for m in out["log"] if "the engine's own path serves calls that" in m]
        assert [w.split("calls that ")[1] for w in warnings] == [
            "float16 x hidden 256 was not prepared; tpfuse does not take them",
            "65 tokens exceed the 64 prepared; tpfuse does not take them",
            "group tp:0 was not prepared; tpfuse does not take them"]


@pytest.mark.gloo
@pytest.mark.slow
def test_communicator_failing_on_one_rank_makes_every_rank_stand_down(starts):
    reason = ("creating the Communicator failed on rank 1: RuntimeError: Communicator: device='cuda' but torch "
              "sees no CUDA GPU (injected on rank 1)")
    for out in starts["one_rank"]:
        assert out["down"] == {"tp:0": reason}
        assert [m for m in out["log"] if "stands down" in m] == [
            f"tpfuse: stands down for vllm group tp:0 on every rank: {reason}; the engine's own path serves it"]
        for case in SERVED:  # still rewritten (the graph must not depend on the set-up), served by vLLM's path
            got, unfused = out[(case, "tpfuse")], out[(case, "unfused")]
            assert torch.equal(got[0], unfused[0]) and torch.equal(got[1], unfused[1]), case


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
