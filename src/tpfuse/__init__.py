"""tpfuse: fused tensor-parallel collectives, chosen by capability and measurement.

Importing the package does nothing heavy: no torch import, no probing, no compiling. The public
names below are resolved on first use (PEP 562), so `tpfuse audit` runs without torch.
"""

from tpfuse._version import __version__

_LAZY = {
    "Communicator": "tpfuse.api",
    "probe": "tpfuse.probe",
    "Capabilities": "tpfuse.probe.capabilities",
    "Op": "tpfuse.spec",
    "Problem": "tpfuse.spec",
    "GroupFacts": "tpfuse.spec",
    "Verdict": "tpfuse.spec",
    "Needs": "tpfuse.spec",
    "Strategy": "tpfuse.strategies.base",
    "register": "tpfuse.strategies",
    "strategy_names": "tpfuse.strategies",
    "get_strategy": "tpfuse.strategies",
    "admission": "tpfuse.strategies",
    "all_reduce_ref": "tpfuse.reference",
    "residual_rmsnorm_ref": "tpfuse.reference",
    "all_reduce_residual_rmsnorm_ref": "tpfuse.reference",
    "TOLERANCE": "tpfuse.reference",
    "QuantSpec": "tpfuse.quant",
    "QuantOutput": "tpfuse.quant",
    "fp8_static": "tpfuse.quant",
    "fp8_per_token": "tpfuse.quant",
    "fp8_per_group": "tpfuse.quant",
    "nvfp4": "tpfuse.quant",
    "quantize_ref": "tpfuse.reference",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tpfuse' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
