"""Model presets: the shapes of the models tpfuse is tuned and benchmarked for, in one table.

`tpfuse tune --preset`, `tpfuse verify --preset`, the benchmarks and the model stand-ins in
tpfuse.models all read these numbers from here, so one correction reaches all of them.

Sources:
- GLM-5: huggingface/transformers `models/glm_moe_dsa/modular_glm_moe_dsa.py` defaults.
- DeepSeek-V3: the vLLM DeepSeek-V3 config page (v0.11.0 docs).
- Qwen3-235B-A22B: slime `scripts/models/qwen3-235B-A22B.sh` (Megatron arguments).
- Llama-3-70B: the checkpoint's config.json (meta-llama/Meta-Llama-3-70B: hidden_size 8192,
  intermediate_size 28672, num_hidden_layers 80, num_attention_heads 64, num_key_value_heads 8).

Plain data only; importing this module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPreset:
    """One model's shapes. A dense model has `num_experts == 0`, `top_k == 0`, `expert_inter == 0`,
    and `first_dense_layers == num_layers`; `dense_inter` is the FFN width of its dense layers."""

    name: str
    hidden: int
    num_heads: int
    num_experts: int
    num_shared_experts: int
    top_k: int
    expert_inter: int
    dense_inter: int
    num_layers: int
    first_dense_layers: int

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("glm5", hidden=6144, num_heads=64, num_experts=256, num_shared_experts=1, top_k=8,
                    expert_inter=2048, dense_inter=12288, num_layers=78, first_dense_layers=3),
        ModelPreset("deepseek-v3", hidden=7168, num_heads=128, num_experts=256, num_shared_experts=1, top_k=8,
                    expert_inter=2048, dense_inter=18432, num_layers=61, first_dense_layers=3),
        ModelPreset("qwen3-235b", hidden=4096, num_heads=64, num_experts=128, num_shared_experts=0, top_k=8,
                    expert_inter=1536, dense_inter=0, num_layers=94, first_dense_layers=0),
        ModelPreset("llama3-70b", hidden=8192, num_heads=64, num_experts=0, num_shared_experts=0, top_k=0,
                    expert_inter=0, dense_inter=28672, num_layers=80, first_dense_layers=80),
    )
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> ModelPreset:
    """The preset called `name` (ValueError naming the valid presets if unknown)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"get_preset: unknown model preset {name!r}; choose one of {', '.join(PRESETS)}"
        ) from None
