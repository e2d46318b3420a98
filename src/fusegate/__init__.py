"""fusegate: fused tensor-parallel collectives, chosen by capability and measurement.

Importing the package does nothing heavy: no torch import, no probing, no compiling. The public
names below are resolved on first use (PEP 562), so `fusegate audit` runs without torch.
"""

from fusegate._version import __version__

_LAZY = {
    "Communicator": "fusegate.api",
    "probe": "fusegate.probe",
    "Capabilities": "fusegate.probe.capabilities",
    "Op": "fusegate.spec",
    "Problem": "fusegate.spec",
    "GroupInfo": "fusegate.spec",
    "Verdict": "fusegate.spec",
    "Needs": "fusegate.spec",
    "Strategy": "fusegate.strategies.base",
    "register": "fusegate.strategies",
    "strategy_names": "fusegate.strategies",
    "get_strategy": "fusegate.strategies",
    "admission": "fusegate.strategies",
    "all_reduce_ref": "fusegate.reference",
    "residual_rmsnorm_ref": "fusegate.reference",
    "all_reduce_residual_rmsnorm_ref": "fusegate.reference",
    "TOLERANCE": "fusegate.reference",
    "QuantSpec": "fusegate.quant",
    "QuantOutput": "fusegate.quant",
    "fp8_static": "fusegate.quant",
    "fp8_per_token": "fusegate.quant",
    "fp8_per_group": "fusegate.quant",
    "nvfp4": "fusegate.quant",
    "quantize_ref": "fusegate.reference",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fusegate' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
