"""All ranks use the same dispatch table or none: the digest agreement at Communicator construction.

Collective: every rank of the group calls `agreed_table` once (the Communicator does, in its
constructor, which is already a collective). Each rank loads the table for its own fingerprint
from its own cache directory (ranks on other hosts have other caches); the ranks then gather the
digests. Only if every rank holds a valid, current table with the same digest is it used; in every
other case (a rank without a table, a corrupt or stale file on one rank, different tunings) every
rank falls back to the conservative default together, so no two ranks can pick different
strategies for the same call. Reading the file never raises (`table.load` turns every decode,
schema and I/O problem into a reason), and even an unexpected error becomes this rank's reason, so
no rank can skip the gather and leave the others waiting in it.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from tpfuse.dispatch.table import DispatchTable, fingerprint, load, table_path, versions_of


def agreed_table(group, facts, caps, *, path: str | Path | None = None) -> tuple[DispatchTable | None, str]:
    """(table, "") when every rank holds the same valid table, else (None, why) on every rank."""
    try:
        fp = fingerprint(facts, caps)
        where = Path(path) if path is not None else table_path(fp)
        table, why = load(where, fp, versions_of(caps))
    except Exception as exc:  # noqa: BLE001 - a rank that raised here would leave its peers in the gather below
        table, why = None, f"could not load the dispatch table: {type(exc).__name__}: {exc}"
    mine = (table.digest if table is not None else None, why)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    digests = [d for d, _ in everyone]
    if digests[0] is not None and all(d == digests[0] for d in digests):
        return table, ""
    if all(d is None for d in digests):
        reasons = sorted({w for _, w in everyone})
        return None, "; ".join(reasons)
    detail = ", ".join(f"rank {r}: {d[:12] if d else 'none (' + w + ')'}" for r, (d, w) in enumerate(everyone))
    return None, f"ranks hold different dispatch tables ({detail}); every rank uses the conservative default"
