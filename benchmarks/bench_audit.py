"""Time `fusegate audit` over all of sglang's Python source on one CPU core.

Each repeat runs in a fresh process (no parse cache carried over) pinned to one core with
`os.sched_setaffinity` (the effect of `taskset -c 0`); the child reports wall and CPU seconds of
`fusegate.audit.engine.audit(...)`. Rows go to benchmarks/results/audit.jsonl: op="audit",
strategy="ast", unit="s", median/p20/p80 over the wall times, CPU times and the machine load in
`extra`. The sglang source comes from the same PyPI cache the tests use.

    python benchmarks/bench_audit.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "audit"))  # the PyPI fetch/cache helper shared with the tests

from sglang_source import SGLANG_VERSION, sglang_source  # noqa: E402

from fusegate.bench.results import append_rows, make_row  # noqa: E402

_CHILD = """
import json, os, sys, time
os.sched_setaffinity(0, {int(sys.argv[2])})
from fusegate.audit.engine import audit
from fusegate.audit.arch import parse_arch
t0, c0 = time.perf_counter(), time.process_time()
result = audit(sys.argv[1], native=False)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"wall": wall, "cpu": cpu, "py_files": len(result.target.python_files), "scanned": result.files_scanned,
                  "findings": len(result.findings), "gates_sm120": len(result.selected(parse_arch("sm120"))),
                  "skipped": len(result.skipped)}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--core", type=int, default=0, help="CPU core to pin the audit to")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "audit.jsonl"))
    args = parser.parse_args()
    source, why = sglang_source()
    if source is None:
        print(f"bench_audit: sglang {SGLANG_VERSION} source unavailable ({why}); connect to PyPI and retry", file=sys.stderr)
        return 2
    runs = []
    for i in range(args.repeats):
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(source), str(args.core)], capture_output=True, text=True, check=True)
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        run["load1"] = os.getloadavg()[0]
        runs.append(run)
        print(f"run {i + 1}/{args.repeats}: wall {run['wall']:.2f} s, cpu {run['cpu']:.2f} s, load {run['load1']:.1f}")
    nbytes = sum(p.stat().st_size for p in source.rglob("*.py"))
    row = make_row(
        "audit", "ast", {"target": f"sglang=={SGLANG_VERSION}", "py_files": runs[0]["py_files"], "py_bytes": nbytes},
        "python-source", 1, [r["wall"] for r in runs], "s",
        cores=1, cpu_s=[round(r["cpu"], 3) for r in runs], load1=[round(r["load1"], 2) for r in runs],
        scanned=runs[0]["scanned"], findings=runs[0]["findings"], gates_false_on_sm120=runs[0]["gates_sm120"],
        nproc=os.cpu_count(),
    )
    append_rows(args.out, [row])
    print(f"audit of sglang {SGLANG_VERSION} ({runs[0]['py_files']} .py files, {nbytes / 1e6:.1f} MB) on 1 core: "
          f"median {row.median:.2f} s wall (p20 {row.p20:.2f}, p80 {row.p80:.2f}); cpu {sorted(r['cpu'] for r in runs)[len(runs) // 2]:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
