"""tpfuse inside sglang 0.5.10, which has no plugin system: an import hook and a launcher.

    TPFUSE_ENGINES=sglang python -m tpfuse.integrations.sglang_legacy --model-path ... --tp 8

runs `sglang.launch_server` with the hook installed. sglang spawns its workers; a spawned child
imports the parent's main module (this one) before anything else, so the hook is re-installed in
every worker. Programs that start sglang themselves call `install()` first (in every process).

The hook patches three attributes as their modules finish importing (or at once if they already
are):
- `sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner.capture`: before sglang captures
  its CUDA graphs, tpfuse is set up for the attention-TP and MoE groups (`runtime.prepare`, every
  step agreed across ranks, calibrating the runner's captured batch sizes when the dispatch table
  lacks them) for FUSE_ALLREDUCE_MAX_BATCH_SIZE tokens of the model's hidden size and dtype;
- gate `sglang.srt.layers.communicator.apply_flashinfer_allreduce_fusion(batch_size)`: sglang's
  conditions without the SM90/SM100, FlashInfer and `--enable-flashinfer-allreduce-fusion`
  clauses: 0 < batch_size <= FUSE_ALLREDUCE_MAX_BATCH_SIZE, no DP attention, no context parallel
  attention, read once and cached; sglang's own gate once tpfuse stood down for a group;
- op `sglang.srt.layers.flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm`: tpfuse.
  In 0.5.10 a declining op makes the caller normalise the un-reduced tensor, so this one never
  declines: a call tpfuse cannot serve (a group never prepared or stood down, another dtype,
  shape or size) runs sglang's own path inside the op (`fallback`: the group's allreduce, found
  by name in sglang's parallel state, then sglang's native RMSNorm). Without CUDA graphs the first
  eager call prepares (every rank makes it); a compiled first call takes the fallback.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from tpfuse.integrations import runtime

ENGINE = "sglang"
GATE_MODULE, GATE = "sglang.srt.layers.communicator", "apply_flashinfer_allreduce_fusion"
OP_MODULE, OP = "sglang.srt.layers.flashinfer_comm_fusion", "flashinfer_allreduce_residual_rmsnorm"
CAPTURE_MODULE, CAPTURE = "sglang.srt.model_executor.cuda_graph_runner", "CudaGraphRunner.capture"
MAX_TOKENS = 2048  # sglang 0.5.10 communicator.FUSE_ALLREDUCE_MAX_BATCH_SIZE

# The gate's static inputs, read once: "config" (sglang's own clauses tpfuse keeps), "down" (a
# group tpfuse stood down for). Cleared when tpfuse is set up.
_CACHE: dict = {}
_NORMS: dict = {}  # (hidden, eps) -> sglang RMSNorm the fallback normalises with


def _config_allows() -> bool:
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.server_args import get_global_server_args

    return not is_dp_attention_enabled() and get_global_server_args().attn_cp_size <= 1


def gate(batch_size: int) -> bool:
    allows = _CACHE.get("config")
    if allows is None:
        allows = _CACHE["config"] = _config_allows()
    down = _CACHE.get("down")
    if down is None:
        down = _CACHE["down"] = any(runtime.down_reason(g.name) for g in _groups())
    if down:
        return gate.__wrapped__(batch_size)
    return allows and batch_size > 0 and batch_size <= MAX_TOKENS


def _coordinator(use_attn_tp_group: bool):
    from sglang.srt.distributed import parallel_state as ps

    if use_attn_tp_group:
        from sglang.srt.layers.dp_attention import get_attention_tp_group

        return get_attention_tp_group()
    return ps.get_moe_ep_group() if ps.get_moe_expert_parallel_world_size() > 1 else ps.get_moe_tp_group()


def _group(use_attn_tp_group: bool) -> runtime.EngineGroup | None:
    coordinator = _coordinator(use_attn_tp_group)
    return runtime.EngineGroup.of(coordinator) if coordinator.world_size > 1 else None


def _groups() -> list[runtime.EngineGroup]:
    groups = {}
    for attn in (True, False):
        group = _group(attn)
        if group is not None:
            groups.setdefault(group.name, group)
    return list(groups.values())


def prepare(hidden: int, dtype, buckets: tuple[int, ...] = ()) -> None:
    """Collective over the fusion groups: set tpfuse up for them (before capture)."""
    for group in _groups():
        runtime.prepare(ENGINE, group, hidden=hidden, dtype=dtype, max_tokens=MAX_TOKENS, buckets=buckets)
    _CACHE.clear()


def capture(self) -> None:
    mr = self.model_runner
    width = getattr(self, "num_tokens_per_bs", 1) or 1
    prepare(mr.model_config.hidden_size, mr.dtype, tuple(sorted({int(bs) * width for bs in self.capture_bs})))
    return capture.__wrapped__(self)


def op(input_tensor, residual, weight, eps=1e-6, max_token_num=2048, use_oneshot=None,
       trigger_completion_at_end=False, fp32_acc=False, use_attn_tp_group=True):
    import torch

    group = _group(use_attn_tp_group)
    if group is None:
        return None, None  # one rank: the caller's norm is then the whole answer
    st = runtime.state(group.name)
    capturing = input_tensor.is_cuda and torch.cuda.is_current_stream_capturing()
    eager = not torch.compiler.is_compiling() and not capturing
    if eager and (st is None or (not st.down and (input_tensor.shape[-1], input_tensor.dtype) not in st.prepared)):
        runtime.prepare(ENGINE, group, hidden=input_tensor.shape[-1], dtype=input_tensor.dtype, max_tokens=MAX_TOKENS)
        _CACHE.clear()
    return torch.ops.tpfuse.engine_all_reduce_residual_rmsnorm(input_tensor, residual, weight, float(eps), group.name)


def fallback(x, residual, weight, eps: float, group_name: str):
    """sglang's own path for a call tpfuse does not serve: the group's allreduce, then sglang's
    native add + RMSNorm; None when sglang has no group of that name."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.layernorm import RMSNorm

    ref = ps._groups.get(group_name)
    coordinator = ref() if ref is not None else None
    if coordinator is None:
        return None
    reduced = coordinator.all_reduce(x.clone())  # a copy: on CPU sglang's all_reduce reduces in place
    norm = _NORMS.get((x.shape[-1], eps))
    if norm is None:
        norm = _NORMS[(x.shape[-1], eps)] = RMSNorm(x.shape[-1], eps=eps)
    norm.weight.data = weight
    if residual is None:
        return norm.forward_native(reduced), reduced
    return norm.forward_native(reduced, residual)


_PATCHES = {GATE_MODULE: (GATE, gate), OP_MODULE: (OP, op), CAPTURE_MODULE: (CAPTURE, capture)}


def _patch(module) -> None:
    path, replacement = _PATCHES[module.__name__]
    *owner_path, name = path.split(".")
    owner = module
    for part in owner_path:
        owner = getattr(owner, part)
    original = getattr(owner, name, None)
    if getattr(original, "_tpfuse", False):
        return
    replacement._tpfuse = True
    replacement.__wrapped__ = original
    setattr(owner, name, replacement)
    runtime.log_once(f"legacy:{module.__name__}", f"tpfuse: sglang {module.__name__}.{path} routed to tpfuse")


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
    runtime.register_fallback(ENGINE, fallback)
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
