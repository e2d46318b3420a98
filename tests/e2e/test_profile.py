"""Stage attribution: the classification rules on kernel names, and a real CPU trace of the model.

The CPU trace is a TP=2 gloo run of the tiny model with the `dense` MoE runner forced, so every
count below follows from the model's structure (2 layers: one dense, one MoE with 8 experts, 4 per
rank, one shared expert), not from timing.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tpfuse.e2e.profile import STAGES, Record, attribute, classify, stage_bytes
from tpfuse.spawn import run_ranks

STEPS = 2


@pytest.mark.parametrize("name, scopes, stage", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", ("c10d::allreduce_",),
     "communication"),
    ("oneshot_kernel", ("tpfuse::allreduce_norm",), "communication"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", ("aten::_efficient_attention_forward", "tpfuse::attention"),
     "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", ("aten::mm", "tpfuse::moe_experts", "tpfuse::moe"),
     "moe_gemm"),
    ("nvjet_tst_64x8_64x16_2x1_v_bz_TNT", ("aten::mm", "tpfuse::attention"), "other_gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", ("aten::_grouped_mm", "tpfuse::moe_experts"),
     "moe_gemm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::sin_kernel>", ("aten::sin", "tpfuse::attention"),
     "attention"),
    ("residual_rmsnorm_kernel", ("tpfuse::allreduce_norm",), "norm"),
    ("void at::native::reduce_kernel<mean>", ("aten::mean", "tpfuse::norm"), "norm"),
    ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", ("aten::copy_", "tpfuse::allreduce_norm"),
     "communication"),
    ("void at::native::vectorized_elementwise_kernel<4, rsqrt>", ("aten::rsqrt", "tpfuse::allreduce_norm"), "norm"),
    ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", ("aten::copy_", "tpfuse::allreduce"),
     "communication"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", ("aten::bmm", "aten::matmul", "tpfuse::attention_core", "tpfuse::attention"),
     "attention"),
    ("void at::cuda::detail::prepare_grouped_gemm_data", ("aten::_grouped_mm", "tpfuse::moe_experts"), "moe_gemm"),
    ("residual_rmsnorm_kernel", ("tpfuse::all_reduce_residual_rmsnorm", "tpfuse::allreduce_norm"), "norm"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", ("nccl:all_reduce", "tpfuse::all_reduce_residual_rmsnorm"),
     "communication"),
    ("void at::native::sigmoid_kernel", ("aten::sigmoid", "tpfuse::moe"), "other"),
])
def test_classify_rules(name, scopes, stage):
    assert classify(name, scopes) == stage


def test_attribute_conserves_time_and_counts():
    records = [Record("aten::mm", ("aten::mm", "tpfuse::moe_experts"), 30.0), Record("gloo:all_reduce", (), 10.0),
               Record("aten::silu", ("aten::silu", "tpfuse::moe"), 5.0), Record("aten::mm", ("aten::mm",), 15.0)]
    table = attribute(records, steps=5)
    assert table["moe_gemm"] == {"time_us_per_step": 6.0, "share": 0.5, "launches_per_step": 0.2}
    assert table["communication"]["time_us_per_step"] == 2.0 and table["other_gemm"]["time_us_per_step"] == 3.0
    assert sum(r["time_us_per_step"] for r in table.values()) == pytest.approx(60.0 / 5)


def test_stage_bytes_moe_estimate():
    from tpfuse.models.config import model_config

    cfg = model_config("glm5", layers=1)
    b1 = stage_bytes(cfg, batch=1, context=64, world_size=1, itemsize=2)
    # one token, top-8 of 256: exactly 8 experts hit, each 3 x 6144 x 2048 bf16 weights
    assert b1["moe_gemm"] == pytest.approx(8 * 3 * 6144 * 2048 * 2)
    assert b1["communication"] == 2 * 6144 * 2
    big = stage_bytes(cfg, batch=100_000, context=64, world_size=8, itemsize=2)
    assert big["moe_gemm"] == pytest.approx(32 * 3 * 6144 * 2048 * 2)  # every local expert


def _trace_rank(rank, world):
    from tpfuse.e2e.decode import E2ESpec
    from tpfuse.e2e.profile import profile_rank

    spec = E2ESpec(preset="tiny", fusion=(False, True), tp=world, moe_runner="dense", progress=False,
                   prompt_len=4, context=16)
    return profile_rank(rank, world, spec, 2, STEPS, None, True)


@pytest.fixture(scope="module")
def cpu_trace():
    return run_ranks(_trace_rank, 2, timeout_s=240)[0]


def _per_step(records, name, stage):
    counts = Counter((r.name, classify(r.name, r.scopes)) for r in records)
    return counts[(name, stage)] / STEPS


@pytest.mark.slow
@pytest.mark.parametrize("fusion", [False, True])
@pytest.mark.gloo
def test_cpu_trace_attribution_follows_the_model(cpu_trace, fusion):
    mode = next(m for m in cpu_trace["modes"] if m["fusion"] is fusion)
    records = mode["records"]
    layers = cpu_trace["config"]["num_layers"]
    # MoE GEMMs: the dense runner runs 4 local experts x 2 matmuls (gate/up, down) in the one MoE layer.
    assert _per_step(records, "aten::mm", "moe_gemm") == 4 * 2
    # Other GEMMs: qkv + o per layer, dense MLP (2), shared expert (2), router (1), LM head (1).
    assert _per_step(records, "aten::mm", "other_gemm") == 2 * layers + 2 + 2 + 1 + 1
    # Exactly the model's allreduces reach gloo, both with and without fusion, plus the LM-head gather.
    assert _per_step(records, "c10d::allreduce_", "communication") == 2 * layers
    assert _per_step(records, "c10d::allgather_", "communication") == 1
    # One RMSNorm per reduce-norm call plus the first layer's input norm.
    assert _per_step(records, "aten::sqrt", "norm") == 2 * layers + 1
    # Decode attention: two matmuls per layer inside attention_core, attributed to attention.
    assert _per_step(records, "aten::matmul", "attention") == 2 * layers
    stages = mode["stages"]
    assert set(stages) == set(STAGES)
    total = sum(r.time_us for r in records) / STEPS
    assert sum(s["time_us_per_step"] for s in stages.values()) == pytest.approx(total)
    assert mode["allreduces_per_step"] == ({"all_reduce": 0, "all_reduce_residual_rmsnorm": 2 * layers} if fusion
                                           else {"all_reduce": 2 * layers, "all_reduce_residual_rmsnorm": 0})
