"""tpfuse inside sglang >= 0.5.23: hooks through sglang's plugin system, nothing patched on disk.

Entry point `tpfuse = tpfuse.integrations.sglang:plugin` in the group `sglang.srt.plugins`;
sglang runs it in every process (scheduler/TP workers included). Inert unless TPFUSE_ENGINES
names sglang (or "all"); SGLANG_PLUGINS, when set, must include "tpfuse". The hooks (AROUND, so
each falls through to sglang's own code whenever tpfuse stands down):

- gate `layer_boundary.residual.add_norm.flashinfer_ar_fusion_applies(batch_size)`: sglang's own
  conditions without the SM90/SM100 and FlashInfer-availability clauses (no DP attention, the
  cutedsl backend not chosen, fusion not force-disabled), plus "tpfuse was prepared for this
  many tokens": static configuration and shape only, so every rank decides alike;
- op `flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm`: the Communicator of the group
  `resolve_fusion_group` returns, through `torch.ops.tpfuse.engine_all_reduce_residual_rmsnorm`
  keyed by the group's unique name; it never declines (`use_oneshot` and `fp32_acc` are hints for
  FlashInfer; tpfuse's dispatch table chooses, and accumulates in fp32);
- workspaces: the model runner's `_pre_initialize_flashinfer_allreduce_workspace` (before CUDA
  graph capture) and `pre_initialize_workspaces` create and prepare the Communicators of the
  attention-TP and post-experts groups for FUSE_ALLREDUCE_MAX_BATCH_SIZE tokens, handshaking on
  each group's CPU group; `cleanup_flashinfer_workspace` closes them.
"""

from __future__ import annotations

import logging

from tpfuse.integrations import runtime

ENGINE = "sglang"
_FC = "sglang.srt.layers.flashinfer_comm_fusion"
GATE = "sglang.srt.layers.layer_boundary.residual.add_norm.flashinfer_ar_fusion_applies"
OP = f"{_FC}.flashinfer_allreduce_residual_rmsnorm"
PREINIT = f"{_FC}.pre_initialize_workspaces"
CLEANUP = f"{_FC}.cleanup_flashinfer_workspace"
RUNNER_PREINIT = ("sglang.srt.model_executor.runner.base_runner.BaseRunner."
                  "_pre_initialize_flashinfer_allreduce_workspace")
TARGETS = (GATE, OP, PREINIT, CLEANUP, RUNNER_PREINIT)

_registered = False


def plugin() -> None:
    """The `sglang.srt.plugins` entry point: register the hooks when enabled (idempotent)."""
    global _registered
    if not runtime.enabled_or_say(ENGINE, "sglang"):
        return
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = ((GATE, _gate), (OP, _op), (PREINIT, _preinit), (CLEANUP, _cleanup), (RUNNER_PREINIT, _runner_preinit))
    for target, hook in hooks:
        HookRegistry.register(target, hook, HookType.AROUND)
    _registered = True
    runtime.log_once("sglang:on", "tpfuse: sglang hooks registered (fusion gate, fused op, workspace preparation, "
                     "cleanup)")


def stand_down_reason() -> str:
    """Why tpfuse leaves the fusion to sglang here ("" when it takes it): static configuration only."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.runtime_context import get_exec

    comm = get_exec().comm
    if is_dp_attention_enabled():
        return "DP attention is enabled (sglang's fusion excludes it as well)"
    if comm.flashinfer_allreduce_fusion_backend == "cutedsl":
        return "--flashinfer-allreduce-fusion-backend cutedsl owns its own fused path"
    if getattr(comm, "enforce_disable_flashinfer_allreduce_fusion", False):
        return "--enforce-disable-flashinfer-allreduce-fusion is set"
    return ""


def fusion_group(use_attn_tp_group: bool) -> runtime.EngineGroup | None:
    """The group sglang's fused kernel reduces over (None when it has one rank)."""
    from sglang.srt.layers.flashinfer_comm_fusion import resolve_fusion_group

    world_size, _, coordinator = resolve_fusion_group(use_attn_tp_group=use_attn_tp_group)
    return runtime.EngineGroup.of(coordinator) if world_size > 1 else None


# The gate's and the op's static inputs, read once: "reason" (stand_down_reason), "names"
# ({use_attn_tp_group: group name or None}, set at the warm-up), "limit" (the gate's token bound,
# -1 when a group stood down). Cleared by the warm-up and the cleanup.
_CACHE: dict = {}


def _reason() -> str:
    why = _CACHE.get("reason")
    if why is None:
        why = _CACHE["reason"] = stand_down_reason()
        if why:
            runtime.log_once(f"sglang:down:{why}", f"tpfuse: stands down in sglang: {why}")
    return why


def _limit() -> int:
    limit = _CACHE.get("limit")
    if limit is None:
        names = [n for n in _CACHE.get("names", {}).values() if n is not None]
        if any(runtime.down_reason(n) for n in names):
            limit = -1
        else:
            limit = runtime.prepared_tokens(names) if names else 0
            if limit == 0:
                runtime.log_once("sglang:unprepared", "tpfuse: sglang fusion off: the model runner's warm-up did not "
                                 "prepare tpfuse (it runs on CUDA devices before graph capture)")
        _CACHE["limit"] = limit
    return limit


def _gate(original, batch_size):
    if _reason():
        return original(batch_size)
    limit = _limit()
    if limit < 0:
        return original(batch_size)
    # Size checks last: under Dynamo they guard on the symbolic token dimension (as sglang's gate).
    return limit > 0 and batch_size > 0 and batch_size <= limit


def _op(original, input_tensor, residual, weight, eps=1e-6, max_token_num=2048, use_oneshot=None,
        trigger_completion_at_end=False, fp32_acc=True, use_attn_tp_group=True):
    names = _CACHE.get("names", {})
    name = names.get(use_attn_tp_group)
    if _reason() or (name is not None and runtime.down_reason(name)):
        return original(input_tensor, residual, weight, eps, max_token_num, use_oneshot,
                        trigger_completion_at_end, fp32_acc, use_attn_tp_group)
    if name is None:
        return None, None  # one rank, or no warm-up: sglang's caller runs its own path
    why = runtime.unservable(name, input_tensor, residual, weight)
    if why:
        import torch

        if not torch.compiler.is_compiling():  # the eager warm-up and prefill say it; a compiled call only declines
            runtime.log_once(f"sglang:decline:{name}:{why}", f"tpfuse: sglang group {name}: calls that {why} run "
                             "sglang's own allreduce + add + norm", level=logging.WARNING)
        return None, None
    return torch_op()(input_tensor, residual, weight, float(eps), name)


def torch_op():
    import torch

    return torch.ops.tpfuse.engine_all_reduce_residual_rmsnorm


def captured_tokens(runner) -> tuple[int, ...]:
    """The token counts the runner captures CUDA graphs for (its batch sizes times tokens per request)."""
    width = getattr(runner, "captured_req_width", 1) or 1
    return tuple(sorted({int(bs) * width for bs in getattr(runner, "capture_bs", None) or ()}))


def prepare_workspaces(max_token_num: int, hidden_dim: int, dtype, buckets: tuple[int, ...] = ()) -> bool:
    """Collective over each fusion group: set tpfuse up (`runtime.prepare`); True when tpfuse serves
    every group, False when it stood down for one (sglang's own preparation should then run)."""
    _CACHE.clear()
    names: dict = {}
    groups: dict = {}
    for attn in (True, False):
        group = fusion_group(attn)
        names[attn] = group.name if group is not None else None
        if group is not None:
            groups.setdefault(group.name, group)
    _CACHE["names"] = names
    served = True
    for group in groups.values():
        served &= runtime.prepare(ENGINE, group, hidden=hidden_dim, dtype=dtype, max_tokens=max_token_num,
                                  buckets=buckets)
    _CACHE.pop("limit", None)
    return served


def _preinit(original, max_token_num, hidden_dim, dtype, use_oneshot=None):
    _CACHE.clear()
    if _reason() or not prepare_workspaces(max_token_num, hidden_dim, dtype):
        return original(max_token_num, hidden_dim, dtype, use_oneshot)


def _runner_preinit(original, runner):
    _CACHE.clear()
    if _reason():
        return original(runner)
    from sglang.srt.layers.layer_boundary.residual.add_norm import FUSE_ALLREDUCE_MAX_BATCH_SIZE

    mr = runner.model_runner
    if not prepare_workspaces(FUSE_ALLREDUCE_MAX_BATCH_SIZE, mr.model_config.hidden_size, mr.dtype,
                              captured_tokens(runner)):
        return original(runner)


def _cleanup(original):
    runtime.close_all()
    _CACHE.clear()
    return original()
