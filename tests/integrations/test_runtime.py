"""The engine runtime without an engine: set-up agreed across ranks (one rank failing outside a
collective while the others are inside one), stand-down, the calibration into a saved table and
its reload, the per-call checks and the op's fallback.

GPU tier: the engines' fused call, `tpfuse::engine_all_reduce_residual_rmsnorm` keyed by the
group's name, prepared as the plugins prepare it, on 2 processes sharing one GPU with `oneshot`,
captured in a CUDA graph and replayed. The processes talk over gloo (NCCL refuses two ranks on one
GPU) and handshake on a separate gloo CPU group, as engines pass theirs; CUDA IPC maps the peer
buffers. The engines' own modules are not imported here: on the GPU machines they need their
compiled extensions, built for a newer torch (the CPU tests run the engines' code). Start MPS first
for speed (benchmarks/device/gpu_check_kernels.py).
"""

from __future__ import annotations

import pytest
import torch

from tpfuse.reference import all_reduce_residual_rmsnorm_ref, small_integer_inputs
from tpfuse.spawn import run_ranks

H = 64


def _group(name="tp:0"):
    import torch.distributed as dist

    from tpfuse.integrations.runtime import EngineGroup

    return EngineGroup(name, dist.new_group([0, 1]), dist.new_group([0, 1], backend="gloo"), "cpu")


def _agree_rank(rank, world_size):
    import torch.distributed as dist

    from tpfuse.integrations import runtime

    group = _group()

    def step():  # two object collectives, as the Communicator's constructor makes; rank 1 fails first
        if rank == 1:
            raise RuntimeError("broken on rank 1")
        for _ in range(2):
            box = [None] * world_size
            dist.all_gather_object(box, {"host": "h"}, group=group.cpu_group)
            _ = [b["host"] for b in box]

    _, error = runtime._attempt(step)
    first = runtime.agree(group, "creating the Communicator", error)
    second = runtime.agree(group, "the next step", "")  # the ranks are in step again afterwards
    return first, second


@pytest.mark.gloo
def test_agreement_meets_a_rank_that_failed_outside_the_others_collective():
    results = run_ranks(_agree_rank, 2, timeout_s=120)
    want = ("creating the Communicator failed on rank 1: RuntimeError: broken on rank 1", "")
    assert results[0] == results[1] == want


def _setup_rank(rank, world_size, cache, calibrate):
    import os

    import torch.distributed as dist

    from tpfuse.integrations import runtime

    os.environ["TPFUSE_CACHE_DIR"] = cache
    os.environ["TPFUSE_CALIBRATE"] = calibrate
    out = {}
    group = _group()
    out["served"] = runtime.prepare("vllm", group, hidden=H, dtype=torch.bfloat16, max_tokens=16, buckets=(1, 4, 32))
    out["table_tokens"] = sorted(e.tokens for e in runtime.state("tp:0").comm.table.entries) \
        if runtime.state("tp:0").comm is not None and runtime.state("tp:0").comm.table is not None else []
    x, res = small_integer_inputs(rank, 3, H, torch.bfloat16), small_integer_inputs(100, 3, H, torch.bfloat16)
    weight = small_integer_inputs(101, 1, H, torch.bfloat16)[0]
    op = torch.ops.tpfuse.engine_all_reduce_residual_rmsnorm
    out["served_call"] = op(x, res, weight, 1e-6, "tp:0")
    out["reasons"] = {
        "float16": runtime.unservable("tp:0", x.half(), res.half(), weight.half()),
        "tokens": runtime.unservable("tp:0", small_integer_inputs(rank, 17, H, torch.bfloat16), None, weight),
        "hidden": runtime.unservable("tp:0", x[:, :32], None, weight[:32]),
        "residual": runtime.unservable("tp:0", x, res.float(), weight),
        "weight": runtime.unservable("tp:0", x, res, weight[:32]),
        "unknown": runtime.unservable("tp:9", x, res, weight),
    }
    out["limit"] = runtime.prepared_tokens(["tp:0"])
    # A call tpfuse cannot serve, and no engine fallback registered: an error naming the fix, not data.
    try:
        op(x.half(), res.half(), weight.half(), 1e-6, "tp:0")
        out["no_fallback"] = "returned"
    except RuntimeError as exc:
        out["no_fallback"] = str(exc)

    def fallback(x, residual, weight, eps, name):  # an engine's own path: its allreduce, its norm
        reduced = x.float().clone()
        dist.all_reduce(reduced, group=group.device_group)
        reduced = reduced.to(x.dtype)
        new_residual = reduced if residual is None else (reduced.float() + residual.float()).to(x.dtype)
        return torch.full_like(x, 7.0), new_residual

    runtime.register_fallback("test", fallback)
    out["fallback_call"] = op(x.half(), res.half(), weight.half(), 1e-6, "tp:0")
    runtime._FALLBACKS.clear()
    runtime.close_all()
    out["limit_after_close"] = runtime.prepared_tokens(["tp:0"])
    return out


@pytest.mark.gloo
@pytest.mark.slow
def test_first_set_up_calibrates_and_saves_the_next_loads_it(tmp_path):
    cache = str(tmp_path / "cache")
    first = run_ranks(_setup_rank, 2, args=(cache, "1"), timeout_s=300)
    saved = sorted((tmp_path / "cache").glob("dispatch-*.json"))
    assert len(saved) == 1
    mtime = saved[0].stat().st_mtime_ns
    second = run_ranks(_setup_rank, 2, args=(cache, "1"), timeout_s=300)
    assert saved[0].stat().st_mtime_ns == mtime  # loaded, not measured again
    xs = [small_integer_inputs(r, 3, H, torch.bfloat16) for r in range(2)]
    res = small_integer_inputs(100, 3, H, torch.bfloat16)
    want = all_reduce_residual_rmsnorm_ref(xs, res, small_integer_inputs(101, 1, H, torch.bfloat16)[0])
    for out in first + second:
        assert out["served"] and out["table_tokens"] == [1, 4]  # 32 lies beyond max_tokens 16
        assert torch.equal(out["served_call"][0], want[0]) and torch.equal(out["served_call"][1], want[1])
        assert out["reasons"] == {"float16": "float16 x hidden 64 was not prepared",
                                  "tokens": "17 tokens exceed the 16 prepared",
                                  "hidden": "bfloat16 x hidden 32 was not prepared",
                                  "residual": "residual float32 (3, 64) does not match x",
                                  "weight": "weight bfloat16 (32,) does not match x",
                                  "unknown": "group tp:9 was not prepared"}
        assert out["limit"] == 16 and out["limit_after_close"] == 0
        assert out["no_fallback"].startswith("tpfuse::engine_all_reduce_residual_rmsnorm: group 'tp:0' has no "
                                             "Communicator (float16 x hidden 64 was not prepared) and no engine")
        normed, new_residual = out["fallback_call"]
        assert torch.equal(normed, torch.full_like(normed, 7.0))  # the engine's path ran, not tpfuse's
        assert torch.equal(new_residual, want[1].half())


@pytest.mark.gloo
def test_calibration_off_keeps_the_conservative_default_and_saves_nothing(tmp_path):
    results = run_ranks(_setup_rank, 2, args=(str(tmp_path / "cache"), "0"), timeout_s=300)
    assert not list((tmp_path / "cache").glob("dispatch-*.json"))
    for out in results:
        assert out["served"] and out["table_tokens"] == []


def _one_rank_bad_switch(rank, world_size, cache):
    import os

    from tpfuse.integrations import runtime

    os.environ["TPFUSE_CACHE_DIR"] = cache
    os.environ["TPFUSE_CALIBRATE"] = "soon" if rank == 1 else "1"
    group = _group()
    served = runtime.prepare("sglang", group, hidden=H, dtype=torch.bfloat16, max_tokens=8, buckets=(1, 2))
    return served, runtime.down_reason("tp:0"), runtime.prepared_tokens(["tp:0"])


@pytest.mark.gloo
def test_a_bad_switch_on_one_rank_stands_every_rank_down(tmp_path):
    results = run_ranks(_one_rank_bad_switch, 2, args=(str(tmp_path / "cache"),), timeout_s=300)
    assert results[0] == results[1]
    served, reason, limit = results[0]
    assert not served and limit == 0
    assert reason == ("calibration failed on every rank: ValueError: rank 1: TPFUSE_CALIBRATE='soon': use 1 "
                      "(on, 15 s), 0 (off) or a budget in seconds such as 30s")


# ---- the engines' op in a CUDA graph, on one GPU -------------------------------------------------

GRAPH_ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "TPFUSE_STRATEGY": "oneshot", "TPFUSE_TIMEOUT_S": "20"}
GRAPH_M, GRAPH_H, GRAPH_DTYPE, GRAPH_STEPS = 24, 4096, torch.bfloat16, 4


def _graph_rank(rank, world_size):
    import torch.distributed as dist

    from tpfuse.integrations import runtime
    from tpfuse.spec import Op

    torch.cuda.set_device(0)
    group = runtime.EngineGroup("tp:0", dist.new_group(list(range(world_size))),
                                dist.new_group(list(range(world_size)), backend="gloo"), "cuda")
    runtime.prepare("vllm", group, hidden=GRAPH_H, dtype=GRAPH_DTYPE, max_tokens=64)
    chosen = runtime.state("tp:0").comm.strategy_for(Op.ALL_REDUCE_RESIDUAL_RMSNORM, GRAPH_M, GRAPH_H, GRAPH_DTYPE).name
    op = torch.ops.tpfuse.engine_all_reduce_residual_rmsnorm
    x, res, w = (torch.zeros(GRAPH_M, GRAPH_H, dtype=GRAPH_DTYPE, device="cuda") for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(x.fill_(1), res, w[0], 1e-6, "tp:0")  # eager warm-up, as the engines' runners do before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, new_res = op(x, res, w[0], 1e-6, "tp:0")
    outs = []
    for step in range(GRAPH_STEPS):
        x.copy_(small_integer_inputs(rank, GRAPH_M, GRAPH_H, GRAPH_DTYPE, seed=step))
        res.copy_(small_integer_inputs(100, GRAPH_M, GRAPH_H, GRAPH_DTYPE, seed=step))
        w.copy_(small_integer_inputs(101, GRAPH_M, GRAPH_H, GRAPH_DTYPE, seed=step))
        normed.fill_(float("nan"))
        new_res.fill_(float("nan"))
        graph.replay()
        outs.append((normed.cpu(), new_res.cpu()))
    runtime.state("tp:0").comm.check()
    dist.barrier()
    runtime.close_all()
    return chosen, outs


@pytest.mark.gpu
def test_engine_op_captured_and_replayed_with_oneshot_on_a_shared_gpu():
    results = run_ranks(_graph_rank, 2, env=GRAPH_ENV, timeout_s=400)
    for chosen, outs in results:
        assert chosen == "oneshot"
        for step, (normed, new_res) in enumerate(outs):
            xs = [small_integer_inputs(r, GRAPH_M, GRAPH_H, GRAPH_DTYPE, seed=step) for r in range(2)]
            want = all_reduce_residual_rmsnorm_ref(
                xs, small_integer_inputs(100, GRAPH_M, GRAPH_H, GRAPH_DTYPE, seed=step),
                small_integer_inputs(101, GRAPH_M, GRAPH_H, GRAPH_DTYPE, seed=step)[0])
            assert torch.equal(new_res, want[1]), step  # small-integer sums are exact
            assert torch.equal(normed, want[0]), step


def test_the_plan_line_covers_every_token_count_with_the_bucket_that_serves_it():
    from types import SimpleNamespace

    from tpfuse.integrations.runtime import EngineGroup, plan_text

    table = {1: "ring", 2: "reference", 4: "reference", 8: "ring"}  # measured buckets; larger: the default

    def strategy_for(op, tokens, hidden, dtype):
        if tokens in table:
            return SimpleNamespace(name=table[tokens], source="table", reason="")
        return SimpleNamespace(name="reference", source="default", reason="no bucket")

    comm = SimpleNamespace(strategy_for=strategy_for, world_size=2, facts=SimpleNamespace(backend="gloo",
                                                                                        device_type="cpu"))
    line = plan_text("vllm", EngineGroup("tp:0", None, None, "cpu"), comm, 256, torch.bfloat16, 64)
    assert line.endswith("hidden 256 bfloat16: tokens 1: ring (measured); tokens 2-4: reference (measured); "
                         "tokens 5-8: ring (measured); tokens 9-64: reference (no bucket)"), line
