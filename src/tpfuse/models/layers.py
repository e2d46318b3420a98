"""Tensor-parallel building blocks with deterministic weights (nano-vllm's layer vocabulary).

Weights are random but reproducible: every full (unsharded) matrix is drawn from a generator
seeded by (seed, layer, name) on the target device type, and each rank keeps its slice. So a
TP=2 model holds exactly the slices of the TP=1 model's matrices, which is what makes the TP1 vs
TP2 parity test meaningful. Values are N(0, 1/fan_in) so activations stay near unit scale.
(CPU and CUDA generators draw different numbers: a CPU model and a GPU model of the same seed differ.)

Shape legend: T tokens, H hidden, O output features, V vocabulary, W ranks, `_local` = this rank's shard.

Reductions are not done here: `RowParallelLinear` returns this rank's partial sum and the decoder
hands it to the Communicator (the fused allreduce + residual + RMSNorm seam).
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F


def weight_seed(seed: int, layer: int, name: str) -> int:
    """A 63-bit generator seed for one named tensor of one layer (layer -1: outside the layers).

    A hash, not arithmetic on the fields: the CPU generator (mt19937) keeps only the low 32 bits
    of a seed, so every field must reach those bits."""
    digest = hashlib.blake2b(f"{seed}/{layer}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def random_tensor(
    shape: tuple[int, ...], *, seed: int, layer: int, name: str, std: float, dtype: torch.dtype, device
) -> torch.Tensor:
    """Deterministic N(0, std^2) tensor of `shape`, drawn in fp32 on `device` and cast to `dtype`."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(weight_seed(seed, layer, name))
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)


def shard(t: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of `t` along `dim` (ValueError if it does not split evenly)."""
    size = t.shape[dim]
    if size % world_size:
        raise ValueError(f"shard: dimension {dim} of size {size} does not split over {world_size} ranks")
    step = size // world_size
    return t.narrow(dim, rank * step, step).contiguous()


class _Linear(nn.Module):
    """A bias-free linear layer whose weight `(O_local, in_local)` is fixed at construction."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ReplicatedLinear(_Linear):
    """The full `(out, in)` matrix on every rank (the MoE router)."""

    def __init__(self, in_features: int, out_features: int, *, seed: int, layer: int, name: str, dtype, device) -> None:
        super().__init__(random_tensor((out_features, in_features), seed=seed, layer=layer, name=name,
                                       std=in_features**-0.5, dtype=dtype, device=device))


class ColumnParallelLinear(_Linear):
    """Output features split over ranks: rank r computes columns r*O/W .. (r+1)*O/W of x @ W^T.

    `parts` lists the full output sizes of matrices stored side by side (e.g. gate and up, or q, k
    and v); each part is drawn and sharded on its own, so rank r holds [part0_r, part1_r, ...].
    """

    def __init__(self, in_features: int, parts: dict[str, int], *, rank: int, world_size: int,
                 seed: int, layer: int, dtype, device) -> None:
        shards = []
        for name, out_features in parts.items():
            full = random_tensor((out_features, in_features), seed=seed, layer=layer, name=name,
                                 std=in_features**-0.5, dtype=dtype, device=device)
            shards.append(shard(full, 0, rank, world_size))
            del full
        super().__init__(torch.cat(shards, dim=0))
        self.local_sizes = [out // world_size for out in parts.values()]


class RowParallelLinear(_Linear):
    """Input features split over ranks: returns this rank's partial sum of x @ W^T (caller reduces)."""

    def __init__(self, in_features: int, out_features: int, *, rank: int, world_size: int,
                 seed: int, layer: int, name: str, dtype, device) -> None:
        full = random_tensor((out_features, in_features), seed=seed, layer=layer, name=name,
                             std=in_features**-0.5, dtype=dtype, device=device)
        super().__init__(shard(full, 1, rank, world_size))


class Embedding(nn.Module):
    """Replicated token embedding `(V, H)`.

    Replicated rather than vocab-parallel on purpose: a vocab-parallel embedding costs one more
    allreduce per step, and the model's contract is exactly two allreduces per layer.
    """

    def __init__(self, vocab: int, hidden: int, *, seed: int, dtype, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            random_tensor((vocab, hidden), seed=seed, layer=-1, name="embed", std=1.0, dtype=dtype, device=device),
            requires_grad=False,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class ParallelLMHead(ColumnParallelLinear):
    """Vocabulary split over ranks; `forward` returns full logits `(T, V)` gathered over the group.

    The gather uses torch.distributed directly: it is an all-gather, not one of the model's
    allreduces, and runs once per step.
    """

    def __init__(self, hidden: int, vocab: int, *, group, rank: int, world_size: int, seed: int, dtype, device) -> None:
        super().__init__(hidden, {"lm_head": vocab}, rank=rank, world_size=world_size, seed=seed, layer=-1,
                         dtype=dtype, device=device)
        self.group, self.world_size = group, world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits_local = F.linear(x, self.weight)
        if self.world_size == 1:
            return logits_local
        import torch.distributed as dist

        pieces = [torch.empty_like(logits_local) for _ in range(self.world_size)]
        dist.all_gather(pieces, logits_local.contiguous(), group=self.group)
        return torch.cat(pieces, dim=-1)


def rms_norm_weight(hidden: int, *, seed: int, layer: int, name: str, dtype, device) -> torch.Tensor:
    """A norm weight near 1 but not 1 (1 + 0.1 N(0,1)), so a test notices a swapped or missing weight."""
    noise = random_tensor((hidden,), seed=seed, layer=layer, name=name, std=0.1, dtype=torch.float32, device=device)
    return (1.0 + noise).to(dtype)
