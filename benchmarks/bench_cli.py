"""Wall time of the README's commands, each from a fresh interpreter to its exit, as a user runs them.

    python benchmarks/bench_cli.py --out benchmarks/results/cli_cpu.jsonl          # every group
    python benchmarks/bench_cli.py --group usage --repeats 5 --out /tmp/cli.jsonl  # usage errors only

Groups: `usage` (usage and environment errors the README says answer in well under a second,
before any rank starts or torch is imported), `change` (the lines of "A change, checked the way it
should be", with tune writing into a fresh cache directory), `setup` (the main set-up command's
selftest), `first-result` (the whole main set-up command in a fresh venv with pip's cache off,
step by step: `benchmarks/device/time_to_first_result.sh`, one row per step, op
`setup_step_wall_time`). One row per command: op `cli_wall_time`, the command line in `shape.argv`, its exit
code and whether it printed a traceback in `extra`, and the machine's load average when it
started (the 2-core CI machine is shared: a figure says under what load it was taken). A command
that exits with an unexpected code fails the benchmark, so a figure never times the wrong outcome.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tpfuse.results import append_rows, make_row

ROOT = Path(__file__).resolve().parents[1]

# (group, argv, expected exit code)
COMMANDS = [
    ("usage", ["selftest", "--world-size", "0"], 2),
    ("usage", ["selftest", "--strategy", "oneshot"], 2),
    ("usage", ["selftest", "--device", "cpu", "--shared-gpu"], 2),
    ("usage", ["selftest", "--tokens", "100000"], 2),
    ("usage", ["tune", "--preset", "glm5", "--max-tokens", "100000000"], 2),
    ("usage", ["tune", "--preset", "glm5", "--results", "/proc/x.jsonl"], 2),
    ("usage", ["bench", "e2e", "--preset", "glm5"], 2),
    ("usage", ["bench", "e2e", "--strategy", "oneshot"], 2),
    ("change", ["doctor"], 0),
    ("change", ["tune", "--preset", "glm5", "--max-tokens", "1024"], 0),
    ("change", ["verify", "--strategy", "oneshot", "--preset", "glm5"], 2),
    ("change", ["audit", "sglang", "--arch", "sm120", "--like", "sm100"], 2),
    ("setup", ["selftest", "--world-size", "2"], 0),
]


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def time_command(argv: list[str], expected: int, cache_dir: str) -> tuple[float, int, bool, float | None]:
    """(seconds, exit code, traceback printed?, 1-minute load average at the start) of one run."""
    env = {**os.environ, "TPFUSE_CACHE_DIR": cache_dir, "PYTHONPATH": str(ROOT / "src") + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    load = load_average()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tpfuse", *argv], env=env, capture_output=True, text=True,
                          timeout=1800)
    seconds = time.perf_counter() - start
    if proc.returncode != expected:
        raise SystemExit(f"bench_cli: `tpfuse {' '.join(argv)}` exited {proc.returncode}, not {expected}:\n"
                         f"{proc.stderr[-2000:]}")
    return seconds, proc.returncode, "Traceback" in proc.stderr, load


def first_result_rows() -> list:
    """One row per step of the README's main set-up command, from time_to_first_result.sh's last lines."""
    load = load_average()
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "device" / "time_to_first_result.sh")],
                          capture_output=True, text=True, timeout=1800)
    steps = re.findall(r"(venv|torch|pip install \.|selftest) ([\d.]+) s", proc.stdout)
    if proc.returncode != 0 or len(steps) != 4:
        raise SystemExit(f"bench_cli: time_to_first_result.sh failed:\n{proc.stdout[-1000:]}{proc.stderr[-1000:]}")
    rows = [make_row("setup_step_wall_time", "tpfuse", {"step": step}, "-", 2 if step == "selftest" else 0,
                     [float(seconds)], "s", load_average=[load], pip_cache="off", cores=os.cpu_count())
            for step, seconds in steps]
    print(proc.stdout.strip().splitlines()[-2])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group", action="append", choices=("usage", "change", "setup", "first-result"),
                   help="only these groups (repeatable; default all)")
    p.add_argument("--repeats", type=int, default=1, help="runs per command (default 1)")
    p.add_argument("--out", default="benchmarks/results/cli_cpu.jsonl")
    args = p.parse_args(argv)
    rows = []
    for group, command, expected in COMMANDS:
        if args.group and group not in args.group:
            continue
        samples, loads, tracebacks = [], [], False
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as cache:  # tune measures and saves afresh every run
                seconds, code, traceback, load = time_command(command, expected, cache)
            samples.append(seconds)
            loads.append(load)
            tracebacks |= traceback
        ranks = 2 if command[0] in ("tune", "selftest") and expected == 0 else 0  # the ranks it spawned here
        rows.append(make_row("cli_wall_time", "tpfuse", {"argv": command}, "-", ranks, samples, "s", group=group,
                             exit_code=expected, traceback=tracebacks, load_average=loads, cores=os.cpu_count()))
        print(f"{group:6} {samples[len(samples) // 2]:7.2f} s  exit {expected}  tpfuse {' '.join(command)}")
    if not args.group or "first-result" in args.group:
        rows += first_result_rows()
    append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
