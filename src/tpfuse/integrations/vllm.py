"""tpfuse inside vLLM 0.33: a post-grad pass that routes allreduce + (fused_add_)rms_norm to tpfuse.

Entry point `tpfuse = tpfuse.integrations.vllm:plugin` in the group `vllm.general_plugins`;
vLLM runs it in every process (each worker's init_worker included). Inert unless
TPFUSE_ENGINES names vllm (or "all"); VLLM_PLUGINS, when set, must include "tpfuse".

When on, it
- wraps `PostGradPassManager.configure`: after vLLM configured its passes, and only if vLLM's own
  AllReduceFusionPass is absent or disabled itself (its FlashInfer size table covers capabilities
  90/100/103/107; elsewhere, e.g. SM120, it switches off), it inserts `TpfuseAllReduceNormPass`
  where vLLM's pass would run (after no-op elimination). An error there is logged and vLLM
  compiles without tpfuse's pass, as vLLM's own pass does on its errors;
- wraps `VllmConfig.compute_hash`, which keys vLLM's compile caches (the AOT-compile directory
  and the Inductor artifacts), to mix in `cache_factors()`: tpfuse's version, the switches that
  change what the pass writes into the graph (TPFUSE_ENGINES, TPFUSE_STRATEGY) and the digest of
  the dispatch tables saved here. A start with tpfuse switched on or off never loads the graph
  compiled the other way; a start that calibrated (and so saved a table) compiles once more at
  the next start, which then loads from the cache;
- registers `fallback` (`vllm.all_reduce`, then vLLM's own `rms_norm` / `fused_add_rms_norm`),
  which the op runs for a group without a Communicator (never prepared, stood down) or a call
  the Communicator was not prepared for.

vLLM's fusion modules need its compiled extension; nothing here imports them.
"""

from __future__ import annotations

import hashlib

from tpfuse import env
from tpfuse._version import __version__
from tpfuse.integrations import runtime

ENGINE = "vllm"
# vLLM's own AR+RMSNorm passes (by class name: importing their modules needs vLLM's extension).
VLLM_FUSION_PASSES = ("AllReduceFusionPass", "RocmAiterAllReduceFusionPass")

_installed = False


def plugin() -> None:
    """The `vllm.general_plugins` entry point: the wrappers and the fallback, when enabled (idempotent)."""
    global _installed
    if not runtime.enabled_or_say(ENGINE, "vLLM"):
        return
    if _installed:
        return
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import VllmConfig

    original = PostGradPassManager.configure
    if not getattr(original, "_tpfuse", False):
        def configure(self, config):
            original(self, config)
            try:
                add_pass(self, config)
            except Exception as exc:  # noqa: BLE001 - vLLM compiles without tpfuse rather than not at all
                runtime.logger.warning("tpfuse: vLLM pass not added (%s: %s); vLLM's own path serves",
                                       type(exc).__name__, exc)

        configure._tpfuse = True
        configure.__wrapped__ = original
        PostGradPassManager.configure = configure
    compute_hash = VllmConfig.compute_hash
    if not getattr(compute_hash, "_tpfuse", False):
        def keyed_hash(self, *args, **kwargs):
            return mixed_hash(compute_hash(self, *args, **kwargs))

        keyed_hash._tpfuse = True
        keyed_hash.__wrapped__ = compute_hash
        VllmConfig.compute_hash = keyed_hash
    runtime.register_fallback(ENGINE, fallback)
    _installed = True
    runtime.log_once("vllm:on", "tpfuse: vLLM plugin installed (post-grad pass for allreduce + RMSNorm, "
                     "compile-cache key, fallback)")


def cache_factors() -> str:
    """What, besides vLLM's own config, decides the graphs vLLM compiles and caches with tpfuse on."""

    tables = hashlib.sha256()
    directory = env.cache_dir()
    for path in sorted(directory.glob("dispatch-*.json")) if directory.is_dir() else ():
        try:
            tables.update(path.name.encode() + b"\0" + path.read_bytes())
        except OSError:
            tables.update(path.name.encode() + b"\0unreadable")
    return (f"tpfuse {__version__}; engines {','.join(sorted(env.engines_enabled()))}; "
            f"strategy {env.strategy_override() or 'auto'}; tables {tables.hexdigest()}")


def mixed_hash(vllm_hash: str) -> str:
    """vLLM's config hash with `cache_factors()` mixed in, as long as vLLM's (hex digits)."""
    return hashlib.sha256(f"{vllm_hash}; {cache_factors()}".encode()).hexdigest()[:len(vllm_hash)]


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


def fallback(x, residual, weight, eps: float, group_name: str):
    """vLLM's own path for a call tpfuse does not serve: `vllm.all_reduce` over the group, then
    vLLM's `fused_add_rms_norm` (or `rms_norm` with no residual); None for a group vLLM has not."""
    import torch
    from vllm.distributed import parallel_state

    if parallel_state._groups.get(group_name) is None:
        return None
    # A copy on CPU: vLLM's CPU communicator reduces in place, and the op must not mutate x.
    reduced = torch.ops.vllm.all_reduce(x.clone() if x.device.type == "cpu" else x, group_name=group_name)
    if residual is None:
        return torch.ops.vllm_ir.rms_norm(reduced, weight, eps), reduced
    normed, new_residual = torch.ops.vllm_ir.fused_add_rms_norm(reduced, residual, weight, eps)
    return normed, new_residual
