"""Grouped-query attention with a KV cache, tensor-parallel by heads (MLA simplified to GQA).

Rank r owns num_heads/W query heads and num_kv_heads/W KV heads; `o_proj` is row-parallel and
returns this rank's partial sum, which the decoder reduces (allreduce + residual + RMSNorm).

Two modes, both with static shapes so a decode step can be captured in a CUDA graph:
- prefill: `x` is (B*P, H), every sequence has P prompt tokens at positions 0..P-1; causal SDPA;
  keys and values land in cache slots 0..P-1.
- decode: `x` is (B, H), one token per sequence at position `pos` (a 1-element device tensor, so
  a graph replay can advance it); keys/values are written at slot `pos` with index_copy_, and
  attention (`grouped_decode_attention`, two batched matmuls) reads the whole cache window under
  the mask `slot <= pos`. Reading the whole window keeps shapes static; the cost is attention
  over `context` slots rather than pos+1.

Shape legend: B sequences, P prompt length, S cache slots (context), h/hk local query/KV heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

from tpfuse.models.config import ModelConfig
from tpfuse.models.layers import ColumnParallelLinear, RowParallelLinear
from tpfuse.reference import accumulation_dtype


class KVCache:
    """Keys and values of every layer: two tensors (L, B, hk, S, D), allocated once per batch size."""

    def __init__(self, cfg: ModelConfig, *, batch: int, context: int, world_size: int, dtype, device) -> None:
        shape = (cfg.num_layers, batch, cfg.num_kv_heads // world_size, context, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch, self.context = batch, context

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def rotary_tables(cfg: ModelConfig, context: int, *, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape (S, D/2) for positions 0..S-1, in the accumulation dtype of `dtype`."""
    acc = accumulation_dtype(dtype)
    inv_freq = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 2, device=device, dtype=acc) / cfg.head_dim)
    angles = torch.arange(context, device=device, dtype=acc)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :D/2], x[..., D/2:]) of x (B, heads, P, D) by cos/sin (P, D/2), in their dtype."""
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rank: int, world_size: int, seed: int, dtype, device) -> None:
        super().__init__()
        self.layer = layer
        self.heads = cfg.num_heads // world_size
        self.kv_heads = cfg.num_kv_heads // world_size
        self.head_dim = cfg.head_dim
        d = cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden, {"q_proj": cfg.num_heads * d, "k_proj": cfg.num_kv_heads * d, "v_proj": cfg.num_kv_heads * d},
            rank=rank, world_size=world_size, seed=seed, layer=layer, dtype=dtype, device=device,
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden, rank=rank, world_size=world_size,
                                        seed=seed, layer=layer, name="o_proj", dtype=dtype, device=device)

    def _split(self, x: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.local_sizes, dim=-1)
        view = lambda t, heads: t.view(batch, -1, heads, self.head_dim).transpose(1, 2)  # noqa: E731
        return view(q, self.heads), view(k, self.kv_heads), view(v, self.kv_heads)

    def prefill(self, x_TH: torch.Tensor, cache: KVCache, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        batch = cache.batch
        q, k, v = self._split(x_TH, batch)
        prompt = q.shape[2]
        cos, sin = rotary[0][:prompt], rotary[1][:prompt]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        cache.k[self.layer, :, :, :prompt] = k
        cache.v[self.layer, :, :, :prompt] = v
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(x_TH.shape[0], -1))

    def decode(self, x_BH: torch.Tensor, cache: KVCache, rotary: tuple[torch.Tensor, torch.Tensor],
               pos: torch.Tensor) -> torch.Tensor:
        batch = x_BH.shape[0]
        q, k, v = self._split(x_BH, batch)
        cos, sin = rotary[0].index_select(0, pos), rotary[1].index_select(0, pos)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_cache, v_cache = cache.k[self.layer], cache.v[self.layer]
        k_cache.index_copy_(2, pos, k)
        v_cache.index_copy_(2, pos, v)
        mask = torch.arange(cache.context, device=x_BH.device) <= pos
        with record_function("tpfuse::attention_core"):
            out = grouped_decode_attention(q, k_cache, v_cache, mask)
        return self.o_proj(out.reshape(batch, -1))


def grouped_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_S: torch.Tensor) -> torch.Tensor:
    """Attention of one query per sequence over the cache window: q (B, h, 1, D), k/v (B, hk, S, D) -> (B, h, D).

    Written as two batched matmuls over (B, hk) with the g = h/hk query heads of a KV head as
    rows, so grouped KV heads are never copied or expanded, there is no host sync (graph-safe),
    and masking needs no fused-attention support for GQA plus a mask. Softmax in fp32 (float64
    for float64 models)."""
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    q_g = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(q_g, k.transpose(-1, -2)).to(accumulation_dtype(q.dtype)) * dim**-0.5
    probs = scores.masked_fill(~mask_S, float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, v).reshape(batch, heads, dim)
