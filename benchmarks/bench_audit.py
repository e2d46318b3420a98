"""Time `tpfuse audit` / `patch` over sglang's Python source on one CPU core; score the corpus.

Each repeat runs `python -m tpfuse.cli audit <sglang> --arch sm120 --like sm100 --json
--no-native` as a fresh process pinned to one core (`os.sched_setaffinity`, the effect of
`taskset -c 0`) and measures what a user waits for: wall time from spawn to process exit
(interpreter start-up and teardown included) and the peak resident set (`ru_maxrss` of the
child). `--patch` times `tpfuse patch` (dry run) the same way. Rows go to
benchmarks/results/audit.jsonl: op="audit"/"patch", strategy="cli", unit="s", median/p20/p80 over
the wall times, RSS and CPU in `extra`. `--corpus` scores the labelled corpus
(tests/audit/corpus) and appends op="audit-corpus" rows (unit "recall" / "precision").

    python benchmarks/bench_audit.py --repeats 5 [--patch] [--corpus] [--version 0.5.23]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the PyPI fetch/cache helper and the corpus harness shared with the tests

from audit.sglang_source import SGLANG_VERSION, sglang_source  # noqa: E402
from tpfuse.results import append_rows, make_row  # noqa: E402


def _timed(cmd: list, core: int) -> dict:
    """Wall seconds to exit, peak RSS (MB) and CPU seconds of one child process on `core`."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"bench_audit: {' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-500:]}")
    return {"wall": wall, "rss_mb": after.ru_maxrss / 1024,
            "cpu": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "stdout": proc.stdout, "load1": os.getloadavg()[0]}


def bench_cli(command: str, source: Path, version: str, repeats: int, core: int) -> object:
    cmd = [sys.executable, "-m", "tpfuse.cli", command, str(source), "--arch", "sm120", "--like", "sm100", "--json"]
    if command == "audit":
        cmd.append("--no-native")
    runs = []
    for i in range(repeats):
        run = _timed(cmd, core)
        runs.append(run)
        print(f"{command} run {i + 1}/{repeats}: wall {run['wall']:.2f} s to exit, cpu {run['cpu']:.2f} s, "
              f"peak RSS {run['rss_mb']:.0f} MB, load {run['load1']:.1f}")
    data = json.loads(runs[0]["stdout"])
    nfiles = sum(1 for _ in source.rglob("*.py"))
    extra = {"cores": 1, "cpu_s": [round(r["cpu"], 3) for r in runs], "rss_mb": [round(r["rss_mb"], 1) for r in runs],
             "load1": [round(r["load1"], 2) for r in runs], "nproc": os.cpu_count(),
             "includes": "process start-up and exit"}
    if command == "audit":
        extra.update(gates_false_on_sm120_like_sm100=len(data["gates"]), counts=data["counts"],
                     audit_seconds_reported=data["seconds"])
    else:
        extra.update(gates_patched=len(data["gates"]), gates_refused=len(data["errors"]))
    return make_row(command, "cli", {"target": f"sglang=={version}", "py_files": nfiles}, "python-source", 1,
                    [r["wall"] for r in runs], "s", **extra)


def corpus_rows() -> list:
    from audit.corpus_harness import score

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        scored = score(Path(tmp))
    for lang in ("python", "native"):  # score() also returns the per-case rows
        s = scored[lang]
        for metric in ("recall", "precision"):
            rows.append(make_row("audit-corpus", "ast",
                                 {"cases": s["cases"], "positives": s["positives"], "arch": "sm120"}, lang, 1,
                                 [s[metric]], metric, tp=s["tp"], fp=s["fp"], fn=s["fn"], exact=round(s["exact"], 4),
                                 corpus="tests/audit/corpus"))
        print(f"corpus {lang}: {s['cases']} cases, recall {s['recall']:.3f}, precision {s['precision']:.3f}, exact "
              f"{s['exact']:.3f}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--core", type=int, default=0, help="CPU core to pin the audit to")
    parser.add_argument("--version", default=SGLANG_VERSION, help="sglang release to audit")
    parser.add_argument("--patch", action="store_true", help="also time `tpfuse patch` (dry run)")
    parser.add_argument("--corpus", action="store_true", help="score the labelled corpus and append its rows")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "audit.jsonl"))
    args = parser.parse_args()
    rows = corpus_rows() if args.corpus else []
    if args.repeats > 0:
        source, why = sglang_source(args.version)
        if source is None:
            print(f"bench_audit: sglang {args.version} source unavailable ({why}); connect to PyPI and "
                  "retry", file=sys.stderr)
            return 2
        for command in ("audit", "patch") if args.patch else ("audit",):
            row = bench_cli(command, source, args.version, args.repeats, args.core)
            rows.append(row)
            print(f"{command} of sglang {args.version} on 1 core: median {row.median:.2f} s to exit (p20 "
                  f"{row.p20:.2f}, p80 {row.p80:.2f}); peak RSS {max(row.extra['rss_mb']):.0f} MB")
    append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
