"""The tensor-parallel decoder: embedding, L layers, final norm, vocab-parallel LM head.

Each layer calls the Communicator's allreduce + residual + RMSNorm exactly twice:

    normed_attn, residual = comm.all_reduce_residual_rmsnorm(attn_partial, residual, post_attn_norm)
    normed_next, residual = comm.all_reduce_residual_rmsnorm(ffn_partial,  residual, next_norm)

where `next_norm` is the next layer's input norm (the final norm after the last layer). The first
layer's input norm has nothing to reduce (the embedding is replicated) and is a local RMSNorm.
With `fusion=False` each of those calls is `comm.all_reduce` followed by the separate add and
RMSNorm of `tpfuse.reference.residual_rmsnorm_ref`: the same rounding points, unfused.

`CountingCommunicator` wraps the Communicator (no patching) and counts calls; a decode step must
count 2 x num_layers. Counting happens in Python, so for a CUDA graph it counts at capture.

Shape legend: B sequences, P prompt length, T tokens (B*P or B), H hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.profiler import record_function

from tpfuse.models.attention import Attention, KVCache, rotary_tables
from tpfuse.models.config import ModelConfig
from tpfuse.models.layers import Embedding, ParallelLMHead, rms_norm_weight
from tpfuse.models.moe import DenseMLP, MoE, RunnerSelector
from tpfuse.models.moe_runners import RunnerProblem
from tpfuse.reference import residual_rmsnorm_ref
from tpfuse.spec import dtype_name


class CountingCommunicator:
    """Forwards to a Communicator and counts `all_reduce` and `all_reduce_residual_rmsnorm` calls."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.counts = {"all_reduce": 0, "all_reduce_residual_rmsnorm": 0}

    def all_reduce(self, x):
        self.counts["all_reduce"] += 1
        return self.comm.all_reduce(x)

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps=1e-6):
        self.counts["all_reduce_residual_rmsnorm"] += 1
        return self.comm.all_reduce_residual_rmsnorm(x, residual, weight, eps)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        for key in self.counts:
            self.counts[key] = 0

    def prepare(self, **kwargs) -> None:
        self.comm.prepare(**kwargs)

    def close(self) -> None:
        self.comm.close()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, selector: RunnerSelector, rank: int, world_size: int,
                 seed: int, dtype, device) -> None:
        super().__init__()
        common = dict(rank=rank, world_size=world_size, seed=seed, dtype=dtype, device=device)
        self.attn = Attention(cfg, layer, **common)
        if cfg.is_moe_layer(layer):
            self.ffn = MoE(cfg, layer, selector=selector, **common)
        else:
            self.ffn = DenseMLP(cfg.hidden, cfg.dense_inter, prefix="mlp", layer=layer, **common)
        self.input_norm = nn.Parameter(rms_norm_weight(cfg.hidden, seed=seed, layer=layer, name="input_norm",
                                                       dtype=dtype, device=device), requires_grad=False)
        self.post_attn_norm = nn.Parameter(rms_norm_weight(cfg.hidden, seed=seed, layer=layer, name="post_attn_norm",
                                                           dtype=dtype, device=device), requires_grad=False)


class TPDecoder(nn.Module):
    """A GLM-5-shaped decoder on one rank of a tensor-parallel group. Inference only.

    `comm` is a tpfuse.Communicator (wrapped here in a CountingCommunicator); `group` the same
    process group (used for the LM-head gather and the runner choice). `moe_runner` forces one
    runner (it must be admitted); `capture=True` admits only CUDA-graph capturable runners.
    """

    def __init__(self, cfg: ModelConfig, comm, *, group=None, rank: int = 0, world_size: int = 1, seed: int = 0,
                 dtype=torch.bfloat16, device="cpu", fusion: bool = True, capture: bool = False,
                 moe_runner: str | None = None, caps=None) -> None:
        super().__init__()
        cfg.check_world_size(world_size)
        self.cfg, self.fusion, self.dtype = cfg, fusion, dtype
        self.device = torch.device(device)
        self.comm = comm if isinstance(comm, CountingCommunicator) else CountingCommunicator(comm)
        self.selector = RunnerSelector(
            RunnerProblem(self.device.type, dtype_name(dtype), cfg.hidden, cfg.expert_inter,
                          max(cfg.num_experts // world_size, 1), capture),
            group=group, caps=caps, device=self.device, only=moe_runner,
        ) if cfg.num_moe_layers else None
        common = dict(rank=rank, world_size=world_size, seed=seed, dtype=dtype, device=self.device)
        self.embed = Embedding(cfg.vocab, cfg.hidden, seed=seed, dtype=dtype, device=self.device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, selector=self.selector, **common)
                                    for i in range(cfg.num_layers))
        self.final_norm = nn.Parameter(rms_norm_weight(cfg.hidden, seed=seed, layer=-1, name="final_norm",
                                                       dtype=dtype, device=self.device), requires_grad=False)
        self.lm_head = ParallelLMHead(cfg.hidden, cfg.vocab, group=group, **common)
        self._rotary: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- setup ----------------------------------------------------------------------------------

    def new_cache(self, batch: int, context: int) -> KVCache:
        return KVCache(self.cfg, batch=batch, context=context, world_size=self.lm_head.world_size,
                       dtype=self.dtype, device=self.device)

    def prepare(self, max_tokens: int, *, token_counts: tuple[int, ...] = ()) -> dict:
        """Set up the Communicator for up to `max_tokens` and choose MoE runners for `token_counts`.

        Collective (every rank calls it with the same arguments); call before CUDA-graph capture.
        Returns {token count: RunnerChoice}."""
        self.comm.prepare(hidden=self.cfg.hidden, dtype=self.dtype, max_tokens=max_tokens)
        if self.selector is None:
            return {}
        block = next(layer.ffn for layer in self.layers if isinstance(layer.ffn, MoE))
        return {t: self.selector.prepare(t, block) for t in token_counts}

    # ---- forward --------------------------------------------------------------------------------

    def _reduce_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
        if self.fusion:
            with record_function("tpfuse::allreduce_norm"):
                return self.comm.all_reduce_residual_rmsnorm(partial, residual, weight, self.cfg.eps)
        with record_function("tpfuse::allreduce"):
            reduced = self.comm.all_reduce(partial)
        with record_function("tpfuse::norm"):
            return residual_rmsnorm_ref(reduced, residual, weight, self.cfg.eps)

    def _rotary_for(self, context: int):
        if context not in self._rotary:
            self._rotary[context] = rotary_tables(self.cfg, context, dtype=self.dtype, device=self.device)
        return self._rotary[context]

    def _layers(self, hidden_TH: torch.Tensor, attend) -> torch.Tensor:
        with record_function("tpfuse::norm"):
            normed, _ = residual_rmsnorm_ref(hidden_TH, None, self.layers[0].input_norm, self.cfg.eps)
        residual = hidden_TH
        for i, layer in enumerate(self.layers):
            with record_function("tpfuse::attention"):
                attn_partial = attend(layer.attn, normed)
            normed, residual = self._reduce_norm(attn_partial, residual, layer.post_attn_norm)
            with record_function("tpfuse::moe" if isinstance(layer.ffn, MoE) else "tpfuse::mlp"):
                ffn_partial = layer.ffn(normed)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            normed, residual = self._reduce_norm(ffn_partial, residual, next_norm)
        return normed

    @torch.inference_mode()
    def prefill(self, ids_BP: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run the prompts (B, P) from position 0, fill the cache; logits (B, V) of each last token."""
        batch, prompt = ids_BP.shape
        if batch != cache.batch or prompt > cache.context:
            raise ValueError(f"prefill: prompts {tuple(ids_BP.shape)} do not fit a cache of batch {cache.batch}, "
                             f"context {cache.context}")
        rotary = self._rotary_for(cache.context)
        with record_function("tpfuse::embed"):
            hidden = self.embed(ids_BP.reshape(-1))
        normed = self._layers(hidden, lambda attn, x: attn.prefill(x, cache, rotary))
        last = normed.view(batch, prompt, -1)[:, -1]
        with record_function("tpfuse::lm_head"):
            return self.lm_head(last)

    @torch.inference_mode()
    def decode(self, ids_B: torch.Tensor, cache: KVCache, pos: torch.Tensor) -> torch.Tensor:
        """One token per sequence at position `pos` (1-element long tensor on the model's device); logits (B, V)."""
        rotary = self._rotary_for(cache.context)
        with record_function("tpfuse::embed"):
            hidden = self.embed(ids_B)
        normed = self._layers(hidden, lambda attn, x: attn.decode(x, cache, rotary, pos))
        with record_function("tpfuse::lm_head"):
            return self.lm_head(normed)
