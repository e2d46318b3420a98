"""Strategy registry: name -> lazily imported Strategy class, and admission over all of them.

Strategy modules import torch, Triton or optional packages; they are imported only when a strategy
is asked for, never at package import. A target that fails to import, or that is not a `Strategy`
subclass (a plugin named by TPFUSE_STRATEGIES or `register`), makes its strategy not admitted
with that reason, instead of breaking every other strategy; asking for it by name raises the
reason. `register` checks its target when it is called.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tpfuse import env
from tpfuse.spec import Problem, Verdict
from tpfuse.strategies.base import Strategy

if TYPE_CHECKING:
    from tpfuse.probe.capabilities import Capabilities

# name -> "module:Class". Order is the order doctor lists them in.
_REGISTRY: dict[str, str] = {
    "reference": "tpfuse.strategies.reference:ReferenceStrategy",
    "ring": "tpfuse.strategies.ring:RingStrategy",
    "nccl_epilogue": "tpfuse.strategies.nccl_epilogue:NcclEpilogueStrategy",
    "nccl_eager": "tpfuse.strategies.nccl_eager:NcclEagerStrategy",
    "oneshot": "tpfuse.strategies.oneshot:OneShotStrategy",
    "twoshot": "tpfuse.strategies.twoshot:TwoShotStrategy",
}
# The built-ins whose `needs.cuda` is set, known without importing them (their modules import
# torch), so that the CLI can refuse one for CPU ranks before torch loads; a test keeps this equal
# to the classes' own declarations.
_NEEDS_CUDA = frozenset({"nccl_epilogue", "nccl_eager", "oneshot", "twoshot"})
_BUILT_IN = dict(_REGISTRY)


def needs_cuda(name: str) -> bool | None:
    """Whether the built-in strategy `name` needs CUDA tensors; None for a plugin (unknown until imported)."""
    if name not in _BUILT_IN or _registry().get(name) != _BUILT_IN[name]:
        return None
    return name in _NEEDS_CUDA


def _registry() -> dict[str, str]:
    """Built-in strategies plus TPFUSE_STRATEGIES plugins (read on every call: cheap, and a
    test or a launcher may set it after import)."""
    return {**_REGISTRY, **env.extra_strategies()}


def register(name: str, target: str) -> None:
    """Register a strategy class by import path ("package.module:Class") in this process; later
    names win. The target is imported and checked now (ValueError, or the ImportError, if it is not
    a Strategy subclass). Ranks spawned later do not see it: use TPFUSE_STRATEGIES for those."""
    if not env.is_strategy_entry(name, target):
        raise ValueError(f"register: {name!r} -> {target!r} must be a name and 'package.module:Class'")
    _load(name, target, "register")
    _REGISTRY[name] = target


def strategy_names() -> list[str]:
    return list(_registry())


def _load(name: str, target: str, source: str) -> type[Strategy]:
    """The class `target` names; ImportError if its module does not import, ValueError (naming
    `source`: where the entry came from) if it is missing or not a Strategy subclass."""
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{source}: strategy {name!r} = {target}: {module_name} has no {attr!r}; "
                             "name a Strategy subclass")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Strategy)):
        raise ValueError(f"{source}: strategy {name!r} = {target} is a {type(obj).__name__}, not a "
                         "tpfuse.strategies.base.Strategy subclass; name a Strategy subclass")
    return obj


def get_strategy(name: str) -> type[Strategy]:
    """The Strategy class registered as `name` (ValueError listing the valid names if unknown, or
    saying why its target is not a Strategy; ImportError if its module does not import)."""
    plugins = env.extra_strategies()
    registry = {**_REGISTRY, **plugins}
    if name not in registry:
        raise ValueError(f"unknown strategy {name!r}; registered strategies: {', '.join(registry)}")
    return _load(name, registry[name], "TPFUSE_STRATEGIES" if name in plugins else "get_strategy")


def admission(problem: Problem, caps: Capabilities, names: list[str] | None = None) -> dict[str, Verdict]:
    """Verdict of every registered (or every named) strategy for `problem` on `caps`."""
    verdicts: dict[str, Verdict] = {}
    for name in names or strategy_names():
        try:
            cls = get_strategy(name)
        except ImportError as exc:
            verdicts[name] = Verdict.no(f"cannot import {_registry()[name]}: {exc}")
            continue
        except ValueError as exc:  # unknown, or its target is not a Strategy
            verdicts[name] = Verdict.no(str(exc))
            continue
        verdicts[name] = cls.admits(problem, caps)
    return verdicts
