"""Child program of test_vllm.py: vLLM 0.33's real code on 2 gloo ranks, with tpfuse's plugin.

    python vllm_ranks.py OUT.pkl      (PYTHONPATH from engine_env.child_env)

Each rank builds vLLM's parallel state over gloo, runs vLLM's `load_general_plugins()` (entry-point
discovery), configures vLLM's PostGradPassManager (the plugin inserts tpfuse's pass), traces
graphs with `vllm.all_reduce` then `vllm_ir.fused_add_rms_norm` / `rms_norm`, runs them before and
after the pass, and pickles the results to OUT.pkl for the test to compare.
"""

from __future__ import annotations

import pickle
import sys

H = 256
TOKENS = 5


def rank_main(rank: int, world_size: int) -> dict:
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from tpfuse.reference import random_inputs, small_integer_inputs

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    out: dict = {}
    with set_current_vllm_config(config):
        # run_ranks initialised torch.distributed; vLLM adopts the existing world group.
        ps.init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
        from vllm.compilation.passes.pass_manager import PostGradPassManager
        from vllm.plugins import load_general_plugins

        import tpfuse.integrations.runtime as runtime
        import tpfuse.integrations.vllm as plugin

        load_general_plugins()
        plugin.plugin()  # idempotent: configure is wrapped once
        out["configure_wrapped_once"] = PostGradPassManager.configure.__wrapped__.__name__ == "configure" and not getattr(
            PostGradPassManager.configure.__wrapped__, "_tpfuse", False)
        manager = PostGradPassManager()
        manager.configure(config)
        plugin.add_pass(manager, config)  # a second add is a no-op
        out["passes"] = [type(p).__name__ for p in manager.passes]
        from vllm.compilation.passes.inductor_pass import pass_context
        from vllm.config.utils import Range

        with pass_context(Range(start=1, end=TOKENS)):
            out["uuid"] = manager.uuid()
        tpfuse_pass = manager.passes[out["passes"].index("TpfuseAllReduceNormPass")]

        # With a model config the pass prepares the TP group's Communicator at construction (on
        # every rank, before compilation). VllmConfig() cannot hold a model without its HF config
        # files, so the pass gets the fields it reads.
        import logging
        from types import SimpleNamespace

        from tpfuse.integrations.vllm_pass import TpfuseAllReduceNormPass

        out["log"] = []
        handler = logging.Handler()
        handler.emit = lambda record: out["log"].append(record.getMessage())
        logging.getLogger("tpfuse.integrations").addHandler(handler)
        logging.getLogger("tpfuse.integrations").setLevel(logging.INFO)
        with_model = SimpleNamespace(
            compilation_config=config.compilation_config, device_config=config.device_config,
            model_config=SimpleNamespace(dtype=torch.bfloat16, get_hidden_size=lambda: H),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=64))
        TpfuseAllReduceNormPass(with_model)
        TpfuseAllReduceNormPass(with_model)  # prepared already: no second collective, no second plan line
        out["prepared"] = {f"{n} {h} {str(d).removeprefix('torch.')}": t for (n, h, d), t in runtime._PREPARED.items()}

        group = ps.get_tp_group().unique_name
        weight = (1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(7))).to(torch.bfloat16)

        def fused(x, residual, w):
            reduced = torch.ops.vllm.all_reduce(x, group_name=group)
            return torch.ops.vllm_ir.fused_add_rms_norm(reduced, residual, w, 1e-6)

        def plain(x, w):  # first layer: the allreduce output is also the residual
            reduced = torch.ops.vllm.all_reduce(x, group_name=group)
            return torch.ops.vllm_ir.rms_norm(reduced, w, 1e-6), reduced

        cases = {
            "random": (random_inputs(rank, TOKENS, H, torch.bfloat16), random_inputs(100, TOKENS, H, torch.bfloat16)),
            "exact": (small_integer_inputs(rank, TOKENS, H, torch.bfloat16), small_integer_inputs(100, TOKENS, H, torch.bfloat16)),
        }
        out["weight"] = weight
        for name, (x, residual) in cases.items():
            for kind, fn, args in (("fused", fused, (x, residual, weight)), ("plain", plain, (x, weight))):
                # vLLM's CPU all_reduce (DeviceCommunicatorBase) reduces in place: fresh inputs each call.
                gm = make_fx(fn)(*(a.clone() for a in args))
                out[(name, kind, "unfused")] = gm(*(a.clone() for a in args))
                # The manager's own loop over its passes (vLLM's and tpfuse's); its later stages
                # (fix_functionalization) need vLLM's compiled extension, absent on CPU.
                with pass_context(Range(start=1, end=TOKENS)):
                    for each in manager.passes:
                        if each.is_applicable_for_range(Range(start=1, end=TOKENS)):
                            each(gm.graph)
                gm.recompile()
                out[(name, kind, "count")] = tpfuse_pass.matched_count
                out[(name, kind, "targets")] = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
                out[(name, kind, "tpfuse")] = gm(*(a.clone() for a in args))
    return out


if __name__ == "__main__":
    from tpfuse.spawn import run_ranks

    results = run_ranks(rank_main, 2, timeout_s=300, env={"TPFUSE_ENGINES": "vllm"})
    with open(sys.argv[1], "wb") as f:
        pickle.dump(results, f)
