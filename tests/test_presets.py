"""Model presets hold the shapes recorded in the research notes (perf-anchors.md section 5a)."""

import pytest

from tpfuse.presets import PRESETS, get_preset, preset_names


def test_presets_match_recorded_configs():
    # hidden, layers, first dense layers, experts, top-k, expert width: perf-anchors.md section 5a.
    expected = {
        "glm5": (6144, 78, 3, 256, 8, 2048),
        "deepseek-v3": (7168, 61, 3, 256, 8, 2048),
        "qwen3-235b": (4096, 94, 0, 128, 8, 1536),
        "llama3-70b": (8192, 80, 80, 0, 0, 0),
    }
    assert preset_names() == list(expected)
    for name, row in expected.items():
        p = get_preset(name)
        assert (p.hidden, p.num_layers, p.first_dense_layers, p.num_experts, p.top_k, p.expert_inter) == row
        assert p.is_moe == (p.num_experts > 0)
        assert p.num_moe_layers == p.num_layers - p.first_dense_layers


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(ValueError, match="glm5"):
        get_preset("glm-9")
    assert "glm5" in PRESETS
