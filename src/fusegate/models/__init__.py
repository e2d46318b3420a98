"""A reference tensor-parallel MoE decoder shaped like GLM-5, driven through the fusegate Communicator.

config (presets and cuts) -> layers (parallel linears, deterministic weights) -> attention (GQA, KV
cache) and moe (router, sharded experts, runners chosen by moe_runners) -> decoder (two
allreduce + residual + RMSNorm calls per layer). Importing this package imports nothing heavy.
"""

_LAZY = {
    "ModelConfig": "fusegate.models.config",
    "model_config": "fusegate.models.config",
    "TPDecoder": "fusegate.models.decoder",
    "CountingCommunicator": "fusegate.models.decoder",
    "runner_report": "fusegate.models.moe_runners",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fusegate.models' has no attribute {name!r}")
