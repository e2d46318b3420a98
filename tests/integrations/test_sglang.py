"""tpfuse inside sglang 0.5.23's real code, in the scheduler's order: plugins, warm-up, layer boundary.

The engine runs in a child interpreter (engine_env: pinned, --no-deps, cached outside the
repository) on 2 gloo ranks; the results are compared here with references. Starts:
- a first start with no dispatch table: the warm-up calibrates the runner's captured batch sizes,
  saves the table, and tpfuse serves `fused_ffn_input` / `fused_attn_input` (eager and under
  fullgraph torch.compile); calls it was not prepared for are declined and sglang's own path runs;
  a peer that never arrives makes the call raise (fail-stop);
- a second start on the same cache: the table loads, nothing is measured;
- a start whose Communicator fails on one rank only: every rank stands down alike;
- a start with a corrupt table and a calibration budget too small for every bucket.

On CPU tpfuse's measured choices are `reference` or `ring`, whose outputs equal
`all_reduce_residual_rmsnorm_ref` bit for bit (fp32 sum in rank order, tpfuse's rounding points).
sglang's own path (its allreduce, then its native add + RMSNorm) normalises the unrounded fp32 sum:
the two agree within the bf16 tolerance, and exactly on the residual of small-integer inputs.
"""

from __future__ import annotations

import json
import shutil

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

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

H, TOKENS, WORLD = 256, 5, 2
CAPTURE_BS = (1, 2, 4, 8)


def _run(tmp, scenario: str, cache, **env):
    return engine_env.run_child("sglang", "sglang_ranks.py", tmp, scenario, cache, **env)


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    """The first and the second start on one cache directory, then the fault starts."""
    tmp = tmp_path_factory.mktemp("sglang")
    cache = tmp / "cache"
    first = _run(tmp, "start", cache)
    table = sorted(cache.glob("dispatch-*.json"))
    saved = [json.loads(p.read_text()) for p in table]
    second = _run(tmp, "start", cache)
    one_rank = _run(tmp, "one_rank_fails", tmp / "cache-one-rank")
    bad = tmp / "cache-bad"
    shutil.copytree(cache, bad)
    for p in bad.glob("dispatch-*.json"):
        p.write_text(p.read_text()[: len(p.read_text()) // 2])  # truncated mid-write
    corrupt = _run(tmp, "start", bad, TPFUSE_CALIBRATE="0.001s")
    return {"first": first, "second": second, "saved": saved, "one_rank": one_rank, "corrupt": corrupt,
            "corrupt_saved": [json.loads(p.read_text()) for p in sorted(bad.glob("dispatch-*.json"))]}


def _measured_up_to_8(plan: str) -> None:
    """The plan line: measured runs up to the largest captured size, then the conservative default."""
    runs = plan.split("bfloat16: ", 1)[1].split("; ")
    assert runs[-1].startswith("tokens 9-2048: reference (conservative default (the dispatch table has no "
                               "bucket"), plan
    assert all(run.endswith("(measured)") for run in runs[:-1]) and runs[-2].split(":")[0].endswith("8"), plan


def _calibration_lines(out):
    return [m for m in out["log"] if m.startswith("tpfuse: calibrat")]


def _served(out, ref_exact, ref_random):
    for key, ref in ((("ffn", "random"), ref_random), (("attn", "random"), ref_random),
                     (("ffn", "exact"), ref_exact), (("attn", "exact"), ref_exact)):
        normed, new_residual = out[key]
        assert torch.equal(normed, ref[0]) and torch.equal(new_residual, ref[1]), key


def _refs(weight):
    refs = {}
    for name, make in (("random", random_inputs), ("exact", small_integer_inputs)):
        xs = [make(r, TOKENS, H, torch.bfloat16) for r in range(WORLD)]
        refs[name] = all_reduce_residual_rmsnorm_ref(xs, make(100, TOKENS, H, torch.bfloat16), weight)
    return refs


def test_plugin_loaded_before_the_config_and_every_hook_applied_once(starts):
    from tpfuse.integrations.sglang import TARGETS

    for out in starts["first"]:
        assert out["hooks"] == {target: 1 for target in TARGETS}  # load_plugins twice, plugin() again: once
        assert out["patched"] == sorted(TARGETS)
        assert out["gate_rebound"], "the gate bound by name in fusions/allreduce.py must be the hooked one"


def test_first_start_calibrates_the_captured_sizes_within_budget_and_saves_the_table(starts):
    for out in starts["first"]:
        lines = _calibration_lines(out)
        assert lines[0].startswith("tpfuse: calibrating sglang group tp:0 for hidden 256 bfloat16 at 4 token "
                                   "bucket(s) (1, 2, 4, 8) within a 15 s budget; TPFUSE_CALIBRATE=0 turns it off")
        assert lines[1].startswith("tpfuse: calibrated sglang group tp:0: 4 of 4 bucket(s) in "), lines
        assert out["warmup_s"] < 15 + 5  # the budget plus the Communicator's construction
        plans = [m for m in out["log"] if m.startswith("tpfuse: sglang group tp:0 (world size")]
        assert len(plans) == 1 and "\n" not in plans[0], out["log"]  # one line per group
        _measured_up_to_8(plans[0])
    (saved,) = starts["saved"]
    entries = sorted((e["tokens"], e["op"], e["hidden"], e["dtype"]) for e in saved["entries"])
    assert entries == [(t, "all_reduce_residual_rmsnorm", H, "bfloat16") for t in CAPTURE_BS]
    assert all(e["choice"] in ("reference", "ring") for e in saved["entries"])  # do-no-harm: unfused on CPU


def test_second_start_loads_the_table_without_measuring(starts):
    for out in starts["second"]:
        assert _calibration_lines(out) == [], out["log"]
        plans = [m for m in out["log"] if m.startswith("tpfuse: sglang group tp:0 (world size")]
        _measured_up_to_8(plans[0])


@pytest.mark.parametrize("start", ["first", "second"])
def test_layer_boundary_is_tpfuse_bit_for_bit_eager_and_fullgraph(starts, start):
    results = starts[start]
    refs = _refs(results[0]["weight"])
    for out in results:
        assert out["prepared"] == {"tp:0 256 bfloat16": 2048}  # FUSE_ALLREDUCE_MAX_BATCH_SIZE
        assert out["gate_before_prepare"] is False  # no warm-up, no fusion: every rank alike
        assert out["gate"] == {0: False, 1: True, TOKENS: True, 2048: True, 2049: False}
        assert out["calls"] and set(out["calls"]) == {"tp:0"}, "each forward must reach tpfuse for sglang's group"
        _served(out, refs["exact"], refs["random"])
        for fn in ("ffn", "attn"):  # torch.compile(fullgraph=True): no graph break, the same bits
            assert all(torch.equal(a, b) for a, b in zip(out[("compiled", fn)], out[(fn, "random")])), fn
        for name in ("random", "exact"):  # sglang's own unfused path, for scale
            unfused, got = out[("unfused", name)], out[("ffn", name)]
            assert relative_error(got[0], unfused[0].double()) <= TOLERANCE[torch.bfloat16]
        assert torch.equal(out[("ffn", "exact")][1], out[("unfused", "exact")][1])


def test_calls_tpfuse_was_not_prepared_for_run_sglangs_own_path(starts):
    for out in starts["first"]:
        assert out["declined_calls"] == 4
        for case, (got, want) in out["declined"].items():  # sglang's allreduce + its native norm, bit for bit
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), case
        warnings = [m for m in out["log"] if "run sglang's own allreduce + add + norm" in m]
        assert len(warnings) == 4, out["log"]  # one per reason, naming it
        assert any("float16 x hidden 256 was not prepared" in m for m in warnings)
        assert any("2049 tokens exceed the 2048 prepared" in m for m in warnings)
        assert any("residual float32" in m for m in warnings)


def _serving(plan: str, tokens: int) -> str:
    """The strategy the plan line gives calls of `tokens` tokens ("tokens 3-8: ring (measured)")."""
    for run in plan.split("bfloat16: ", 1)[1].split("; "):
        span, name = run.removeprefix("tokens ").split(": ", 1)
        low, _, high = span.partition("-")
        if int(low) <= tokens <= int(high or low):
            return name.split(" ", 1)[0]
    raise AssertionError(f"no run of {plan!r} covers {tokens} tokens")


def test_a_peer_that_never_arrives_raises(starts):
    # Rank 1 skips the call and exits: rank 0's call raises (fail-stop), it never returns data. The
    # strategy serving the call is the one calibration measured fastest at its size.
    out = starts["first"][0]
    (plan,) = [m for m in out["log"] if m.startswith("tpfuse: sglang group tp:0 (world size")]
    name = _serving(plan, TOKENS)
    assert name in ("reference", "ring"), plan
    assert out["peer_fault"].startswith(f"PeerLostError: {name}: rank 0 lost the connection to rank 1"), (
        out["peer_fault"])


def test_stand_down_by_configuration_falls_through_to_sglang(starts):
    for out in starts["first"]:
        assert out["after_cleanup"] == {}
        assert out["down_gate"] is False and out["down_calls"] == 0
        # sglang's own op ran (it exists for CUDA only, hence its error on CPU), not tpfuse's.
        assert out["down_op"].startswith("Could not run 'sglang::flashinfer_allreduce_residual_rmsnorm' with "
                                         "arguments from the 'CPU' backend")
        assert [m for m in out["log"] if "stands down in sglang" in m] == [
            "tpfuse: stands down in sglang: --flashinfer-allreduce-fusion-backend cutedsl owns its own fused path"]


def test_communicator_failing_on_one_rank_makes_every_rank_stand_down(starts):
    reason = ("creating the Communicator failed on rank 1: RuntimeError: Communicator: device='cuda' but torch "
              "sees no CUDA GPU (injected on rank 1)")
    for out in starts["one_rank"]:
        assert out["down"] == {"tp:0": reason}
        assert [m for m in out["log"] if "stands down for sglang group" in m] == [
            f"tpfuse: stands down for sglang group tp:0 on every rank: {reason}; the engine's own path serves it"]
        assert out["gate"] == {0: False, 1: False, TOKENS: False, 2048: False, 2049: False}  # sglang's gate (CPU)
        assert out["calls"] == []
        for key in (("ffn", "random"), ("attn", "random"), ("ffn", "exact"), ("attn", "exact")):
            assert out[key] is None  # the fused kernels decline: sglang's layer boundary runs its own path
        unfused, boundary = out[("unfused", "exact")], out["boundary_unfused"]
        assert torch.equal(boundary[0], unfused[0]) and torch.equal(boundary[1], unfused[1])


def test_corrupt_table_and_a_budget_spent_after_one_bucket(starts):
    refs = _refs(starts["corrupt"][0]["weight"])
    for out in starts["corrupt"]:
        lines = _calibration_lines(out)
        assert "within a 0.001 s budget" in lines[0], lines
        assert "1 of 4 bucket(s)" in lines[1] and "the budget ran out before 2, 4, 8" in lines[1], lines
        _served(out, refs["exact"], refs["random"])
    # The corrupt file was replaced by the bucket measured; the start's second warm-up (after its
    # cleanup, before the peer-fault call) measured the next missing bucket and merged it.
    (saved,) = starts["corrupt_saved"]
    assert sorted(e["tokens"] for e in saved["entries"]) == [1, 2]
    assert [m for m in starts["corrupt"][0]["log"] if "1 of 3 bucket(s)" in m], starts["corrupt"][0]["log"]
