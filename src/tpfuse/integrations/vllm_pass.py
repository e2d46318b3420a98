"""The vLLM post-grad pass: `vllm.all_reduce` + `rms_norm` / `fused_add_rms_norm` -> one tpfuse op.

Imports vLLM (its pass base class); imported only by `tpfuse.integrations.vllm` when enabled.

Matched (in the functionalized post-grad graph, before vLLM lowers its IR ops):
    ar = vllm.all_reduce(x, group)      ; out, res = vllm_ir.fused_add_rms_norm(ar, residual, w, eps)
    ar = vllm.all_reduce(x, group)      ; out = vllm_ir.rms_norm(ar, w, eps)   (ar may have other users)
with a weight and no `variance_size`. Not matched: Gemma norms, quantized outputs, no weight.
Replaced by `tpfuse::engine_all_reduce_residual_rmsnorm(x, residual|None, w, eps, group)`.

Rounding: vLLM's fused_add_rms_norm normalises the unrounded fp32 sum (allreduce output +
residual) and rounds to the dtype before the weight multiply; tpfuse normalises the rounded new
residual and multiplies in fp32 (tpfuse.reference). The two differ by about one ulp of the dtype.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass

from tpfuse._version import __version__
from tpfuse.integrations import runtime


def _targets():
    fused = {torch.ops.vllm_ir.fused_add_rms_norm.default}
    if hasattr(torch.ops.vllm_ir.fused_add_rms_norm, "maybe_inplace"):
        fused.add(torch.ops.vllm_ir.fused_add_rms_norm.maybe_inplace)
    return torch.ops.vllm.all_reduce.default, fused, {torch.ops.vllm_ir.rms_norm.default}


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def rewrite_allreduce_rmsnorm(graph: fx.Graph) -> int:
    """Rewrite every matched pair in `graph`; returns how many were replaced."""
    all_reduce, fused_norms, plain_norms = _targets()
    op = torch.ops.tpfuse.engine_all_reduce_residual_rmsnorm.default
    order = {node: i for i, node in enumerate(graph.nodes)}
    count = 0
    for ar in list(graph.nodes):
        if ar.op != "call_function" or ar.target != all_reduce:
            continue
        norms = [u for u in ar.users
                 if u.op == "call_function" and u.target in fused_norms | plain_norms and u.args[0] is ar]
        if len(norms) != 1:
            continue
        norm = norms[0]
        fused = norm.target in fused_norms
        residual = _arg(norm, 1, "x_residual") if fused else None
        weight = _arg(norm, 2 if fused else 1, "weight")
        eps = _arg(norm, 3 if fused else 2, "epsilon")
        variance_size = _arg(norm, 4 if fused else 3, "variance_size")
        others = [u for u in ar.users if u is not norm]
        if weight is None or variance_size is not None or (fused and others):
            continue  # a fused residual would hide the allreduce output other users need
        if any(order[u] < order[norm] for u in others):
            continue  # the fused op sits where the norm was; earlier users could not see its output
        if fused and any(u.target is not operator.getitem for u in norm.users):
            continue
        x, group_name = ar.args[0], _arg(ar, 1, "group_name")
        with graph.inserting_before(norm):
            new = graph.call_function(op, (x, residual, weight, float(eps), group_name))
            normed = graph.call_function(operator.getitem, (new, 0))
            new_residual = graph.call_function(operator.getitem, (new, 1))
        if fused:
            for user in list(norm.users):
                user.replace_all_uses_with(normed if user.args[1] == 0 else new_residual)
                graph.erase_node(user)
        else:
            norm.replace_all_uses_with(normed)
        graph.erase_node(norm)
        ar.replace_all_uses_with(new_residual)
        graph.erase_node(ar)
        count += 1
    return count


class TpfuseAllReduceNormPass(VllmInductorPass):
    """Sets tpfuse up for the TP group at construction; rewrites matched pairs when called.

    Construction runs on every rank before compilation and capture (the pass manager's configure,
    also on a compile-cache hit): `runtime.prepare` for `max_num_batched_tokens` tokens of the
    model's hidden size and dtype, calibrating vLLM's CUDA-graph capture sizes when the dispatch
    table lacks them. The rewrite does not depend on how that went: a group tpfuse stood down for
    is served by the op's fallback (vLLM's own allreduce and norm), so a cached graph is right
    whatever a later start's set-up does."""

    def __init__(self, config) -> None:
        super().__init__(config)
        from vllm.distributed import parallel_state

        self.disabled = True
        self.matched_count = 0
        tp = parallel_state.get_tp_group()
        if tp.world_size <= 1:
            runtime.log_once("vllm:tp1", "tpfuse: vLLM pass off: tensor parallel size 1 has no allreduce")
            return
        model = config.model_config
        if model is not None:
            max_tokens = config.scheduler_config.max_num_batched_tokens
            sizes = getattr(config.compilation_config, "cudagraph_capture_sizes", None) or ()
            buckets = tuple(sorted({int(s) for s in sizes if 0 < s <= max_tokens}))
            runtime.prepare("vllm", runtime.EngineGroup.of(tp), hidden=model.get_hidden_size(), dtype=model.dtype,
                            max_tokens=max_tokens, buckets=buckets)
        else:
            runtime.log_once("vllm:nomodel", "tpfuse: vLLM config has no model; the op's fallback (vLLM's own "
                             "allreduce and norm) serves until a pass with a model prepares the group")
        self.disabled = False

    def uuid(self) -> str:

        return self.hash_source(self, rewrite_allreduce_rmsnorm, __version__)

    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        self.matched_count = rewrite_allreduce_rmsnorm(graph)
