"""Model configuration for the reference tensor-parallel decoder: one frozen dataclass.

`model_config("glm5", layers=4, experts=32)` builds a `ModelConfig` from the shared shape table
in `tpfuse.presets`, adds what the decoder needs beyond it (attention layout, vocabulary), and
applies the overrides that cut a model to fit the GPUs at hand. "tiny" is a test-sized MoE model.

Attention is simplified: GLM-5 and DeepSeek-V3 use multi-head latent attention (MLA); here every
preset runs grouped-query attention (GQA) with the query-head count of the preset, head_dim 128
and the KV-head count in `_ATTENTION` below. The allreduce pattern (two per layer, hidden-sized
payload) does not depend on that choice; the attention time and KV-cache bytes do.

`--layers L` keeps the preset's ratio of dense to MoE layers (rounded), unless `dense_layers` is
given; `--experts E` keeps top-k and the expert width.

`ModelConfig.rank_memory_bytes` estimates, before any rank starts, the peak bytes one rank holds to
build and run the model, so that a cut that cannot fit is refused with the fix instead of an
out-of-memory kill after the weights were half drawn.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tpfuse import presets


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of one decoder. Layers `0 .. first_dense_layers-1` are dense, the rest MoE."""

    name: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    first_dense_layers: int
    dense_inter: int
    num_experts: int
    top_k: int
    expert_inter: int
    num_shared_experts: int
    vocab: int
    eps: float = 1e-5  # RMSNorm epsilon of GLM/DeepSeek/Qwen/Llama checkpoints
    rope_theta: float = 10000.0  # the common RoPE base; positions here stay short

    def __post_init__(self) -> None:
        for field in ("hidden", "num_heads", "num_kv_heads", "head_dim", "num_layers", "vocab"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelConfig: {field} must be >= 1, got {getattr(self, field)}")
        if not 0 <= self.first_dense_layers <= self.num_layers:
            raise ValueError(
                f"ModelConfig: first_dense_layers={self.first_dense_layers} must lie in [0, num_layers={self.num_layers}]"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig: head_dim={self.head_dim} must be even (rotary embedding pairs)")
        if self.first_dense_layers > 0 and self.dense_inter < 1:
            raise ValueError(f"ModelConfig: {self.first_dense_layers} dense layers need dense_inter >= 1; pass dense_layers=0")
        if self.num_moe_layers > 0:
            if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts or self.expert_inter < 1:
                raise ValueError(
                    f"ModelConfig: MoE layers need num_experts >= 1, 1 <= top_k <= num_experts and expert_inter >= 1 "
                    f"(got {self.num_experts}, {self.top_k}, {self.expert_inter}); raise --experts to at least top_k"
                )

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_dense_layers

    def check_world_size(self, world_size: int) -> None:
        """ValueError unless heads, KV heads, experts and FFN widths split evenly over `world_size` ranks."""
        parts = {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "vocab": self.vocab}
        if self.first_dense_layers:
            parts["dense_inter"] = self.dense_inter
        if self.num_moe_layers:
            parts["num_experts"] = self.num_experts
            if self.num_shared_experts:
                parts["expert_inter"] = self.expert_inter
        for name, value in parts.items():
            if value % world_size:
                raise ValueError(
                    f"ModelConfig: {name}={value} does not split over {world_size} ranks; "
                    f"use a tensor-parallel size that divides it"
                )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def weight_elements(self, world_size: int) -> int:
        """Elements of the weights one of `world_size` ranks holds (tpfuse.models.layers: the
        embedding and the MoE routers replicated, everything else split over the ranks)."""
        h, d, w = self.hidden, self.head_dim, world_size
        attention = h * (self.num_heads + 2 * self.num_kv_heads) * d // w + self.num_heads * d * h // w
        dense = 3 * h * self.dense_inter // w
        moe = (self.num_experts * h + 3 * h * self.expert_inter * (self.num_experts // w)
               + 3 * h * self.expert_inter * self.num_shared_experts // w)
        norms = 2 * h * self.num_layers + h
        return (self.vocab * h + self.vocab * h // w + norms + self.num_layers * attention
                + self.first_dense_layers * dense + self.num_moe_layers * moe)

    def kv_cache_elements(self, world_size: int, *, batch: int, context: int) -> int:
        """Elements of one rank's KV cache for `batch` sequences of `context` slots (keys and values)."""
        return 2 * self.num_layers * batch * (self.num_kv_heads // world_size) * context * self.head_dim

    def rank_memory_bytes(self, world_size: int, *, itemsize: int, batch: int, context: int, prompt_len: int) -> int:
        """Estimated peak bytes one rank holds for its weights, its KV cache at `batch`, the transient
        copies made while the weights are drawn, and the prefill's activations (the bench's largest
        step). An estimate from the shapes, not a measurement; `tpfuse.cli.preflight` adds the
        process itself."""
        h = self.hidden
        # Every matrix is drawn whole in fp32, cast, then sliced and concatenated into the weight it
        # becomes (layers.py): beyond that weight, the largest drawn matrix is held in fp32 and, for
        # a 16-bit model, cast, for a moment.
        drawn = max(self.vocab * h, h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                    self.num_heads * self.head_dim * h, h * max(self.dense_inter, self.expert_inter))
        transient = drawn * (4 + (itemsize if itemsize != 4 else 0))
        tokens = batch * prompt_len
        # Prefill: logits (a rank's slice, every rank's pieces and their concatenation), the hidden
        # states through a layer (a few copies: residual, normed, attention and MLP outputs, fp32
        # sums) and the routed experts' intermediate rows.
        activations = tokens * (3 * self.vocab + 16 * h + 3 * max(self.top_k, 1) * 2 * self.expert_inter) * 4
        return ((self.weight_elements(world_size) + self.kv_cache_elements(world_size, batch=batch, context=context))
                * itemsize + transient + activations)


# GQA stand-in per preset: (num_kv_heads, head_dim, vocab). KV heads 8 / head_dim 128 follow
# Llama-3-70B's config.json; Qwen3-235B-A22B's 4 KV heads and every vocabulary size are from the
# models' published configs (the sources listed in tpfuse.presets; Llama-3-70B vocab 128256).
_ATTENTION = {
    "glm5": (8, 128, 154880),
    "deepseek-v3": (8, 128, 129280),
    "qwen3-235b": (4, 128, 151936),
    "llama3-70b": (8, 128, 128256),
}

TINY = ModelConfig(
    name="tiny", hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2, first_dense_layers=1,
    dense_inter=96, num_experts=8, top_k=2, expert_inter=32, num_shared_experts=1, vocab=256,
)


def preset_names() -> list[str]:
    return [*presets.preset_names(), "tiny"]


def model_config(
    preset: str,
    *,
    layers: int | None = None,
    experts: int | None = None,
    dense_layers: int | None = None,
    vocab: int | None = None,
) -> ModelConfig:
    """The decoder config of `preset`, cut by the overrides (ValueError on an unknown preset or bad cut)."""
    if preset == "tiny":
        base = TINY
    else:

        p = presets.get_preset(preset)
        kv_heads, head_dim, base_vocab = _ATTENTION[p.name]
        base = ModelConfig(
            name=p.name, hidden=p.hidden, num_heads=p.num_heads, num_kv_heads=kv_heads, head_dim=head_dim,
            num_layers=p.num_layers, first_dense_layers=p.first_dense_layers, dense_inter=p.dense_inter,
            num_experts=p.num_experts, top_k=p.top_k, expert_inter=p.expert_inter,
            num_shared_experts=p.num_shared_experts, vocab=base_vocab,
        )
    changes: dict = {}
    if layers is not None:
        if layers < 1:
            raise ValueError(f"model_config: layers must be >= 1, got {layers}")
        changes["num_layers"] = layers
        if dense_layers is None:
            # Keep the preset's dense:MoE ratio; a dense model stays dense.
            ratio = base.first_dense_layers / base.num_layers
            dense_layers = layers if ratio == 1.0 else min(layers, round(ratio * layers))
    if dense_layers is not None:
        if dense_layers < 0:
            raise ValueError(f"model_config: dense_layers must be >= 0, got {dense_layers}")
        changes["first_dense_layers"] = dense_layers
    if experts is not None:
        if base.num_experts == 0:
            raise ValueError(f"model_config: preset {preset!r} is dense; drop --experts")
        changes["num_experts"] = experts
    if vocab is not None:
        changes["vocab"] = vocab
    return dataclasses.replace(base, **changes) if changes else base
