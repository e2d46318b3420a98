"""Child program of test_sglang.py: sglang 0.5.23's real code on 2 gloo ranks, with tpfuse's plugin.

    python sglang_ranks.py OUT.pkl SCENARIO      (PYTHONPATH from engine_env.child_env)

In the scheduler's order: sglang's own `load_plugins()` (entry-point discovery, hook application)
runs first, then the parallel state and the published server config, then the decode CUDA-graph
runner's warm-up hook (`_pre_initialize_flashinfer_allreduce_workspace`, on a runner of sglang's
own class holding the captured batch sizes), then sglang's layer-boundary functions
(`fused_ffn_input`, `fused_attn_input`) eager and under `torch.compile(fullgraph=True)`.

SCENARIO: "start" (a normal start; then calls tpfuse cannot serve, the cutedsl stand-down, and a
peer that never arrives), "one_rank_fails" (the Communicator fails on rank 1 only). The per-rank
results are pickled to OUT.pkl; the test compares them with the references.
"""

from __future__ import annotations

import pickle
import sys
import time

H = 256
TOKENS = 5
CAPTURE_BS = (1, 2, 4, 8)


def _inputs(rank, make, tokens=TOKENS, hidden=H, dtype=None):
    import torch

    dtype = dtype or torch.bfloat16
    return make(rank, tokens, hidden, dtype), make(100, tokens, hidden, dtype)


def _engine_unfused(norm, make, world_size, tokens=TOKENS, hidden=H, dtype=None, residual_dtype=None):
    """sglang's own path on these inputs: the sum over ranks (one rounding, as gloo's 2-rank sum),
    then sglang's native add + RMSNorm, computed here without communicating."""
    import torch

    dtype = dtype or torch.bfloat16
    xs = [make(r, tokens, hidden, dtype) for r in range(world_size)]
    total = sum(x.float() for x in xs).to(dtype)
    residual = make(100, tokens, hidden, residual_dtype or dtype)
    return norm.forward_native(total, residual.clone())


def rank_main(rank: int, world_size: int, scenario: str) -> dict:
    import logging

    import torch
    from engine_env import install_torchvision_shim

    out: dict = {"log": []}
    handler = logging.Handler()
    handler.emit = lambda record: out["log"].append(record.getMessage())
    logging.getLogger("tpfuse.integrations").addHandler(handler)
    logging.getLogger("tpfuse.integrations").setLevel(logging.INFO)

    install_torchvision_shim()
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    import tpfuse.integrations.sglang as plugin

    load_plugins()  # the scheduler's first step, before any server config exists
    load_plugins()  # sglang guards it; the plugin itself is idempotent as well
    plugin.plugin()
    out["hooks"] = {t: len(HookRegistry._hooks.get(t, [])) for t in plugin.TARGETS}
    out["patched"] = sorted(t for t in plugin.TARGETS if t in HookRegistry._patched)

    if scenario == "one_rank_fails" and rank == 1:
        import tpfuse.api

        def broken(self, *args, **kwargs):  # fails before its first collective, on this rank alone
            raise RuntimeError("Communicator: device='cuda' but torch sees no CUDA GPU (injected on rank 1)")

        tpfuse.api.Communicator.__init__ = broken

    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    # run_ranks already initialised torch.distributed; sglang adopts the existing world group.
    init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=world_size, device="cpu"), role="test",
            ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")

    import sglang.srt.layers.flashinfer_comm_fusion as fc
    from sglang.srt.distributed import tensor_model_parallel_all_reduce
    from sglang.srt.layers.layer_boundary.fusions import allreduce as fusions
    from sglang.srt.layers.layer_boundary.output import UnreducedOutput
    from sglang.srt.layers.layer_boundary.residual import add_norm
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.moe.utils import post_experts_reduction_group
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    import tpfuse.integrations.runtime as runtime
    from tpfuse.reference import random_inputs, small_integer_inputs

    gate = add_norm.flashinfer_ar_fusion_applies
    out["gate_rebound"] = fusions.flashinfer_ar_fusion_applies is gate
    out["gate_before_prepare"] = gate(TOKENS)

    # The decode runner's warm-up hook, on sglang's own classes; the runner's __init__ (which
    # captures) needs a GPU, so the fields its warm-up reads are set as __init__ sets them.
    def runner_for(hidden):
        model_runner = object.__new__(ModelRunner)
        model_runner.model_config = type("ModelConfig", (), {"hidden_size": hidden})()
        model_runner.dtype = torch.bfloat16
        runner = object.__new__(DecodeCudaGraphRunner)
        runner.model_runner, runner.capture_bs, runner.captured_req_width = model_runner, list(CAPTURE_BS), 1
        return runner

    started = time.perf_counter()
    DecodeCudaGraphRunner._pre_initialize_flashinfer_allreduce_workspace(runner_for(H))
    out["warmup_s"] = time.perf_counter() - started
    DecodeCudaGraphRunner._pre_initialize_flashinfer_allreduce_workspace(runner_for(H))  # covered: free
    out["prepared"] = {f"{n} {h} {str(d).removeprefix('torch.')}": t
                       for n, st in runtime._STATES.items() for (h, d), t in st.prepared.items()}
    out["down"] = {n: st.down for n, st in runtime._STATES.items()}
    out["gate"] = {bs: gate(bs) for bs in (0, 1, TOKENS, 2048, 2049)}

    norm = RMSNorm(H, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_((1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(7))).to(torch.bfloat16))
    out["weight"] = norm.weight.detach().clone()
    plan = type("Plan", (), {"norm": norm, "fusions": None})()

    def ffn(x, residual):
        return fusions.fused_ffn_input(plan, x, residual, None)

    def attn_owed(owed, residual):  # the MoE output's deferred sum, completed with the next layer's norm
        return fusions.fused_attn_input(plan, owed, residual, None, None, fuses_quant=False, keep_bf16=False)

    def attn(x, residual):
        return attn_owed(UnreducedOutput(partial=x, group=post_experts_reduction_group()), residual)

    calls = []
    original_impl = runtime.unservable
    runtime.unservable = lambda name, *a: calls.append(name) or original_impl(name, *a)

    with torch.no_grad():
        for name, make in (("random", random_inputs), ("exact", small_integer_inputs)):
            x, residual = _inputs(rank, make)
            out[("ffn", name)] = ffn(x, residual.clone())
            out[("attn", name)] = attn(x, residual.clone())
            out[("unfused", name)] = _engine_unfused(norm, make, world_size)
        out["calls"] = list(calls)
        if out["gate"][TOKENS]:
            torch._dynamo.reset()
            x, residual = _inputs(rank, random_inputs)
            owed = UnreducedOutput(partial=x, group=post_experts_reduction_group())
            for fn_name, fn, arg in (("ffn", ffn, x), ("attn", attn_owed, owed)):
                compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=False)
                out[("compiled", fn_name)] = compiled(arg, residual.clone())
        if scenario == "one_rank_fails":
            # What sglang's layer boundary runs when the fused kernels decline: its allreduce + norm.
            x, residual = _inputs(rank, small_integer_inputs)
            out["boundary_unfused"] = norm.forward(tensor_model_parallel_all_reduce(x.clone()), residual.clone(), None)
            return out

        # Calls tpfuse was not prepared for: declined, so sglang's caller runs its own path.
        def declined(tokens=TOKENS, hidden=H, dtype=torch.bfloat16, residual_dtype=None):
            local = RMSNorm(hidden, eps=1e-6).to(dtype)
            with torch.no_grad():
                local.weight.copy_(norm.weight[:1].expand(hidden).to(dtype) if hidden != H else norm.weight.to(dtype))
            x = small_integer_inputs(rank, tokens, hidden, dtype)
            residual = small_integer_inputs(100, tokens, hidden, residual_dtype or dtype)
            got = local.forward_with_allreduce_fusion(x, residual.clone())
            want = _engine_unfused(local, small_integer_inputs, world_size, tokens, hidden, dtype, residual_dtype)
            return got, want

        before = len(calls)
        out["declined"] = {"float16": declined(dtype=torch.float16), "hidden 128": declined(hidden=128),
                           "2049 tokens": declined(tokens=2049),
                           "residual float32": declined(residual_dtype=torch.float32)}
        out["declined_calls"] = len(calls) - before

        # The gate's cost per call after the first (reported, not asserted here).
        gate(TOKENS)
        n = 20000
        t0 = time.perf_counter()
        for _ in range(n):
            gate(TOKENS)
        out["gate_us"] = (time.perf_counter() - t0) / n * 1e6

        # Standing down by configuration (read again after the cleanup): cutedsl owns its path.
        from sglang.srt.runtime_context import get_context

        fc.cleanup_flashinfer_workspace()
        out["after_cleanup"] = dict(runtime._STATES)
        get_context().override("test", flashinfer_allreduce_fusion_backend="cutedsl")
        out["down_gate"] = gate(TOKENS)
        n_calls = len(calls)
        x, residual = _inputs(rank, small_integer_inputs)
        try:
            fc.flashinfer_allreduce_residual_rmsnorm(input_tensor=x, residual=residual, weight=norm.weight.detach(),
                                                     eps=1e-6)
            out["down_op"] = "returned"
        except NotImplementedError as exc:  # sglang's own op exists for CUDA only: its error shows it ran
            out["down_op"] = str(exc).splitlines()[0]
        out["down_calls"] = len(calls) - n_calls
        get_context().override("test", flashinfer_allreduce_fusion_backend=None)

        # A peer that never arrives: fail-stop, the call raises within TPFUSE_TIMEOUT_S.
        plugin._CACHE.clear()
        DecodeCudaGraphRunner._pre_initialize_flashinfer_allreduce_workspace(runner_for(H))
        x, residual = _inputs(rank, small_integer_inputs)
        if rank == 0:
            try:
                norm.forward_with_allreduce_fusion(x, residual.clone())
                out["peer_fault"] = "returned"
            except Exception as exc:  # noqa: BLE001 - the test checks which error
                out["peer_fault"] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    from tpfuse.spawn import run_ranks

    results = run_ranks(rank_main, 2, args=(sys.argv[2],), timeout_s=300,
                        env={"TPFUSE_ENGINES": "sglang", "TPFUSE_TIMEOUT_S": "3"})
    with open(sys.argv[1], "wb") as f:
        pickle.dump(results, f)
