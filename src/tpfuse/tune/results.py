"""Benchmark rows (`tpfuse.results`) from what tune and verify measured.

Every figure that tune or verify prints can be kept as rows in `benchmarks/results/*.jsonl`
(`--results PATH` on both commands): one row per (bucket, strategy) with the median, p20 and p80
over timed calls (each call's time already the maximum over ranks), in microseconds.
"""

from __future__ import annotations

import dataclasses

from tpfuse.results import ResultRow, make_row


def _row(op, strategy, shape, dtype, world_size, stats, **extra) -> ResultRow:
    row = make_row(op, strategy, shape, dtype, world_size, [float(stats["median"])], "us", **extra)
    return dataclasses.replace(row, p20=float(stats["p20"]), p80=float(stats["p80"]))


def rows_from_table(table, *, backend: str, device: str) -> list[ResultRow]:
    rows = []
    world_size = table.fingerprint.get("world_size", 0)
    for e in table.entries:
        for phase, times in (("first", e.times_us), ("confirm", e.confirmed_us)):
            for name, stats in times.items():
                rows.append(_row(e.op, name, {"tokens": e.tokens, "hidden": e.hidden}, e.dtype, world_size, stats,
                                 source="tpfuse tune", phase=phase, chosen=name == e.choice, n=stats.get("n"),
                                 backend=backend, device=device, shares_device=table.fingerprint.get("shares_device")))
    return rows


def rows_from_verify(report: dict) -> list[ResultRow]:
    rows = []
    for b in report["buckets"]:
        if b["candidate_us"] != b["candidate_us"]:  # nan: not timed (failed correctness or admission)
            continue
        for role, name, stats in (("candidate", report["strategy"], b["candidate_stats"]),
                                  ("baseline", report["baseline"], b["baseline_stats"])):
            rows.append(_row(b["op"], name, {"tokens": b["tokens"], "hidden": b["hidden"]}, report["dtype"],
                             report["world_size"], stats, source="tpfuse verify", role=role, verdict=b["verdict"],
                             ratio=b["ratio"], threshold=b["threshold"], n=stats.get("n"), backend=report["backend"],
                             device=report["device"]))
    return rows
