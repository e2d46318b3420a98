"""GPU tier: the engines' fused call, `tpfuse::engine_all_reduce_residual_rmsnorm` keyed by the
group's name, prepared as the plugins prepare it, on 2 processes sharing one GPU with `oneshot`,
captured in a CUDA graph and replayed.

The processes talk over gloo (NCCL refuses two ranks on one GPU) and handshake on a separate gloo
CPU group, as engines pass theirs; CUDA IPC maps the peer buffers. The engines' own modules are
not imported here: on the GPU machines they need their compiled extensions, built for a newer torch
(the CPU tests run the engines' code). Start MPS first for speed (benchmarks/device/gpu_check_kernels.py).
"""

import pytest
import torch

from tpfuse.reference import all_reduce_residual_rmsnorm_ref, small_integer_inputs
from tpfuse.spawn import run_ranks

pytestmark = pytest.mark.gpu
ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "TPFUSE_STRATEGY": "oneshot", "TPFUSE_TIMEOUT_S": "20"}
M, H, DTYPE, STEPS = 24, 4096, torch.bfloat16, 4


def _graph_rank(rank, world_size):
    import torch.distributed as dist

    from tpfuse.integrations import runtime
    from tpfuse.spec import Op

    torch.cuda.set_device(0)
    group = runtime.EngineGroup("tp:0", dist.new_group(list(range(world_size))),
                                dist.new_group(list(range(world_size)), backend="gloo"), "cuda")
    runtime.prepare("vllm", group, hidden=H, dtype=DTYPE, max_tokens=64)
    chosen = runtime.state("tp:0").comm.strategy_for(Op.ALL_REDUCE_RESIDUAL_RMSNORM, M, H, DTYPE).name
    op = torch.ops.tpfuse.engine_all_reduce_residual_rmsnorm
    x, res, w = (torch.zeros(M, H, dtype=DTYPE, device="cuda") for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(x.fill_(1), res, w[0], 1e-6, "tp:0")  # eager warm-up, as the engines' runners do before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, new_res = op(x, res, w[0], 1e-6, "tp:0")
    outs = []
    for step in range(STEPS):
        x.copy_(small_integer_inputs(rank, M, H, DTYPE, seed=step))
        res.copy_(small_integer_inputs(100, M, H, DTYPE, seed=step))
        w.copy_(small_integer_inputs(101, M, H, DTYPE, seed=step))
        normed.fill_(float("nan"))
        new_res.fill_(float("nan"))
        graph.replay()
        outs.append((normed.cpu(), new_res.cpu()))
    runtime.state("tp:0").comm.check()
    dist.barrier()
    runtime.close_all()
    return chosen, outs


def test_engine_op_captured_and_replayed_with_oneshot_on_a_shared_gpu():
    results = run_ranks(_graph_rank, 2, env=ENV, timeout_s=400)
    for chosen, outs in results:
        assert chosen == "oneshot"
        for step, (normed, new_res) in enumerate(outs):
            xs = [small_integer_inputs(r, M, H, DTYPE, seed=step) for r in range(2)]
            want = all_reduce_residual_rmsnorm_ref(xs, small_integer_inputs(100, M, H, DTYPE, seed=step),
                                                   small_integer_inputs(101, M, H, DTYPE, seed=step)[0])
            assert torch.equal(new_res, want[1]), step  # small-integer sums are exact
            assert torch.equal(normed, want[0]), step
