"""The tensor-parallel layers' weights (`tpfuse.models.layers`): deterministic by seed, layer and
name, and the shards of every rank tile the full matrix."""

from __future__ import annotations

import torch

from tpfuse.models.layers import ColumnParallelLinear, RowParallelLinear, random_tensor


def test_weights_are_deterministic_and_shards_tile_the_full_matrix():
    kw = dict(seed=1, layer=2, dtype=torch.float64, device="cpu")
    full = ColumnParallelLinear(8, {"a": 6, "b": 4}, rank=0, world_size=1, **kw).weight
    halves = [ColumnParallelLinear(8, {"a": 6, "b": 4}, rank=r, world_size=2, **kw).weight for r in (0, 1)]
    # rank r holds [a_r; b_r]: a = rows 0..5 of the full weight, b = rows 6..9
    assert torch.equal(torch.cat([halves[0][:3], halves[1][:3]]), full[:6])
    assert torch.equal(torch.cat([halves[0][3:], halves[1][3:]]), full[6:])
    row_full = RowParallelLinear(8, 6, rank=0, world_size=1, name="o", **kw).weight
    row_halves = [RowParallelLinear(8, 6, rank=r, world_size=2, name="o", **kw).weight for r in (0, 1)]
    assert torch.equal(torch.cat(row_halves, dim=1), row_full)
    a = random_tensor((4, 4), seed=1, layer=0, name="x", std=1.0, dtype=torch.float32, device="cpu")
    b = random_tensor((4, 4), seed=1, layer=1, name="x", std=1.0, dtype=torch.float32, device="cpu")
    assert torch.equal(a, random_tensor((4, 4), seed=1, layer=0, name="x", std=1.0, dtype=torch.float32, device="cpu"))
    assert not torch.equal(a, b)
