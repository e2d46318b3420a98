"""Child program of test_sglang.py: sglang 0.5.23's real code on 2 gloo ranks, with tpfuse's plugin.

    python sglang_ranks.py OUT.pkl      (PYTHONPATH from engine_env.child_env)

Each rank builds sglang's parallel state over gloo, publishes a server config, runs sglang's own
`load_plugins()` (entry-point discovery, hook application), prepares through the model runner's
pre-capture hook, asks the fusion gate, runs `RMSNorm.forward_with_allreduce_fusion` and the
cleanup. The per-rank results are pickled to OUT.pkl; the test compares them with the references.
"""

from __future__ import annotations

import pickle
import sys
from types import SimpleNamespace

H = 256
TOKENS = 5


def rank_main(rank: int, world_size: int) -> dict:
    import torch
    from engine_env import install_torchvision_shim

    install_torchvision_shim()
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    # run_ranks already initialised torch.distributed; sglang adopts the existing world group.
    init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=world_size, device="cpu"), role="test", ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")

    import logging

    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    import tpfuse.integrations.runtime as runtime
    import tpfuse.integrations.sglang as plugin

    out: dict = {"log": []}
    handler = logging.Handler()
    handler.emit = lambda record: out["log"].append(record.getMessage())
    logging.getLogger("tpfuse.integrations").addHandler(handler)
    logging.getLogger("tpfuse.integrations").setLevel(logging.INFO)
    load_plugins()
    load_plugins()  # sglang guards it; the plugin itself is idempotent as well
    plugin.plugin()
    out["hooks"] = {t: len(HookRegistry._hooks.get(t, [])) for t in plugin.TARGETS}
    out["patched"] = sorted(t for t in plugin.TARGETS if t in HookRegistry._patched)

    import sglang.srt.layers.flashinfer_comm_fusion as fc
    from sglang.srt.layers.layer_boundary.fusions import allreduce as fusions_allreduce
    from sglang.srt.layers.layer_boundary.residual import add_norm
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.model_executor.runner.base_runner import BaseRunner

    out["gate_before_prepare"] = add_norm.flashinfer_ar_fusion_applies(TOKENS)
    runner = SimpleNamespace(model_runner=SimpleNamespace(model_config=SimpleNamespace(hidden_size=H), dtype=torch.bfloat16))
    BaseRunner._pre_initialize_flashinfer_allreduce_workspace(runner)
    BaseRunner._pre_initialize_flashinfer_allreduce_workspace(runner)  # covered: no second plan line
    draft = SimpleNamespace(model_runner=SimpleNamespace(model_config=SimpleNamespace(hidden_size=H // 2), dtype=torch.bfloat16))
    BaseRunner._pre_initialize_flashinfer_allreduce_workspace(draft)  # another width (a draft model): prepared too
    out["prepared"] = {f"{n} {h} {str(d).removeprefix('torch.')}": t for (n, h, d), t in runtime._PREPARED.items()}
    gate = add_norm.flashinfer_ar_fusion_applies
    out["gate"] = {bs: gate(bs) for bs in (0, 1, TOKENS, 2048, 2049)}
    out["gate_rebound"] = fusions_allreduce.flashinfer_ar_fusion_applies is gate

    calls = []
    lookup = runtime.lookup
    runtime.lookup = lambda name: calls.append(name) or lookup(name)
    from tpfuse.reference import random_inputs, small_integer_inputs

    norm = RMSNorm(H, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_((1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(7))).to(torch.bfloat16))
        x = random_inputs(rank, TOKENS, H, torch.bfloat16)
        residual = random_inputs(100, TOKENS, H, torch.bfloat16)
        out["random"] = norm.forward_with_allreduce_fusion(x, residual.clone())
        out["moe_group"] = norm.forward_with_allreduce_fusion(x, residual.clone(), use_attn_tp_group=False)
        xi = small_integer_inputs(rank, TOKENS, H, torch.bfloat16)
        ri = small_integer_inputs(100, TOKENS, H, torch.bfloat16)
        out["exact"] = norm.forward_with_allreduce_fusion(xi, ri)
    out["weight"] = norm.weight.detach().clone()
    out["calls"] = list(calls)

    # Standing down: with the cutedsl backend chosen, gate and op fall through to sglang's own code
    # (sglang's own op is registered for CUDA only, so on CPU the fall-through shows as its error).
    from sglang.srt.runtime_context import get_context

    get_context().override("test", flashinfer_allreduce_fusion_backend="cutedsl")
    out["down_gate"] = gate(TOKENS)
    try:
        fc.flashinfer_allreduce_residual_rmsnorm(input_tensor=x, residual=residual, weight=norm.weight.detach(), eps=1e-6)
        out["down_op"] = "returned"
    except NotImplementedError as exc:
        out["down_op"] = str(exc).splitlines()[0]
    out["down_calls"] = len(calls) - len(out["calls"])
    get_context().override("test", flashinfer_allreduce_fusion_backend=None)
    fc.cleanup_flashinfer_workspace()
    out["after_cleanup"] = dict(runtime._COMMS)
    return out


if __name__ == "__main__":
    from tpfuse.spawn import run_ranks

    results = run_ranks(rank_main, 2, timeout_s=300, env={"TPFUSE_ENGINES": "sglang"})
    with open(sys.argv[1], "wb") as f:
        pickle.dump(results, f)
