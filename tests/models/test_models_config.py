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


@pytest.mark.parametrize("cfg, world_size", [
    (model_config("tiny"), 1), (model_config("tiny"), 2), (model_config("llama3-70b", layers=1, vocab=512), 2),
    (model_config("glm5", layers=2, experts=8, dense_layers=1, vocab=256), 2),
], ids=["tiny-tp1", "tiny-tp2", "llama-dense-tp2", "glm5-cut-tp2"])
def test_the_memory_estimate_counts_exactly_the_weights_and_cache_a_rank_builds(cfg, world_size):
    from tpfuse.models.decoder import TPDecoder

    model = TPDecoder(cfg, object(), rank=world_size - 1, world_size=world_size, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == cfg.weight_elements(world_size)
    cache = model.new_cache(3, 16)
    assert cache.k.numel() + cache.v.numel() == cfg.kv_cache_elements(world_size, batch=3, context=16)
    weights_and_cache = (cfg.weight_elements(world_size) + cfg.kv_cache_elements(world_size, batch=3, context=16)) * 4
    assert cfg.rank_memory_bytes(world_size, itemsize=4, batch=3, context=16, prompt_len=8) > weights_and_cache


def test_the_full_glm5_does_not_fit_one_rank_and_its_cut_does():
    """The CPU default that ran out of memory after 23 s: the estimate says so before any rank starts."""
    full = model_config("glm5").rank_memory_bytes(1, itemsize=4, batch=64, context=64, prompt_len=16)
    cut = model_config("glm5", layers=2, experts=8).rank_memory_bytes(1, itemsize=4, batch=8, context=64, prompt_len=16)
    assert full > 1 << 40 and 8 << 30 < cut < 20 << 30
