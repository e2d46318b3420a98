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

from tpfuse.integrations import runtime

ENGINE = "sglang"
_FC = "sglang.srt.layers.flashinfer_comm_fusion"
GATE = "sglang.srt.layers.layer_boundary.residual.add_norm.flashinfer_ar_fusion_applies"
OP = f"{_FC}.flashinfer_allreduce_residual_rmsnorm"
PREINIT = f"{_FC}.pre_initialize_workspaces"
CLEANUP = f"{_FC}.cleanup_flashinfer_workspace"
RUNNER_PREINIT = "sglang.srt.model_executor.runner.base_runner.BaseRunner._pre_initialize_flashinfer_allreduce_workspace"
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

    for target, hook in ((GATE, _gate), (OP, _op), (PREINIT, _preinit), (CLEANUP, _cleanup), (RUNNER_PREINIT, _runner_preinit)):
        HookRegistry.register(target, hook, HookType.AROUND)
    _registered = True
    runtime.log_once("sglang:on", "tpfuse: sglang hooks registered (fusion gate, fused op, workspace preparation, cleanup)")


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
    if world_size <= 1:
        return None
    device = "cuda" if str(getattr(coordinator, "device", "cpu")).startswith("cuda") else "cpu"
    return runtime.EngineGroup(coordinator.unique_name, coordinator.device_group, coordinator.cpu_group, device)


def _groups() -> list[runtime.EngineGroup]:
    groups = {}
    for attn in (True, False):
        group = fusion_group(attn)
        if group is not None:
            groups.setdefault(group.name, group)
    return list(groups.values())


def _active() -> bool:
    why = stand_down_reason()
    if why:
        runtime.log_once(f"sglang:down:{why}", f"tpfuse: stands down in sglang: {why}")
    return not why


def _gate(original, batch_size):
    if not _active():
        return original(batch_size)
    limit = runtime.prepared_tokens([g.name for g in _groups()])
    if limit == 0:
        runtime.log_once("sglang:unprepared", "tpfuse: sglang fusion off: the model runner's warm-up did not prepare tpfuse "
                         "(it runs on CUDA devices before graph capture)")
        return False
    # Size checks last: under Dynamo they guard on the symbolic token dimension (as sglang's gate).
    return batch_size > 0 and batch_size <= limit


def _op(original, input_tensor, residual, weight, eps=1e-6, max_token_num=2048, use_oneshot=None,
        trigger_completion_at_end=False, fp32_acc=True, use_attn_tp_group=True):
    if not _active():
        return original(input_tensor, residual, weight, eps, max_token_num, use_oneshot,
                        trigger_completion_at_end, fp32_acc, use_attn_tp_group)
    import torch

    group = fusion_group(use_attn_tp_group)
    if group is None:
        return None, None  # one rank: sglang's own answer, its caller then normalises locally
    if not torch.compiler.is_compiling():
        runtime.communicator(group)  # normally prepared in the warm-up; eager first use creates it
    return torch.ops.tpfuse.engine_all_reduce_residual_rmsnorm(input_tensor, residual, weight, float(eps), group.name)


def prepare_workspaces(max_token_num: int, hidden_dim: int, dtype) -> None:
    """Collective over each fusion group: create and prepare its Communicator."""
    for group in _groups():
        runtime.prepare(ENGINE, group, hidden=hidden_dim, dtype=dtype, max_tokens=max_token_num)


def _preinit(original, max_token_num, hidden_dim, dtype, use_oneshot=None):
    if not _active():
        return original(max_token_num, hidden_dim, dtype, use_oneshot)
    prepare_workspaces(max_token_num, hidden_dim, dtype)


def _runner_preinit(original, runner):
    if not _active():
        return original(runner)
    from sglang.srt.layers.layer_boundary.residual.add_norm import FUSE_ALLREDUCE_MAX_BATCH_SIZE

    mr = runner.model_runner
    prepare_workspaces(FUSE_ALLREDUCE_MAX_BATCH_SIZE, mr.model_config.hidden_size, mr.dtype)


def _cleanup(original):
    runtime.close_all()
    return original()
