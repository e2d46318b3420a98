"""Candidates for one problem: the admitted strategies, their instances, and their timed calls.

`CandidatePool` creates each strategy instance once for a whole tune or verify run (bound to the
caller's group), prepares it before timing it (for every hidden size; tune: bucket by bucket), and
closes them all in registry order at the end (close may be collective for strategies holding peer
buffers, so every rank closes the same instances in the same order).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tpfuse.group import agree_group_facts, device_type_of
from tpfuse.probe import probe
from tpfuse.reference import random_inputs
from tpfuse.spec import Op, Problem, Verdict
from tpfuse.strategies import admission, get_strategy
from tpfuse.strategies.base import Strategy, StrategyContext


def admitted(problem: Problem, caps, names: list[str] | None = None) -> tuple[list[str], dict[str, Verdict]]:
    """(admitted names in registry order, every verdict) for `problem`."""
    verdicts = admission(problem, caps, names)
    return [n for n, v in verdicts.items() if v.ok], verdicts


class CandidatePool:
    def __init__(self, *, group, rank: int, world_size: int, facts, caps, device: torch.device,
                 options: dict | None = None) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.facts, self.caps, self.device = facts, caps, device
        self._ctx = StrategyContext(group=group, rank=rank, world_size=world_size, facts=facts,
                                    caps=caps, device=device, options=dict(options or {}))
        self._instances: dict[tuple[str, bool], Strategy] = {}  # (name, twin) -> instance
        self._prepared: set[tuple] = set()
        self.setup_s = 0.0

    @classmethod
    def for_group(cls, group=None, *, device=None, options: dict | None = None, handshake_group=None) -> CandidatePool:
        """Collective: a pool bound to `group` (default WORLD) with its agreed facts and this rank's
        probe. `device`: where tensors live (default: CUDA for NCCL groups, else CPU).
        `handshake_group`: where the facts are agreed (default `group`; an engine's gloo group)."""
        import torch.distributed as dist


        group = group if group is not None else dist.group.WORLD
        device_type = torch.device(device).type if device is not None else device_type_of(group)
        dev = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        caps = probe()
        facts = agree_group_facts(group, caps, device_type=device_type, handshake_group=handshake_group)
        return cls(group=group, rank=dist.get_rank(group), world_size=dist.get_world_size(group), facts=facts,
                   caps=caps, device=dev, options=options)

    def get(self, name: str, *, hidden: int, dtype: torch.dtype, max_tokens: int,
            buckets: tuple[int, ...] | None = None, op: Op | None = None, twin: bool = False) -> Strategy:
        """The instance of `name`, prepared for calls of up to `max_tokens`; with `buckets`, for
        calls of those token counts only, of `op` only when given (`Strategy.prepare_buckets`), so
        that a tune sets up only the buckets and the op it measures. `twin`: a second, separate
        instance of `name` (verify's A-vs-A control: two instances of one strategy, timed like two
        strategies). The seconds spent creating and preparing instances add up in `setup_s`."""
        started = time.perf_counter()
        try:
            slot = (name, twin)
            instance = self._instances.get(slot)
            if instance is None:
                instance = self._instances[slot] = get_strategy(name)(self._ctx)
            per_bucket = buckets is not None and type(instance).prepare_buckets is not Strategy.prepare_buckets
            key = (slot, hidden, dtype, max_tokens) + ((tuple(buckets), op) if per_bucket else (None, None))
            if key not in self._prepared:
                if per_bucket:
                    instance.prepare_buckets(hidden=hidden, dtype=dtype, max_tokens=max_tokens, buckets=tuple(buckets),
                                             op=op)
                else:
                    instance.prepare(hidden=hidden, dtype=dtype, max_tokens=max_tokens)
                self._prepared.add(key)
            return instance
        finally:
            self.setup_s += time.perf_counter() - started

    def close(self) -> None:
        for instance in self._instances.values():
            instance.close()
        self._instances.clear()


def timed_call(instance: Strategy, op: Op, *, rank: int, num_tokens: int, hidden: int, dtype: torch.dtype,
               device: torch.device) -> Callable[[], object]:
    """A no-argument call of `op` on fixed random inputs (never zeros) of this rank."""
    x = random_inputs(rank, num_tokens, hidden, dtype, seed=21, device=device)
    if op == Op.ALL_REDUCE:
        return lambda: instance.all_reduce(x)
    residual = random_inputs(10_000, num_tokens, hidden, dtype, seed=22, device=device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(23))).to(dtype).to(device)
    return lambda: instance.all_reduce_residual_rmsnorm(x, residual, weight, 1e-6)
