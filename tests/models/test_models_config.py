"""Model configs from the shared presets, cuts, validation; deterministic sharded weights."""

from __future__ import annotations

import pytest
import torch

from tpfuse.models.config import model_config
from tpfuse.models.layers import ColumnParallelLinear, RowParallelLinear, random_tensor


def test_glm5_preset_shapes():
    cfg = model_config("glm5")
    assert (cfg.hidden, cfg.num_heads, cfg.num_experts, cfg.top_k, cfg.expert_inter) == (6144, 64, 256, 8, 2048)
    assert (cfg.num_layers, cfg.first_dense_layers, cfg.num_shared_experts) == (78, 3, 1)


def test_cut_keeps_dense_ratio_and_overrides():
    cut = model_config("glm5", layers=4, experts=32)
    assert (cut.num_layers, cut.first_dense_layers, cut.num_experts, cut.top_k) == (4, 0, 32, 8)
    assert model_config("glm5", layers=26).first_dense_layers == 1  # 3/78 of 26 = 1
    assert model_config("glm5", layers=4, dense_layers=1).num_moe_layers == 3
    assert model_config("llama3-70b", layers=2).num_moe_layers == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"layers": 0}, "layers must be >= 1"),
    ({"experts": 4}, "raise --experts"),
    ({"dense_layers": 99}, "first_dense_layers"),
])
def test_bad_cuts_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        model_config("glm5", **kwargs)


def test_unknown_preset_and_bad_world_size():
    with pytest.raises(ValueError, match="unknown model preset"):
        model_config("glm6")
    with pytest.raises(ValueError, match="num_kv_heads=2 does not split over 4"):
        model_config("tiny").check_world_size(4)


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
