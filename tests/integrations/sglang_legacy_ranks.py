"""Child program of test_sglang_legacy.py: sglang 0.5.10's real modules on 2 gloo ranks, with tpfuse's
import hook.

    python sglang_legacy_ranks.py OUT.pkl SCENARIO      (PYTHONPATH from engine_env.child_env)

In the order of a worker that `python -m tpfuse.integrations.sglang_legacy` spawned: the hook first
(the worker imports the launcher's main module before anything else), then sglang's modules, its
parallel state and the scheduler's server args, then the CUDA-graph runner's `capture` (on a runner
of sglang's own class holding the captured batch sizes; sglang's own capture, which needs a GPU,
is the one thing replaced, by a recorder), then the layer boundary: the attention-TP path of
`CommunicateWithAllReduceAndLayerNormFn._gather_hidden_states_and_residual` with its gate and
`RMSNorm.forward_with_allreduce_fusion`, eager and under `torch.compile(fullgraph=True)`.

SCENARIO: "start" (a normal start, then calls tpfuse cannot serve), "compiled_first" (no capture:
the first call is compiled, so nothing prepared it). The per-rank results are pickled to OUT.pkl.
"""

from __future__ import annotations

import pickle
import sys
import time

H = 256
TOKENS = 5
CAPTURE_BS = (1, 2, 4, 8)
GATE_CALLS = 20000


def rank_main(rank: int, world_size: int, scenario: str) -> dict:
    import logging

    import tpfuse.integrations.sglang_legacy as legacy  # a spawned worker's first import: installs the hook

    out: dict = {"log": [], "hook_first": not any(m.split(".")[0] == "sglang" for m in sys.modules)}
    handler = logging.Handler()
    handler.emit = lambda record: out["log"].append(record.getMessage())
    logging.getLogger("tpfuse.integrations").addHandler(handler)
    logging.getLogger("tpfuse.integrations").setLevel(logging.INFO)

    import torch
    from engine_env import install_legacy_stand_ins

    install_legacy_stand_ins()
    torch.set_grad_enabled(False)  # sglang's model runner serves under torch.no_grad()
    import sglang.srt.layers.communicator as communicator
    import sglang.srt.layers.flashinfer_comm_fusion as fc
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.communicator import CommunicateContext, CommunicateWithAllReduceAndLayerNormFn, ScatterMode
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    import tpfuse.integrations.runtime as runtime
    from tpfuse.reference import random_inputs, small_integer_inputs

    out["patched"] = {"gate": communicator.apply_flashinfer_allreduce_fusion is legacy.gate,
                      "op": fc.flashinfer_allreduce_residual_rmsnorm is legacy.op,
                      "capture": CudaGraphRunner.capture is legacy.capture}

    # The scheduler's order: the world, the model-parallel groups, the server args, DP attention.
    init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo")
    initialize_model_parallel(tensor_model_parallel_size=world_size, backend="gloo")
    server_args = ServerArgs(model_path="dummy", tp_size=world_size, device="cpu")
    set_global_server_args_for_scheduler(server_args)
    initialize_dp_attention(server_args, type("ModelConfig", (), {"hidden_size": H, "dtype": torch.bfloat16})())

    norm = RMSNorm(H, eps=1e-6).to(torch.bfloat16)
    norm.weight.copy_((1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(7))).to(torch.bfloat16))
    out["weight"] = norm.weight.detach().clone()

    def boundary(x, residual):
        """sglang's attention-TP layer boundary: its gate, then the fused norm or its own path."""
        return CommunicateWithAllReduceAndLayerNormFn._gather_hidden_states_and_residual(
            x, residual, None, norm, CommunicateContext.init_new(), residual_input_mode=ScatterMode.TP_ATTN_FULL)

    def inputs(make, tokens=TOKENS, dtype=torch.bfloat16):
        return make(rank, tokens, H, dtype), make(100, tokens, H, dtype)

    def engine_unfused(make, tokens=TOKENS, dtype=torch.bfloat16, norm=norm):
        """sglang's own path on these inputs: the sum over ranks (one rounding, as gloo's 2-rank
        sum), then sglang's native add + RMSNorm, computed here without communicating."""
        total = sum(make(r, tokens, H, dtype).float() for r in range(world_size)).to(dtype)
        return norm.forward_native(total, make(100, tokens, H, dtype))

    if scenario == "compiled_first":  # no capture: the first call is compiled, so nothing prepared it
        x, res = inputs(small_integer_inputs)
        compiled = torch.compile(boundary, fullgraph=True)
        out["compiled_first"] = compiled(x, res.clone())
        out["compiled_first_engine"] = engine_unfused(small_integer_inputs)
        out["states"] = {n: (sorted(st.prepared), st.down) for n, st in runtime._STATES.items()}
        out["eager_after"] = boundary(x, res.clone())  # eager: prepares now, then tpfuse serves it
        out["states_after"] = {n: (sorted(st.prepared), st.down) for n, st in runtime._STATES.items()}
        return out

    out["gate_before_capture"] = communicator.apply_flashinfer_allreduce_fusion(TOKENS)

    # The runner's capture on sglang's own class; its __init__ (which captures) needs a GPU, so the
    # fields capture reads are set as __init__ sets them, and sglang's own capture is recorded.
    model_runner = type("ModelRunner", (), {})()
    model_runner.model_config = type("ModelConfig", (), {"hidden_size": H})()
    model_runner.dtype = torch.bfloat16
    runner = object.__new__(CudaGraphRunner)
    runner.model_runner, runner.capture_bs, runner.num_tokens_per_bs = model_runner, list(CAPTURE_BS), 1
    captured = []
    sglang_capture, legacy.capture.__wrapped__ = legacy.capture.__wrapped__, lambda self: captured.append(
        sorted(n for n, st in runtime._STATES.items() if st.prepared))
    started = time.perf_counter()
    try:
        CudaGraphRunner.capture(runner)
    finally:
        legacy.capture.__wrapped__ = sglang_capture
    out["capture_s"] = time.perf_counter() - started
    out["prepared_before_sglang_capture"] = captured
    out["prepared"] = {f"{n} {h} {str(d).removeprefix('torch.')}": t
                       for n, st in runtime._STATES.items() for (h, d), t in st.prepared.items()}
    out["down"] = {n: st.down for n, st in runtime._STATES.items()}
    out["gate"] = {bs: communicator.apply_flashinfer_allreduce_fusion(bs) for bs in (0, 1, TOKENS, 2048, 2049)}
    gate, reads = communicator.apply_flashinfer_allreduce_fusion, []
    config_allows = legacy._config_allows
    legacy._config_allows = lambda: reads.append(1) or config_allows()
    started = time.perf_counter()
    for _ in range(GATE_CALLS):
        gate(TOKENS)
    out["gate_us"] = (time.perf_counter() - started) * 1e6 / GATE_CALLS
    out["gate_config_reads"] = len(reads)  # sglang's own clauses, read once and cached
    legacy._config_allows = config_allows

    x, res = inputs(small_integer_inputs)
    out["exact"] = boundary(x, res.clone())
    x, res = inputs(random_inputs)
    out["random"] = boundary(x, res.clone())
    compiled = torch.compile(boundary, fullgraph=True)
    x, res = inputs(small_integer_inputs)
    out["compiled"] = compiled(x, res.clone())

    # Calls tpfuse was not prepared for: sglang's own path runs inside the op (0.5.10's caller would
    # otherwise normalise the un-reduced tensor).
    x, res = inputs(small_integer_inputs, dtype=torch.float16)
    norm16 = RMSNorm(H, eps=1e-6).to(torch.float16)
    norm16.weight.copy_(norm.weight.float().to(torch.float16))
    out["other_dtype"] = norm16.forward_with_allreduce_fusion(x, res.clone())
    x, res = inputs(small_integer_inputs, tokens=3000)
    out["over_max"] = norm.forward_with_allreduce_fusion(x, res.clone())
    out["over_max_engine"] = engine_unfused(small_integer_inputs, tokens=3000)
    return out


if __name__ == "__main__":
    from tpfuse.spawn import run_ranks

    results = run_ranks(rank_main, 2, args=(sys.argv[2],), timeout_s=500, env={"TPFUSE_ENGINES": "sglang"})
    with open(sys.argv[1], "wb") as f:
        pickle.dump(results, f)
