"""The engines' start-up calibration: a fused kernel from the first start, without `tpfuse tune` first.

When a group's agreed dispatch table lacks some of the engine's captured token counts for the
model's hidden size and dtype, `calibrate` measures those buckets in the engine's warm-up, on every
rank of the group (`tpfuse.tune.tuner.tune_in_group` on the engine's groups: data and timing on
the device group, handshakes on the CPU group), smallest first, within the TPFUSE_CALIBRATE budget
(default 15 s), with the same do-no-harm rule as `tpfuse tune` (a fused strategy only where it
beats the best unfused one by the margin). The buckets measured are merged into the table saved
for this machine (`tpfuse.dispatch.table.save_merged`), which the Communicator
is then rebuilt on, and which the next start loads without measuring; buckets the budget did not
reach use the conservative default now and are measured at the next start.

Collective: every rank of the group calls it with the same arguments; every decision (whether to
calibrate, the budget, whether the cache is writable, when to stop) is agreed across ranks, so all
ranks run the same collectives. An error raises; the caller (`runtime.prepare`) agrees it and
stands down.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from tpfuse import env
from tpfuse.dispatch.table import CacheDirError, check_writable, save_merged, table_path
from tpfuse.integrations.log import log_once, logger
from tpfuse.spec import Op
from tpfuse.tune.tuner import TuneSpec, tune_in_group

# Samples per candidate at start-up: half of `tpfuse tune`'s defaults (20 first pass, 40
# confirmation), so the budget reaches more buckets; the deciding rule and margin are tune's.
ROUNDS, CONFIRM_ROUNDS, WARMUP = 10, 20, 2
OP = Op.ALL_REDUCE_RESIDUAL_RMSNORM


def missing_buckets(table, hidden: int, dtype: torch.dtype, buckets: tuple[int, ...]) -> list[int]:
    """The token counts of `buckets` that `table` (None: no table) has no entry of their own for."""
    name = str(dtype).removeprefix("torch.")
    have = set() if table is None else {e.tokens for e in table.entries
                                        if e.op == OP.value and e.dtype == name and e.hidden == hidden}
    return sorted({b for b in buckets if b not in have})


def _agreed_budget(group) -> float | None:
    """Collective on the CPU group: every rank's TPFUSE_CALIBRATE budget, the same on every rank,
    else ValueError on every rank naming the ranks that could not read it or that differ."""
    try:
        mine = (env.calibrate_budget_s(), "")
    except ValueError as exc:
        mine = (None, str(exc))
    everyone: list = [None] * dist.get_world_size(group.cpu_group)
    dist.all_gather_object(everyone, mine, group=group.cpu_group)
    problems = [f"rank {r}: {p}" for r, (_, p) in enumerate(everyone) if p]
    if problems:
        raise ValueError("; ".join(problems))
    if any(b != everyone[0][0] for b, _ in everyone):
        raise ValueError("calibrate: ranks disagree on TPFUSE_CALIBRATE (" + ", ".join(
            f"rank {r}: {b}" for r, (b, _) in enumerate(everyone)) + "); set it the same for every worker")
    return everyone[0][0]


def calibrate(engine: str, group, comm, *, hidden: int, dtype: torch.dtype, buckets: tuple[int, ...],
              new_communicator):
    """Collective: measure the `buckets` the agreed table of `comm` lacks and return the Communicator
    rebuilt on the saved table (`new_communicator(group)`), or None when nothing was measured
    (nothing missing, an explicit strategy, TPFUSE_CALIBRATE=0, a cache directory that cannot be
    written). Logs the budget in one line before measuring and the outcome in one after."""
    missing = missing_buckets(comm.table, hidden, dtype, buckets)
    if not missing or comm.requested != "auto":  # both agreed by the Communicator's construction
        return None
    budget = _agreed_budget(group)
    shape = f"hidden {hidden} {str(dtype).removeprefix('torch.')}"
    if budget is None:
        log_once(f"calibrate-off:{group.name}", f"tpfuse: {engine} group {group.name}: calibration off "
                 f"(TPFUSE_CALIBRATE=0); {len(missing)} token bucket(s) of {shape} use the conservative default")
        return None

    try:
        check_writable(env.cache_dir())
        unwritable = ""
    except CacheDirError as exc:
        unwritable = str(exc)
    everyone: list = [None] * dist.get_world_size(group.cpu_group)
    dist.all_gather_object(everyone, unwritable, group=group.cpu_group)
    if any(everyone):
        log_once(f"calibrate-ro:{group.name}", f"tpfuse: {engine} group {group.name}: not calibrating, the dispatch "
                 f"table could not be saved ({next(w for w in everyone if w)}); the conservative default serves",
                 level=logging.WARNING)
        return None

    logger.info("tpfuse: calibrating %s group %s for %s at %d token bucket(s) (%s) within a %g s budget; "
                "TPFUSE_CALIBRATE=0 turns it off", engine, group.name, shape, len(missing),
                ", ".join(map(str, missing)), budget)
    started = time.perf_counter()
    spec = TuneSpec(hiddens=(hidden,), buckets=tuple(missing), dtype=str(dtype).removeprefix("torch."),
                    ops=(OP.value,), rounds=ROUNDS, confirm_rounds=CONFIRM_ROUNDS, warmup=WARMUP, budget_s=budget)
    measured = tune_in_group(spec, group=group.device_group, handshake_group=group.cpu_group, device=group.device)
    path = table_path(measured.fingerprint)
    # Every rank saves the same bytes (ranks of one host share the file; save_merged locks and
    # re-reads it) to the path its next start loads; without an agreed table the file on disk was
    # not used: replace it (a file that is not a current table is kept aside, never overwritten).
    table = save_merged(measured, path, fresh=comm.table is None).table
    dist.barrier(group=group.cpu_group)
    comm.close()
    rebuilt = new_communicator(group)
    if rebuilt.table is None or rebuilt.table.digest != table.digest:
        raise RuntimeError(f"calibrate: the table saved to {path} did not load on every rank ({rebuilt.table_note}); "
                           "check that every rank's TPFUSE_CACHE_DIR is writable")
    done = sorted(e.tokens for e in measured.entries)
    left = [b for b in missing if b not in done]
    logger.info("tpfuse: calibrated %s group %s: %d of %d bucket(s) in %.1f s, saved to %s%s", engine, group.name,
                len(done), len(missing), time.perf_counter() - started, path,
                f"; the budget ran out before {', '.join(map(str, left))} (conservative default now, measured at the "
                "next start)" if left else "")
    return rebuilt
