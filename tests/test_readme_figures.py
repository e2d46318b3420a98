"""The README's figures come from the rows they name: each is rebuilt here from its rows file and run,
so a figure and its source cannot drift apart (a new run changes the README through its rows)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RESULTS = ROOT / "benchmarks" / "results"


def _rows(name: str, date_prefix: str) -> list[dict]:
    rows = [json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line.strip()]
    return [r for r in rows if r["date"].startswith(date_prefix)]


def test_the_h200_peer_kernel_table_is_the_1219_run():
    rows = _rows("peer_kernels_emulated.jsonl", "2026-12-01T12:19")
    steady = {(r["strategy"], r["world_size"], r["shape"]["tokens"]): r["median"] for r in rows
              if r["op"] == "all_reduce_residual_rmsnorm" and r["extra"].get("mode") == "steady"
              and not r["extra"].get("chunk_forced") and r["shape"]["hidden"] == 6144 and r["dtype"] == "bfloat16"
              and r["extra"].get("valid")}
    columns = [("oneshot", 1), ("oneshot", 2), ("oneshot", 4), ("oneshot", 8), ("twoshot", 2), ("twoshot", 8)]
    table = ["| tokens | oneshot W=1 | W=2 | W=4 | W=8 | twoshot W=2 | W=8 |", "|---|---|---|---|---|---|---|"]
    table += [f"| {t} | " + " | ".join(f"{steady[(s, w, t)]:.2f}" for s, w in columns) + " |" for t in (1, 16, 64)]
    assert "\n".join(table) in README
    empty = {r["world_size"]: r["median"] for r in rows if r["op"] == "empty_kernel"}
    epilogue = next(r["median"] for r in rows if r["op"] == "residual_rmsnorm" and r["shape"]["tokens"] == 1)
    assert (f"an empty kernel in the same stream structure {empty[1]:.2f} (W=1) to {empty[8]:.2f} us\n(W=8), the "
            f"epilogue alone {epilogue:.2f} us (1 token)") in README
    later = [r["median"] for r in _rows("peer_kernels_emulated.jsonl", "2026-12-01T1")
             if r["date"] >= "2026-12-01T13:59" and r["op"] == "all_reduce_residual_rmsnorm"
             and r["strategy"] == "oneshot" and r["world_size"] == 8 and r["shape"] == {"hidden": 6144, "tokens": 1}
             and r["extra"].get("mode") == "steady" and not r["extra"].get("chunk_forced") and r["dtype"] == "bfloat16"]
    assert f"{min(later):.2f} to {max(later):.2f} us\nfor W=8 at one token" in README


def _wall(argv: list[str]) -> dict:
    (row,) = [r for r in _rows("cli_cpu.jsonl", "2026-12-01T23:1") if r["op"] == "cli_wall_time"
              and r["shape"]["argv"] == argv]
    return row


def test_the_cpu_command_times_are_the_rows_of_2026_12_01():
    text = " ".join(README.split())
    usage = [r for r in _rows("cli_cpu.jsonl", "2026-12-01T23:12") if r["extra"]["group"] == "usage"]
    low, high = min(r["p20"] for r in usage), max(r["p80"] for r in usage)
    assert f"({low:.2f} to {high:.2f} s from a fresh interpreter on a 2-core CPU machine, 2026-12-01" in text
    tune = _wall(["tune", "--preset", "glm5", "--max-tokens", "1024"])
    assert f"`doctor` printed its tables in {_wall(['doctor'])['median']:.1f} s" in text
    assert (f"in {tune['median']:.1f} s ({tune['p20']:.1f} to {tune['p80']:.1f} s, load 2 to 4)") in text
    verify = _wall(["verify", "--strategy", "oneshot", "--preset", "glm5"])
    audit = _wall(["audit", "sglang", "--arch", "sm120", "--like", "sm100"])
    assert f"exited 2 in {verify['median']:.2f} s" in text and f"`audit` exited 2 in {audit['median']:.2f} s" in text
    steps = {r["shape"]["step"]: r["median"] for r in _rows("cli_cpu.jsonl", "2026-12-01T23:18")
             if r["op"] == "setup_step_wall_time"}
    assert (f"in {sum(steps.values()):.0f} s on 2026-12-01 at load 2.9 (venv {steps['venv']:.1f} s, torch "
            f"{steps['torch']:.1f} s, `pip install .` {steps['pip install .']:.1f} s, "
            f"selftest {steps['selftest']:.1f} s;") in text
