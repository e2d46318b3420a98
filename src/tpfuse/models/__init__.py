"""A reference tensor-parallel MoE decoder shaped like GLM-5, driven through the tpfuse Communicator.

config (presets and cuts) -> layers (parallel linears, deterministic weights) -> attention (GQA, KV
cache) and moe (router, sharded experts, runners chosen by moe_runners) -> decoder (two
allreduce + residual + RMSNorm calls per layer). Importing this package imports nothing heavy.
"""

_LAZY = {
    "ModelConfig": "tpfuse.models.config",
    "model_config": "tpfuse.models.config",
    "TPDecoder": "tpfuse.models.decoder",
    "CountingCommunicator": "tpfuse.models.decoder",
    "runner_report": "tpfuse.models.moe_runners",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tpfuse.models' has no attribute {name!r}")
