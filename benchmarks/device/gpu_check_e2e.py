"""One device run for the reference model: `bench e2e` on a GLM-5 cut, `profile`, the GPU tests.

    PYTHONPATH=src python benchmarks/device/gpu_check_e2e.py --out-dir $OUT [--layers 4 --experts 256]

1. `tpfuse bench e2e --preset glm5 --layers L --experts E --batch 1,8,64,256,1024 --fusion both`:
   rows to <out>/results/e2e.jsonl (the default cut: 4 of GLM-5's 78 layers, all MoE, with all
   256 experts, about 81 GB of bf16 weights: one GPU, TP1);
2. `tpfuse profile` of the same cut at batch 64, fusion on and off: rows to
   <out>/results/profile.jsonl, Chrome traces and a PNG bar chart under <out>;
3. `pytest -m gpu tests/models tests/cli/test_bench.py tests/cli/test_profile.py` (unless --no-tests).
Each step runs in its own process under a time limit taken from --budget-s (steps that do not fit
are skipped and say so). Prints a short summary table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
       "PYTHONUNBUFFERED": "1"}


def _run(name: str, argv: list[str], limit_s: float) -> tuple[int | None, float]:
    print(f"\n=== {name}: {' '.join(argv)}  (limit {limit_s:.0f} s)", flush=True)
    started = time.perf_counter()
    try:
        code = subprocess.run(argv, timeout=limit_s, env={**os.environ, **ENV}).returncode
    except subprocess.TimeoutExpired:
        code = None
    elapsed = time.perf_counter() - started
    print(f"=== {name}: exit {code if code is not None else 'TIMEOUT'} after {elapsed:.0f} s", flush=True)
    return code, elapsed


def _summary(out: Path) -> None:
    e2e = out / "results" / "e2e.jsonl"
    if e2e.exists():
        print("\nbatch fusion strategy   runner      step_us   tok/s     J/token  AR/step")
        for line in e2e.read_text().splitlines():
            r = json.loads(line)
            x = r["extra"]
            jpt = "n/a" if x["j_per_token"] is None else f"{x['j_per_token']:.4f}"
            print(f"{r['shape']['batch']:>5} {'on' if x['fusion'] else 'off':>6} {r['strategy']:<10} "
                  f"{str(x['moe_runner']):<10} {r['median']:>8.0f} {x['tok_per_s']:>8.1f} {jpt:>10} "
                  f"{sum(x['allreduces_per_step'].values()):>4}/{x['expected_allreduces_per_step']}")
    prof = out / "results" / "profile.jsonl"
    if prof.exists():
        print("\nprofile (us per step): fusion stage")
        for line in prof.read_text().splitlines():
            r = json.loads(line)
            print(f"  {'on' if r['extra']['fusion'] else 'off':>3} {r['shape']['stage']:<14} {r['median']:>9.1f} "
                  f"({100 * r['extra']['share']:.1f}%, {r['extra']['launches_per_step']:.0f} launches)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--preset", default="glm5", help="model preset (tiny: a CPU dry run of this script)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--budget-s", type=float, default=215.0, help="wall-clock budget for all steps")
    parser.add_argument("--no-tests", action="store_true", help="skip step 3 (the GPU tests run elsewhere)")
    args = parser.parse_args()
    out = Path(args.out_dir)
    (out / "results").mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget_s
    cli = [sys.executable, "-m", "tpfuse.cli"]
    cut = ["--preset", args.preset, "--layers", str(args.layers), "--experts", str(args.experts)]
    steps = [
        ("bench e2e", cli + ["bench", "e2e", *cut, "--batch", "1,8,64,256,1024", "--fusion", "both", "--steps", "20",
                             "--min-seconds", "1.0", "--results", str(out / "results")], 110),
        ("profile", cli + ["profile", *cut, "--batch", "64", "--steps", "4", "--fusion", "both",
                           "--trace", str(out / "trace.json"), "--plot", str(out / "profile.png"),
                           "--results", str(out / "results")], 60),
        ("gpu tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                       "tests/models", "tests/cli/test_bench.py", "tests/cli/test_profile.py"], 70),
    ][: 2 if args.no_tests else 3]
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,power.limit,clocks.sm", "--format=csv"])
    status = []
    for name, argv, limit in steps:
        left = deadline - time.perf_counter()
        if left < 20:
            status.append((name, "skipped: budget spent", 0.0))
            continue
        code, elapsed = _run(name, argv, min(limit, left))
        status.append((name, "TIMEOUT" if code is None else f"exit {code}", elapsed))
    _summary(out)
    print()
    for name, result, elapsed in status:
        print(f"{name:<10} {result:<24} {elapsed:5.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
