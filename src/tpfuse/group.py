"""Agreeing on a process group's facts once, so that every rank admits and chooses alike.

`agree_group_facts` runs one all_gather_object at Communicator construction (a collective: every
rank of the group must call it). Each rank reports its host, its device and which of the other
ranks' GPUs it can map; the result is identical on every rank.

`expected_group_facts` applies the same rules to the probe instead of to ranks: the GroupFacts that
local ranks launched a given way would agree on, known before any rank exists (the CLI's checks
before spawning; `representative_problem` for `tpfuse doctor`).

`agree_settings` runs first: the Communicator's own settings (strategy, debug, device) must be the
same on every rank, because ranks that differ would run different collectives and hang. A mismatch,
or a setting one rank could not read (a bad TPFUSE_* value), raises the same ValueError on every
rank, naming the ranks, instead of raising on one rank and leaving the others waiting.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from tpfuse.spec import GroupFacts, Op, Problem


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def agree_settings(group, where: str, settings: dict, problem: str = "", *, fixes: dict[str, str]) -> None:
    """Collective: return if every rank passed equal `settings` and no `problem`, else raise
    ValueError on every rank. `problem`: why this rank could not read its settings ("" if none);
    `fixes[key]`: what to do when ranks disagree on `key`."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (settings, problem), group=group)
    problems: dict[str, list[int]] = {}
    for rank, (_, text) in enumerate(everyone):
        if text:
            problems.setdefault(text, []).append(rank)
    if problems:
        if len(problems) == 1 and len(next(iter(problems.values()))) == len(everyone):
            raise ValueError(f"{where}: {next(iter(problems))}")
        raise ValueError(f"{where}: " + "; ".join(f"on {_ranks(r)}: {t}" for t, r in problems.items()))
    for key in settings:
        by_value: dict[str, list[int]] = {}
        for rank, (theirs, _) in enumerate(everyone):
            by_value.setdefault(repr(theirs[key]), []).append(rank)
        if len(by_value) > 1:
            detail = "; ".join(f"{_ranks(r)}: {value}" for value, r in by_value.items())
            raise ValueError(f"{where}: ranks disagree on {key} ({detail}); {fixes[key]}")


def _local_uuid(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"{socket.gethostname()}:cuda{index}"


def _peer_row(my_index: int, uuids: list[str]) -> list[bool]:
    """For every rank's GPU UUID: can this process's GPU map its memory?"""
    visible = {_local_uuid(i): i for i in range(torch.cuda.device_count())}
    row = []
    for uuid in uuids:
        other = visible.get(uuid)
        if other is None:
            row.append(False)  # not visible from this process: no mapping possible
        elif other == my_index:
            row.append(True)  # the same GPU: its own memory
        else:
            row.append(bool(torch.cuda.can_device_access_peer(my_index, other)))
    return row


def device_type_of(group) -> str:
    backend = str(dist.get_backend(group)).lower()
    return "cuda" if "nccl" in backend else "cpu"


def agree_group_facts(group, caps=None, *, device_type: str | None = None, handshake_group=None) -> GroupFacts:
    """Collective: the GroupFacts of `group`, identical on every rank.

    `device_type` defaults to "cuda" for NCCL groups and "cpu" otherwise; "cuda" with a gloo
    group describes ranks that hold CUDA tensors but talk over gloo (e.g. sharing one GPU).
    `handshake_group` (default `group`): where the object collectives run, e.g. an engine's gloo
    group of the same ranks; the facts (backend, devices) are still those of `group`."""
    world_size = dist.get_world_size(group)
    backend = str(dist.get_backend(group)).lower()
    device_type = device_type or device_type_of(group)
    if handshake_group is None:
        handshake_group = group
    elif dist.get_process_group_ranks(handshake_group) != dist.get_process_group_ranks(group):
        raise ValueError(
            "Communicator: cpu_group has other ranks than group "
            f"({dist.get_process_group_ranks(handshake_group)} vs {dist.get_process_group_ranks(group)}); "
            "pass the CPU group created together with the device group"
        )
    host = socket.gethostname()
    if device_type == "cuda":
        index = torch.cuda.current_device()
        me = {"host": host, "device": _local_uuid(index), "index": index}
    else:
        me = {"host": host, "device": "cpu", "index": -1}
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, me, group=handshake_group)
    hosts = {e["host"] for e in everyone}
    devices = tuple(e["device"] for e in everyone)
    peer_access = False
    native_atomics = False
    if device_type == "cuda" and len(hosts) == 1:
        rows: list = [None] * world_size
        dist.all_gather_object(rows, _peer_row(me["index"], list(devices)), group=handshake_group)
        peer_access = all(all(row) for row in rows)
        native_atomics = peer_access and _all_native_atomics(caps, [e["index"] for e in everyone])
    return GroupFacts(
        world_size=world_size,
        backend=backend,
        device_type=device_type,
        num_hosts=len(hosts),
        devices=devices,
        peer_access=peer_access,
        native_atomics=native_atomics,
        shares_device=device_type == "cuda" and len(set(devices)) < world_size,
    )


def _all_native_atomics(caps, indices: list[int]) -> bool:
    if caps is None:
        return False
    for a in set(indices):
        for b in set(indices):
            if a == b:
                continue
            link = caps.link(a, b)
            if link is None or not link.native_atomics:
                return False
    return True


def expected_group_facts(caps, world_size: int, *, backend: str, device_type: str) -> GroupFacts:
    """The GroupFacts `world_size` local ranks would agree on here (the rules of `agree_group_facts`,
    computed from the probe `caps` instead of from ranks): gloo CPU ranks when `device_type` is
    "cpu", gloo ranks sharing GPU 0 for ("gloo", "cuda"), else NCCL over the first `world_size` GPUs."""
    if device_type == "cpu":
        return GroupFacts(world_size=world_size, backend="gloo", device_type="cpu", devices=("cpu",) * world_size)
    if backend == "gloo":  # ranks sharing GPU 0
        gpu = caps.gpus[0]
        return GroupFacts(world_size=world_size, backend="gloo", device_type="cuda",
                         devices=(gpu.uuid or "cuda0",) * world_size, peer_access=True, native_atomics=True,
                         shares_device=world_size > 1)
    gpus = caps.gpus[:world_size]
    pairs = [caps.link(a.index, b.index) for a in gpus for b in gpus if a.index != b.index]
    peer = all(link is not None and link.peer_access for link in pairs)
    atomics = peer and all(link.native_atomics for link in pairs)
    return GroupFacts(world_size=world_size, backend="nccl", device_type="cuda",
                     devices=tuple(g.uuid or f"cuda{g.index}" for g in gpus), peer_access=peer, native_atomics=atomics)


def representative_problem(op: Op, num_tokens: int, hidden: int, dtype: str, caps, *, world_size: int, backend: str,
                           device_type: str, quant: str | None = None) -> Problem:
    """The Problem a call of `op` on `world_size` local ranks launched this way would pose here, with
    the group they would agree on (`expected_group_facts`): what admission is asked about before any
    rank exists."""
    if device_type == "cuda" and backend == "nccl" and world_size > len(caps.gpus):
        raise ValueError(f"representative_problem: {world_size} NCCL ranks need as many GPUs, the probe found "
                         f"{len(caps.gpus)}; use world_size <= {len(caps.gpus)} or gloo ranks sharing a GPU")
    facts = expected_group_facts(caps, world_size, backend=backend, device_type=device_type)
    return Problem(op, num_tokens, hidden, dtype, facts, has_residual=op is Op.ALL_REDUCE_RESIDUAL_RMSNORM,
                   quant=quant)
