"""Child program of test_vllm.py: vLLM 0.33's real code on 2 gloo ranks, with tpfuse's plugin.

    python vllm_ranks.py OUT.pkl SCENARIO      (PYTHONPATH from engine_env.child_env)

Each rank builds vLLM's parallel state over gloo (its TP group with `use_custom_op_call=True`, as
on CUDA, so the graph holds `vllm.all_reduce`), runs vLLM's `load_general_plugins()` (entry-point
discovery), configures vLLM's PostGradPassManager (the plugin inserts tpfuse's pass; its
construction sets tpfuse up for the TP group, calibrating the capture sizes), and compiles one
layer boundary, `tensor_model_parallel_all_reduce` then vLLM's `RMSNorm` (its native forward, what
vLLM compiles), through torch.compile(fullgraph=True): Dynamo, vLLM's pre-grad IR functionalization
pass, AOTAutograd, then the manager's passes on the post-grad graph. Inductor's code generation
and vLLM's fix-functionalization stage need vLLM's compiled extension, absent on CPU: the
post-grad graph runs as is. vLLM's compile-cache key (`aot_compile_hash_factors`, which holds
`VllmConfig.compute_hash()`) is read with tpfuse off, on, after a table was saved, and with
TPFUSE_STRATEGY set.

SCENARIO: "start", or "one_rank_fails" (the Communicator fails on rank 1 only). The per-rank
results are pickled to OUT.pkl for the test to compare.
"""

from __future__ import annotations

import os
import pickle
import sys

H = 256
TOKENS = 5
MAX_TOKENS = 64
CAPTURE_SIZES = [1, 2, 4, 8]


def rank_main(rank: int, world_size: int, scenario: str) -> dict:
    import logging
    from types import SimpleNamespace

    import torch
    from torch._dynamo.backends.common import aot_autograd
    from vllm.compilation.caching import aot_compile_hash_factors
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from tpfuse.reference import random_inputs, small_integer_inputs

    out: dict = {"log": []}
    handler = logging.Handler()
    handler.emit = lambda record: out["log"].append(record.getMessage())
    logging.getLogger("tpfuse.integrations").addHandler(handler)
    logging.getLogger("tpfuse.integrations").setLevel(logging.INFO)
    if scenario == "one_rank_fails" and rank == 1:
        import tpfuse.api

        def broken(self, *args, **kwargs):  # fails before its first collective, on this rank alone
            raise RuntimeError("Communicator: device='cuda' but torch sees no CUDA GPU (injected on rank 1)")

        tpfuse.api.Communicator.__init__ = broken

    def key(vllm_config):  # the environment's and the config's factors of vLLM's AOT-compile cache key
        return aot_compile_hash_factors(vllm_config)[:2]

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    config.compilation_config.cudagraph_capture_sizes = list(CAPTURE_SIZES)
    config.scheduler_config.max_num_batched_tokens = MAX_TOKENS
    with set_current_vllm_config(config):
        # run_ranks initialised torch.distributed; vLLM adopts the existing world group.
        ps.init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
        # VllmConfig() cannot hold a model without its HF config files; the pass reads these fields.
        config.model_config = SimpleNamespace(dtype=torch.bfloat16, get_hidden_size=lambda: H, compute_hash=lambda: "m")
        out["key_off"] = key(config)  # no plugin loaded yet: a plain vLLM start
        tp = ps.get_tp_group()
        tp.use_custom_op_call = True  # the CUDA default: the graph holds torch.ops.vllm.all_reduce
        from vllm.compilation.passes.inductor_pass import pass_context
        from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass
        from vllm.compilation.passes.pass_manager import PostGradPassManager
        from vllm.config.utils import Range
        from vllm.distributed import tensor_model_parallel_all_reduce
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.plugins import load_general_plugins

        import tpfuse.integrations.runtime as runtime
        import tpfuse.integrations.vllm as plugin

        load_general_plugins()
        plugin.plugin()  # idempotent: configure and compute_hash are wrapped once
        out["key_on"] = key(config)
        out["wrapped_once"] = [not getattr(f.__wrapped__, "_tpfuse", False)
                               for f in (PostGradPassManager.configure, VllmConfig.compute_hash)]
        manager = PostGradPassManager()
        manager.configure(config)  # the pass's construction sets tpfuse up: a collective, before compiling
        plugin.add_pass(manager, config)  # a second add is a no-op
        out["passes"] = [type(p).__name__ for p in manager.passes]
        out["key_after_table"] = key(config)
        os.environ["TPFUSE_STRATEGY"] = "reference"
        out["key_strategy"] = key(config)
        del os.environ["TPFUSE_STRATEGY"]
        with pass_context(Range(start=1, end=MAX_TOKENS)):
            out["uuid"] = manager.uuid()
        tpfuse_pass = manager.passes[out["passes"].index("TpfuseAllReduceNormPass")]
        out["down"] = {n: st.down for n, st in runtime._STATES.items()}
        out["prepared"] = {f"{n} {h} {str(d).removeprefix('torch.')}": t
                           for n, st in runtime._STATES.items() for (h, d), t in st.prepared.items()}

        def layer(x, residual, norm):
            reduced = tensor_model_parallel_all_reduce(x)
            return norm.forward_native(reduced, residual) if residual is not None else (
                norm.forward_native(reduced), reduced)

        captured = {}

        def backend(gm, example_inputs):
            with pass_context(Range(start=1, end=MAX_TOKENS)):
                VllmIRInplaceFunctionalizationPass(config)(gm.graph)  # vLLM's pre-grad pass
            gm.recompile()

            def post_grad(fw, inputs):
                captured["before"] = sorted({str(n.target) for n in fw.graph.nodes if n.op == "call_function"})
                with pass_context(Range(start=1, end=MAX_TOKENS)):
                    for each in manager.passes:
                        if each.is_applicable_for_range(Range(start=1, end=MAX_TOKENS)):
                            each(fw.graph)
                fw.recompile()
                captured["count"] = tpfuse_pass.matched_count
                captured["after"] = sorted({str(n.target) for n in fw.graph.nodes if n.op == "call_function"})
                return fw

            return aot_autograd(fw_compiler=post_grad)(gm, example_inputs)

        def case(name, make, tokens, dtype, with_residual, close=False):
            norm = RMSNorm(H, eps=1e-6).to(dtype)
            with torch.no_grad():
                norm.weight.copy_((1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(7))).to(dtype))
            x = make(rank, tokens, H, dtype)
            residual = make(100, tokens, H, dtype) if with_residual else None
            clone = (lambda t: None if t is None else t.clone())
            torch._dynamo.reset()
            captured.clear()
            compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=False)
            with torch.no_grad():
                # vLLM's CPU all_reduce reduces in place: fresh inputs for every call.
                out[(name, "unfused")] = layer(x.clone(), clone(residual), norm)
                out[(name, "tpfuse")] = compiled(x.clone(), clone(residual), norm)
                out[(name, "graph")] = dict(captured)
                if close:
                    # The graph compiled with tpfuse, run where tpfuse has no Communicator (the
                    # state a cached graph meets when tpfuse's set-up stood down): the op's fallback.
                    runtime.close_all()
                    out[(name, "no communicator")] = compiled(x.clone(), clone(residual), norm)
            out["weight", dtype] = norm.weight.detach().clone()

        for name, make in (("random", random_inputs), ("exact", small_integer_inputs)):
            for kind, with_residual in (("fused", True), ("plain", False)):
                case(f"{name} {kind}", make, TOKENS, torch.bfloat16, with_residual)
        if scenario == "start":
            case("float16", small_integer_inputs, TOKENS, torch.float16, True)  # a dtype not prepared
            case("65 tokens", small_integer_inputs, MAX_TOKENS + 1, torch.bfloat16, True)  # more than prepared
        case("closed", small_integer_inputs, TOKENS, torch.bfloat16, True, close=True)  # last: closes the Communicator
    return out


if __name__ == "__main__":
    from tpfuse.spawn import run_ranks

    results = run_ranks(rank_main, 2, args=(sys.argv[2],), timeout_s=300, env={"TPFUSE_ENGINES": "vllm"})
    with open(sys.argv[1], "wb") as f:
        pickle.dump(results, f)
