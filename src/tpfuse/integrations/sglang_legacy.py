"""tpfuse inside sglang 0.5.10, which has no plugin system: an import hook and a launcher.

    TPFUSE_ENGINES=sglang python -m tpfuse.integrations.sglang_legacy --model-path ... --tp 8

runs `sglang.launch_server` with the hook installed. sglang spawns its workers; a spawned child
imports the parent's main module (this one) before anything else, so the hook is re-installed in
every worker. Programs that start sglang themselves call `install()` first (in every process).

The hook patches two module attributes as their modules finish importing (or at once if they
already are):
- gate `sglang.srt.layers.communicator.apply_flashinfer_allreduce_fusion(batch_size)`: sglang's
  conditions without the SM90/SM100, FlashInfer and `--enable-flashinfer-allreduce-fusion`
  clauses: 0 < batch_size <= FUSE_ALLREDUCE_MAX_BATCH_SIZE, no DP attention, no context parallel
  attention;
- op `sglang.srt.layers.flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm`: tpfuse.
  In 0.5.10 a declining op makes the caller normalise the un-reduced tensor, so this one never
  declines: the Communicator is created and prepared for the whole gate range at the first
  (eager) call, which sglang's CUDA-graph runner makes in its warm-up before capture.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from tpfuse.integrations import runtime

ENGINE = "sglang"
GATE_MODULE, GATE = "sglang.srt.layers.communicator", "apply_flashinfer_allreduce_fusion"
OP_MODULE, OP = "sglang.srt.layers.flashinfer_comm_fusion", "flashinfer_allreduce_residual_rmsnorm"
MAX_TOKENS = 2048  # sglang 0.5.10 communicator.FUSE_ALLREDUCE_MAX_BATCH_SIZE


def gate(batch_size: int) -> bool:
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.server_args import get_global_server_args

    return (not is_dp_attention_enabled() and get_global_server_args().attn_cp_size <= 1
            and batch_size > 0 and batch_size <= MAX_TOKENS)


def _group(use_attn_tp_group: bool) -> runtime.EngineGroup | None:
    from sglang.srt.distributed import parallel_state as ps

    if use_attn_tp_group:
        from sglang.srt.layers.dp_attention import get_attention_tp_group

        coordinator = get_attention_tp_group()
    else:
        coordinator = ps.get_moe_ep_group() if ps.get_moe_expert_parallel_world_size() > 1 else ps.get_moe_tp_group()
    if coordinator.world_size <= 1:
        return None
    device = "cuda" if str(coordinator.device).startswith("cuda") else "cpu"
    return runtime.EngineGroup(coordinator.unique_name, coordinator.device_group, coordinator.cpu_group, device)


def op(input_tensor, residual, weight, eps=1e-6, max_token_num=2048, use_oneshot=None,
       trigger_completion_at_end=False, fp32_acc=False, use_attn_tp_group=True):
    import torch

    group = _group(use_attn_tp_group)
    if group is None:
        return None, None  # one rank: the caller's norm is then the whole answer
    if not torch.compiler.is_compiling() and not (input_tensor.is_cuda and torch.cuda.is_current_stream_capturing()):
        runtime.prepare(ENGINE, group, hidden=input_tensor.shape[-1], dtype=input_tensor.dtype, max_tokens=MAX_TOKENS)
    return torch.ops.tpfuse.engine_all_reduce_residual_rmsnorm(input_tensor, residual, weight, float(eps), group.name)


_PATCHES = {GATE_MODULE: (GATE, gate), OP_MODULE: (OP, op)}


def _patch(module) -> None:
    name, replacement = _PATCHES[module.__name__]
    original = getattr(module, name, None)
    if getattr(original, "_tpfuse", False):
        return
    replacement._tpfuse = True
    replacement.__wrapped__ = original
    setattr(module, name, replacement)
    runtime.log_once(f"legacy:{module.__name__}", f"tpfuse: sglang {module.__name__}.{name} routed to tpfuse")


class _Loader(importlib.abc.Loader):
    def __init__(self, inner) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of the patched modules so the patch runs right after they execute."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> bool:
    """Install the hook in this process when TPFUSE_ENGINES names sglang (idempotent); True if installed."""
    if not runtime.enabled(ENGINE):
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
        runtime.log_once("legacy:on", "tpfuse: sglang 0.5.10 import hook installed")
    for name in _PATCHES:
        if name in sys.modules:
            _patch(sys.modules[name])
    return True


def main(argv: list[str]) -> None:
    import os
    import runpy

    os.environ.setdefault("TPFUSE_ENGINES", ENGINE)
    install()
    sys.argv = ["sglang.launch_server", *argv]
    # alter_sys=False keeps this module as __main__, which spawned workers import (and install from).
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


install()  # also runs when a spawned worker imports this module as its main module

if __name__ == "__main__":
    main(sys.argv[1:])
