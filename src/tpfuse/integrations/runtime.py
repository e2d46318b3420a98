"""What the engine integrations share: one Communicator per engine group, set up on every rank alike
or stood down on every rank alike, and an op keyed by the group's name that never crashes the engine.

    torch.ops.tpfuse.engine_all_reduce_residual_rmsnorm(x, residual, weight, eps, group_name)
        -> (normed, new_residual)

The op names its group by the engine's own group name ("tp:0"), not by a per-process handle, so
a compiled graph that calls it stays valid in every process and across compile-cache hits. The
name resolves to the Communicator `prepare()` set up for it; when there is none (never prepared,
stood down) or the call does not fit what was prepared (`unservable`: dtype, hidden size, token
count, residual or weight of another dtype or shape, another device), the op runs the engine's own
path instead: the fallback the engine's plugin registered (`register_fallback`: the engine's
allreduce, then its native add + RMSNorm). These checks read only shapes, dtypes and state that
`prepare` agreed across ranks, so every rank takes the same path for the same call without
communicating. A runtime fault of a peer (timeout, abort) is not a reason to fall back: the
Communicator raises it (fail-stop), never returns wrong data.

`prepare()` is a collective over the group's ranks, run where every rank runs the same code
before graph capture (the engine's warm-up, its pass construction): create the Communicator,
calibrate when the dispatch table lacks the engine's captured batch sizes
(`tpfuse.integrations.calibrate`), prepare the strategies. After each step the ranks agree
(`agree`) on the CPU group: if the step failed on any rank, every rank stands down for the group
with the same reason, logged once as a warning, and the engine's own path serves it from then on.

Logging (logger "tpfuse.integrations", no handlers configured here): once per process and group,
one line with the strategy of each run of token buckets; once per reason, why tpfuse stood down
or declined a call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tpfuse import env
from tpfuse.api import Communicator
from tpfuse.integrations.calibrate import calibrate
from tpfuse.integrations.log import log_once, logger
from tpfuse.spec import Op

# An agreement round that meets a rank still inside one of the step's collectives pairs with it;
# that rank fails there and comes to the next round. Steps nest no collectives deeper than the
# Communicator's constructor, so two more rounds always meet every rank (see `agree`).
_AGREE_ROUNDS = 3
_TAG = "tpfuse-setup-agreement"


@dataclass(frozen=True)
class EngineGroup:
    """An engine's process group as tpfuse needs it: its name, the data group, the CPU group, the device type."""

    name: str
    device_group: Any
    cpu_group: Any
    device: str  # "cuda" or "cpu": where the engine's activations live

    @classmethod
    def of(cls, coordinator) -> EngineGroup:
        """The EngineGroup of an sglang or vLLM `GroupCoordinator` (both name these fields alike)."""
        device = "cuda" if str(getattr(coordinator, "device", "cpu")).startswith("cuda") else "cpu"
        return cls(coordinator.unique_name, coordinator.device_group, coordinator.cpu_group, device)


@dataclass
class GroupState:
    """tpfuse's state for one engine group in this process (identical on every rank of the group)."""

    group: EngineGroup
    engine: str
    comm: Any = None  # tpfuse.Communicator while tpfuse serves the group
    prepared: dict = field(default_factory=dict)  # (hidden, dtype) -> max tokens prepare() covered
    down: str = ""  # why tpfuse stood down for the group ("" while it serves)


_STATES: dict[str, GroupState] = {}
_FALLBACKS: dict[str, Callable] = {}  # engine -> fallback(x, residual, weight, eps, group_name) or None
_LIMITS: dict[tuple, int] = {}  # cache of prepared_tokens, cleared on every change of _STATES


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


def state(name: str) -> GroupState | None:
    """The state of the group called `name` in this process (None before its first `prepare`)."""
    return _STATES.get(name)


def down_reason(name: str) -> str:
    """Why tpfuse stood down for the group `name` ("" when it serves it or was never asked to)."""
    st = _STATES.get(name)
    return st.down if st is not None else ""


# ---- set-up: collective, every step agreed ---------------------------------------------------


# How the error of a rank that failed only because a peer did begins (`_attempt`'s form).
_CONSEQUENCE = "PeerLostError: "


def agree(group: EngineGroup, step: str, error: str) -> str:
    """Collective on the group's CPU group: "" when `step` succeeded on every rank, else one reason,
    the same string on every rank: the ranks' errors, causes before the `PeerLostError`s of ranks
    whose peer failed.

    Each rank sends (tag, step, error, early). A rank that failed outside a collective reaches
    this gather while the others may still be inside one of the step's object collectives; the two
    pair up, the others fail there (they receive this message instead of theirs) and come here, and
    this rank, having received messages that are not agreements, gathers again to meet them, now
    marked `early`: its error is the cause, the others' are consequences. A rank that dies or hangs
    inside a collective is not agreed here: that is the fail-stop case of the engine's group."""
    world_size = dist.get_world_size(group.cpu_group)
    mine, everyone = (_TAG, step, error, False), []
    for _ in range(_AGREE_ROUNDS):
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine, group=group.cpu_group)
        if all(isinstance(m, tuple) and len(m) == 4 and m[0] == _TAG for m in everyone):
            break
        mine = (_TAG, step, error or f"rank out of step in {step}", True)
    else:
        raise RuntimeError(f"tpfuse: the ranks of group {group.name} could not agree after {step} in "
                           f"{_AGREE_ROUNDS} rounds; restart the engine (its ranks are out of step)")
    early = [(r, m[2]) for r, m in enumerate(everyone) if m[3] and m[2]]
    failed = early or [(r, m[2]) for r, m in enumerate(everyone) if m[2]]
    if not failed:
        return ""
    # A rank that lost its peer (PeerLostError) failed because another rank did: the other ranks'
    # errors are the cause and come first (stable order otherwise).
    failed.sort(key=lambda item: item[1].startswith(_CONSEQUENCE))
    by_reason: dict[str, list[int]] = {}
    for rank, reason in failed:
        by_reason.setdefault(reason, []).append(rank)
    if len(by_reason) == 1 and len(failed) == world_size:
        return f"{step} failed on every rank: {failed[0][1]}"
    return f"{step} failed on " + "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {why}" for why, r in by_reason.items())


def _attempt(fn: Callable[[], Any]) -> tuple[Any, str]:
    try:
        return fn(), ""
    except Exception as exc:  # noqa: BLE001 - every failure becomes this rank's reason, agreed by `agree`
        return None, f"{type(exc).__name__}: {exc}"


def prepare(engine: str, group: EngineGroup, *, hidden: int, dtype: torch.dtype, max_tokens: int,
            buckets: tuple[int, ...] = ()) -> bool:
    """Collective over `group`'s ranks, before graph capture: set tpfuse up for calls of up to
    `max_tokens x hidden` in `dtype`; True when tpfuse serves the group, False when it stood down.

    Steps, each agreed (`agree`): create the Communicator (handshakes on the CPU group); calibrate
    (`tpfuse.integrations.calibrate`) the engine's captured token counts `buckets` that the
    dispatch table lacks, unless TPFUSE_CALIBRATE=0; prepare the strategies. Never raises for a
    failure of a step: every rank stands down for the group with the same reason (one warning).
    Repeated calls that are covered are free."""
    st = _STATES.get(group.name)
    if st is None:
        st = _STATES[group.name] = GroupState(group, engine)
    if st.down:
        return False
    if st.prepared.get((hidden, dtype), 0) >= max_tokens:
        return True
    if st.comm is None:
        st.comm, error = _attempt(lambda: _new_communicator(group))
        if _stood_down(st, agree(group, "creating the Communicator", error)):
            return False
    comm, error = _attempt(lambda: calibrate(engine, group, st.comm, hidden=hidden, dtype=dtype,
                                             buckets=tuple(b for b in buckets if b <= max_tokens),
                                             new_communicator=_new_communicator))
    st.comm = comm if comm is not None else st.comm
    if _stood_down(st, agree(group, "calibration", error)):
        return False
    _, error = _attempt(lambda: st.comm.prepare(hidden=hidden, dtype=dtype, max_tokens=max_tokens))
    if _stood_down(st, agree(group, "Communicator.prepare", error)):
        return False
    st.prepared[(hidden, dtype)] = max_tokens
    _LIMITS.clear()
    log_once(f"plan:{engine}:{group.name}:{hidden}:{dtype}",
             plan_text(engine, group, st.comm, hidden, dtype, max_tokens))
    return True


def _new_communicator(group: EngineGroup):

    return Communicator(group.device_group, cpu_group=group.cpu_group, device=group.device)


def _stood_down(st: GroupState, reason: str) -> bool:
    """Stand down for `st`'s group when `reason` is set (the same on every rank); True if it did."""
    if not reason:
        return False
    comm, st.comm, st.down = st.comm, None, reason
    st.prepared.clear()
    _LIMITS.clear()
    # Close only when every rank holds a Communicator: closing peer buffers is collective, and a
    # rank whose creation failed would never join. Otherwise the references are dropped.
    holds = [None] * dist.get_world_size(st.group.cpu_group)
    dist.all_gather_object(holds, comm is not None, group=st.group.cpu_group)
    if all(holds):
        _attempt(comm.close)
    logger.warning("tpfuse: stands down for %s group %s on every rank: %s; the engine's own path serves it",
                   st.engine, st.group.name, reason)
    return True


# ---- per call: static checks, no communication ------------------------------------------------


def prepared_tokens(names) -> int:
    """The token count every named group was prepared for, for some hidden size and dtype (0 if one
    was not, or stood down). Cached until the next change of any group's state (the gates call it
    for every batch)."""
    key = tuple(names)
    limit = _LIMITS.get(key)
    if limit is None:
        limit = -1
        for name in key:
            st = _STATES.get(name)
            most = 0
            if st is not None and not st.down:
                for tokens in st.prepared.values():
                    most = tokens if tokens > most else most
            limit = most if limit < 0 or most < limit else limit
        limit = _LIMITS[key] = max(limit, 0)
    return limit


def unservable(name: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> str:
    """Why tpfuse cannot serve this call for the group `name` ("" when it can): not set up, stood
    down, or a call of another dtype, hidden size, device or more tokens than were prepared, or a
    residual or weight that does not match `x`. Shapes, dtypes and agreed state only: the same
    answer on every rank, and traceable by torch.compile without a graph break."""
    st = _STATES.get(name)
    if st is None or st.comm is None:
        return st.down if st is not None and st.down else f"group {name} was not prepared"
    hidden = x.shape[-1]
    tokens = x.numel() // hidden if hidden else 0
    limit = st.prepared.get((hidden, x.dtype), 0)
    if limit == 0:
        return f"{str(x.dtype).removeprefix('torch.')} x hidden {hidden} was not prepared"
    if tokens > limit:
        return f"{tokens} tokens exceed the {limit} prepared"
    if x.device.type != st.group.device:
        return f"x is on {x.device.type}, the group's activations on {st.group.device}"
    if residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape):
        return f"residual {str(residual.dtype).removeprefix('torch.')} {tuple(residual.shape)} does not match x"
    if weight.dtype != x.dtype or weight.dim() != 1 or weight.shape[0] != hidden:
        return f"weight {str(weight.dtype).removeprefix('torch.')} {tuple(weight.shape)} does not match x"
    return ""


def register_fallback(engine: str, fallback: Callable) -> None:
    """`fallback(x, residual, weight, eps, group_name)` is `engine`'s own path for the op (its
    allreduce, then its native add + RMSNorm), or None for a group the engine does not know."""
    _FALLBACKS[engine] = fallback


def engine_path(x, residual, weight, eps: float, name: str, why: str):
    """The engine's own path for a call tpfuse does not serve (`why`, logged once per reason)."""
    log_once(f"decline:{name}:{why}", f"tpfuse: group {name}: the engine's own path serves calls that {why}; "
             "tpfuse does not take them", level=logging.WARNING)
    for fallback in _FALLBACKS.values():
        out = fallback(x, residual, weight, eps, name)
        if out is not None:
            return out
    raise RuntimeError(f"tpfuse::engine_all_reduce_residual_rmsnorm: group {name!r} has no Communicator ({why}) "
                       "and no engine plugin registered a fallback for it; set TPFUSE_ENGINES for every worker")


def close_all() -> None:
    """Collective: close every Communicator created here (the engine's cleanup calls it on every rank)."""
    for st in _STATES.values():
        if st.comm is not None:
            st.comm.close()
    _STATES.clear()
    _LIMITS.clear()


# ---- the log line ----------------------------------------------------------------------------


def plan_text(engine: str, group: EngineGroup, comm, hidden: int, dtype: torch.dtype, max_tokens: int) -> str:
    """One line: the strategy of each run of token counts that share strategy and source
    ("measured" for the dispatch table's buckets, else the first bucket's reason). A bucket serves
    every count above the bucket before it (the table's lookup), so the runs cover 1..max_tokens."""
    runs: list[list] = []  # [first, last, name, source, label]
    below = 0
    for tokens in buckets(max_tokens):
        choice = comm.strategy_for(Op.ALL_REDUCE_RESIDUAL_RMSNORM, tokens, hidden, dtype)
        if runs and runs[-1][2:4] == [choice.name, choice.source]:
            runs[-1][1] = tokens
        else:
            runs.append([below + 1, tokens, choice.name, choice.source,
                         "measured" if choice.source == "table" else choice.reason])
        below = tokens
    head = (f"tpfuse: {engine} group {group.name} (world size {comm.world_size}, {comm.facts.backend}, "
            f"{comm.facts.device_type}), allreduce + residual + RMSNorm, hidden {hidden} "
            f"{str(dtype).removeprefix('torch.')}:")
    parts = [f"tokens {a}-{b}: {name} ({label})" if a != b else f"tokens {a}: {name} ({label})"
             for a, b, name, _, label in runs]
    return " ".join([head, "; ".join(parts)])


def buckets(max_tokens: int) -> list[int]:
    """Powers of two below `max_tokens`, then `max_tokens` (the sizes Communicator.prepare covers)."""
    out, tokens = [], 1
    while tokens < max_tokens:
        out.append(tokens)
        tokens *= 2
    return out + [max_tokens]


# ---- the op ----------------------------------------------------------------------------------


@torch.library.custom_op("tpfuse::engine_all_reduce_residual_rmsnorm", mutates_args=())
def engine_all_reduce_residual_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    why = unservable(group_name, x, residual, weight)
    if why:
        return engine_path(x, residual, weight, eps, group_name, why)
    return _STATES[group_name].comm.all_reduce_residual_rmsnorm(x, residual, weight, eps)


@engine_all_reduce_residual_rmsnorm.register_fake
def _(x, residual, weight, eps, group_name):
    return torch.empty_like(x), torch.empty_like(x)
