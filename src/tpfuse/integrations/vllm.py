"""tpfuse inside vLLM 0.33: a post-grad pass that routes allreduce + (fused_add_)rms_norm to tpfuse.

Entry point `tpfuse = tpfuse.integrations.vllm:plugin` in the group `vllm.general_plugins`;
vLLM runs it in every process (each worker's init_worker included). Inert unless
TPFUSE_ENGINES names vllm (or "all"); VLLM_PLUGINS, when set, must include "tpfuse".

When on, it wraps `PostGradPassManager.configure`: after vLLM configured its passes, and only if
vLLM's own AllReduceFusionPass is absent or disabled itself (its FlashInfer size table covers
capabilities 90/100/103/107; elsewhere, e.g. SM120, it switches off), it inserts
`TpfuseAllReduceNormPass` where vLLM's pass would run (after no-op elimination). The pass
manager's uuid covers every pass, so the compile cache stays right. vLLM's fusion modules need
its compiled extension; nothing here imports them.

The pass (tpfuse.integrations.vllm_pass) creates and prepares the TP group's Communicator at
construction (configure runs on every rank before compilation and capture) and rewrites
`vllm.all_reduce(x, group)` followed by `rms_norm` / `fused_add_rms_norm` into
`tpfuse::engine_all_reduce_residual_rmsnorm(..., group_name)`.
"""

from __future__ import annotations

from tpfuse.integrations import runtime

ENGINE = "vllm"
# vLLM's own AR+RMSNorm passes (by class name: importing their modules needs vLLM's extension).
VLLM_FUSION_PASSES = ("AllReduceFusionPass", "RocmAiterAllReduceFusionPass")

_installed = False


def plugin() -> None:
    """The `vllm.general_plugins` entry point: wrap the pass manager's configure when enabled (idempotent)."""
    global _installed
    if not runtime.enabled_or_say(ENGINE, "vLLM"):
        return
    if _installed:
        return
    from vllm.compilation.passes.pass_manager import PostGradPassManager

    original = PostGradPassManager.configure
    if not getattr(original, "_tpfuse", False):
        def configure(self, config):
            original(self, config)
            add_pass(self, config)

        configure._tpfuse = True
        configure.__wrapped__ = original
        PostGradPassManager.configure = configure
    runtime.register_resolver(ENGINE, resolve_group)
    _installed = True
    runtime.log_once("vllm:on", "tpfuse: vLLM plugin installed (post-grad pass for allreduce + RMSNorm)")


def own_fusion_active(passes) -> bool:
    """True when one of vLLM's own AR+RMSNorm passes is configured and enabled."""
    return any(type(p).__name__ in VLLM_FUSION_PASSES and not getattr(p, "disabled", False) for p in passes)


def add_pass(manager, config) -> None:
    """Insert tpfuse's pass into a configured PostGradPassManager, unless vLLM fuses itself."""
    if any(type(p).__name__ == "TpfuseAllReduceNormPass" for p in manager.passes):
        return
    if own_fusion_active(manager.passes):
        runtime.log_once("vllm:own", "tpfuse: stands down in vLLM: its own AllReduceFusionPass is enabled here")
        return
    from tpfuse.integrations.vllm_pass import TpfuseAllReduceNormPass

    tpfuse_pass = TpfuseAllReduceNormPass(config)
    if tpfuse_pass.disabled:
        return
    after = [i + 1 for i, p in enumerate(manager.passes) if type(p).__name__ == "NoOpEliminationPass"]
    manager.passes.insert(after[0] if after else 0, tpfuse_pass)


def engine_group(coordinator) -> runtime.EngineGroup:
    device = "cuda" if str(getattr(coordinator, "device", "cpu")).startswith("cuda") else "cpu"
    return runtime.EngineGroup(coordinator.unique_name, coordinator.device_group, coordinator.cpu_group, device)


def resolve_group(group_name: str) -> runtime.EngineGroup | None:
    """vLLM's group of that unique name (parallel_state keeps weak references by name)."""
    from vllm.distributed import parallel_state

    ref = parallel_state._groups.get(group_name)
    coordinator = ref() if ref is not None else None
    return engine_group(coordinator) if coordinator is not None else None
