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


def _cell(rows: list[dict], strategy: str, world: int, tokens: int) -> str:
    """One cell of the table: a one-token oneshot as a one-rank-per-GPU deployment runs it (entry
    trigger, per-thread spins), two-shot as the strategy's rule cuts it (whole rows from 32 tokens a
    rank) where both cuts were measured; "(whole rows)" marks a two-shot figure taken with whole rows."""
    found = [r for r in rows if r["strategy"] == f"{strategy}_emulated" and r["world_size"] == world
             and r["shape"]["tokens"] == tokens]
    if not found:
        return ""
    if len(found) > 1:
        deployed = [r for r in found if r["extra"]["suite_case"] == "pdl2_spin2"]
        ruled = [r for r in found if r["extra"]["rows_owned"] == (tokens // world >= 32)]
        (found,) = (deployed or ruled,)
    (row,) = found
    return f"{row['median']:.2f}" + (" (whole rows)" if row["extra"]["rows_owned"] else "")


def test_the_h200_peer_kernel_table_is_the_v3_run():
    rows = [r for r in _rows("peer_kernels_v3_emulated.jsonl", "2026-12-01T22:54") if r["extra"].get("valid", True)]
    steady = [r for r in rows if r["op"] == "all_reduce_residual_rmsnorm" and r["extra"]["mode"] == "steady"
              and r["extra"]["suite_case"] != "alternating" and r["shape"]["hidden"] == 6144]
    columns = [("oneshot", 1), ("oneshot", 2), ("oneshot", 4), ("oneshot", 8), ("twoshot", 2), ("twoshot", 8)]
    table = ["| tokens | oneshot W=1 | W=2 | W=4 | W=8 | twoshot W=2 | W=8 |", "|---|---|---|---|---|---|---|"]
    table += ["| " + " | ".join([str(t)] + [_cell(steady, s, w, t) for s, w in columns]) + " |" for t in (1, 16, 64, 256)]
    assert "\n".join(table) in README
    text = " ".join(README.split())
    shared = {r["world_size"]: r["median"] for r in steady if r["extra"]["suite_case"] == "pdl1_spin2"}
    assert f"oneshot 1 token W=1 {shared[1]:.2f}, W=8 {shared[8]:.2f}" in text
    empty = {r["world_size"]: r["median"] for r in rows if r["op"] == "empty_kernel"}
    epilogue = next(r["median"] for r in rows if r["op"] == "residual_rmsnorm" and r["shape"]["tokens"] == 1)
    assert (f"an empty kernel in the same stream structure {empty[1]:.2f} (W=1) to {empty[8]:.2f} us (W=8), the "
            f"epilogue alone {epilogue:.2f} us (1 token)") in text
    alternating = {(r["strategy"], r["shape"]["tokens"]): r["median"] for r in rows
                   if r["extra"].get("suite_case") == "alternating"}
    ratios = [alternating[(s, "128,1")] / ((alternating[(s, 128)] + alternating[(s, 1)]) / 2)
              for s in ("oneshot_emulated", "twoshot_emulated")]
    assert f"cost {min(ratios):.2f}-{max(ratios):.2f}x the same calls in steady state" in text


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
