"""Strategy registry: name -> lazily imported Strategy class, and admission over all of them.

Strategy modules import torch, Triton or optional packages; they are imported only when a strategy
is asked for, never at package import. A module that fails to import makes its strategy
not-admitted with the import error as the reason, instead of breaking every other strategy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tpfuse.spec import Problem, Verdict

if TYPE_CHECKING:
    from tpfuse.probe.capabilities import Capabilities
    from tpfuse.strategies.base import Strategy

# name -> "module:Class". Order is the order doctor lists them in.
_REGISTRY: dict[str, str] = {
    "reference": "tpfuse.strategies.reference:ReferenceStrategy",
    "ring": "tpfuse.strategies.ring:RingStrategy",
    "nccl_epilogue": "tpfuse.strategies.nccl_epilogue:NcclEpilogueStrategy",
    "nccl_eager": "tpfuse.strategies.nccl_eager:NcclEagerStrategy",
    "oneshot": "tpfuse.strategies.oneshot:OneShotStrategy",
    "twoshot": "tpfuse.strategies.twoshot:TwoShotStrategy",
}


def _registry() -> dict[str, str]:
    """Built-in strategies plus TPFUSE_STRATEGIES plugins (read on every call: cheap, and a
    test or a launcher may set it after import)."""
    from tpfuse.env import extra_strategies

    return {**_REGISTRY, **extra_strategies()}


def register(name: str, target: str) -> None:
    """Register a strategy class by import path ("package.module:Class") in this process; later
    names win. Ranks spawned later do not see it: use TPFUSE_STRATEGIES for those."""
    if ":" not in target:
        raise ValueError(f"register: target {target!r} must look like 'package.module:Class'")
    _REGISTRY[name] = target


def strategy_names() -> list[str]:
    return list(_registry())


def get_strategy(name: str) -> type[Strategy]:
    """The Strategy class registered as `name` (ValueError listing the valid names if unknown)."""
    registry = _registry()
    if name not in registry:
        raise ValueError(f"unknown strategy {name!r}; registered strategies: {', '.join(registry)}")
    module_name, _, class_name = registry[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def admission(problem: Problem, caps: Capabilities, names: list[str] | None = None) -> dict[str, Verdict]:
    """Verdict of every registered (or every named) strategy for `problem` on `caps`."""
    verdicts: dict[str, Verdict] = {}
    for name in names or strategy_names():
        try:
            cls = get_strategy(name)
        except ImportError as exc:
            verdicts[name] = Verdict.no(f"cannot import {_registry()[name]}: {exc}")
            continue
        verdicts[name] = cls.admits(problem, caps)
    return verdicts
