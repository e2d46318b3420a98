"""What the engine integrations share: one Communicator per engine group, an op keyed by the group's name, log lines.

    torch.ops.tpfuse.engine_all_reduce_residual_rmsnorm(x, residual, weight, eps, group_name)
        -> (normed, new_residual)

The op names its group by the engine's own group name ("tp:0"), not by a per-process handle, so
a compiled graph that calls it stays valid in every process and across compile-cache hits. The
name resolves to a Communicator registered here by `communicator()` / `prepare()` (the engine
plugins call them with the engine's device and CPU groups), or, for a name never seen, through a
resolver an engine registered (`register_resolver`). Creating a Communicator is a collective on
the group's CPU group: the plugins create them where every rank of the group runs the same code
(the engine's warm-up, its pass construction, or an eager call), never inside graph capture.

Logging (logger "tpfuse.integrations", no handlers configured here): once per process and
group, which strategy each token bucket uses and why; once per reason, why tpfuse stood down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tpfuse import env
from tpfuse.spec import Op

logger = logging.getLogger("tpfuse.integrations")

_COMMS: dict[str, Any] = {}  # group name -> tpfuse.Communicator
_PREPARED: dict[tuple, int] = {}  # (group name, hidden, dtype) -> max tokens prepare() covered
_RESOLVERS: dict[str, Callable[[str], EngineGroup | None]] = {}
_LOGGED: set = set()


@dataclass(frozen=True)
class EngineGroup:
    """An engine's process group as tpfuse needs it: its name, the data group, the CPU group, the device type."""

    name: str
    device_group: Any
    cpu_group: Any
    device: str  # "cuda" or "cpu": where the engine's activations live


def enabled(engine: str) -> bool:
    """True when TPFUSE_ENGINES switches tpfuse on for `engine`."""
    return engine in env.engines_enabled()


def enabled_or_say(engine: str, label: str) -> bool:
    """`enabled(engine)`, logging once (debug level) that the `label` plugin stays inert when not."""
    if enabled(engine):
        return True
    log_once(f"{engine}:off", f"tpfuse: {label} plugin inert (TPFUSE_ENGINES does not name {engine})",
             level=logging.DEBUG)
    return False


def log_once(key: str, message: str, *, level: int = logging.INFO) -> bool:
    """Log `message` the first time `key` is seen in this process; True if it was logged now."""
    if key in _LOGGED:
        return False
    _LOGGED.add(key)
    logger.log(level, message)
    return True


def communicator(group: EngineGroup):
    """The Communicator of `group`, created on first use (a collective over the group's ranks)."""
    comm = _COMMS.get(group.name)
    if comm is None:
        from tpfuse.api import Communicator

        comm = Communicator(group.device_group, cpu_group=group.cpu_group, device=group.device)
        _COMMS[group.name] = comm
    return comm


def prepare(engine: str, group: EngineGroup, *, hidden: int, dtype: torch.dtype, max_tokens: int) -> None:
    """Collective: create `group`'s Communicator and prepare it for up to `max_tokens x hidden`
    (before graph capture); logs the per-bucket plan once. Repeated calls that are covered are free."""
    key = (group.name, hidden, dtype)
    if _PREPARED.get(key, 0) >= max_tokens:
        return
    comm = communicator(group)
    comm.prepare(hidden=hidden, dtype=dtype, max_tokens=max_tokens)
    _PREPARED[key] = max_tokens
    log_once(f"plan:{engine}:{group.name}:{hidden}:{dtype}", plan_text(engine, group, comm, hidden, dtype, max_tokens))


def prepared_tokens(names) -> int:
    """The token count every named group was prepared for, for some hidden size and dtype (0 if one was not)."""
    per_group = [max((tokens for (name, _, _), tokens in _PREPARED.items() if name == wanted), default=0) for wanted in names]
    return min(per_group, default=0)


def plan_text(engine: str, group: EngineGroup, comm, hidden: int, dtype: torch.dtype, max_tokens: int) -> str:
    """One line per run of token buckets that use the same strategy for the same reason."""
    runs: list[list] = []  # [first, last, name, reason]
    for tokens in buckets(max_tokens):
        choice = comm.strategy_for(Op.ALL_REDUCE_RESIDUAL_RMSNORM, tokens, hidden, dtype)
        if runs and runs[-1][2:] == [choice.name, choice.reason]:
            runs[-1][1] = tokens
        else:
            runs.append([tokens, tokens, choice.name, choice.reason])
    head = (f"tpfuse: {engine} group {group.name} (world size {comm.world_size}, {comm.facts.backend}, "
            f"{comm.facts.device_type}) takes allreduce + residual + RMSNorm, hidden {hidden} {str(dtype).removeprefix('torch.')}:")
    lines = [f"  tokens {a}-{b}: {name} ({reason})" if a != b else f"  tokens {a}: {name} ({reason})" for a, b, name, reason in runs]
    return "\n".join([head, *lines])


def buckets(max_tokens: int) -> list[int]:
    """Powers of two below `max_tokens`, then `max_tokens` (the sizes Communicator.prepare covers)."""
    out, tokens = [], 1
    while tokens < max_tokens:
        out.append(tokens)
        tokens *= 2
    return out + [max_tokens]


def register_resolver(engine: str, resolve: Callable[[str], EngineGroup | None]) -> None:
    """`resolve(group_name)` finds an engine's group the op has no Communicator for yet."""
    _RESOLVERS[engine] = resolve


def lookup(group_name: str):
    """The Communicator the op uses for `group_name` (created through a resolver if needed)."""
    comm = _COMMS.get(group_name)
    if comm is not None:
        return comm
    for resolve in _RESOLVERS.values():
        group = resolve(group_name)
        if group is not None:
            return communicator(group)
    raise ValueError(
        f"tpfuse::engine_all_reduce_residual_rmsnorm: no Communicator for group {group_name!r}; "
        "the engine plugin prepares its groups before the first call (is TPFUSE_ENGINES set in every worker?)"
    )


def close_all() -> None:
    """Collective: close every Communicator created here (the engine's cleanup calls it on every rank)."""
    for comm in _COMMS.values():
        comm.close()
    _COMMS.clear()
    _PREPARED.clear()


@torch.library.custom_op("tpfuse::engine_all_reduce_residual_rmsnorm", mutates_args=())
def engine_all_reduce_residual_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return lookup(group_name).all_reduce_residual_rmsnorm(x, residual, weight, eps)


@engine_all_reduce_residual_rmsnorm.register_fake
def _(x, residual, weight, eps, group_name):
    return torch.empty_like(x), torch.empty_like(x)
