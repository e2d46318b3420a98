"""One device run for the kernels: GPU tests, a multi-process functional check, the epilogue benchmark.

    PYTHONPATH=src python benchmarks/device/gpu_check_kernels.py --out-dir $OUT

1. benchmarks/bench_epilogue.py (one process, MPS off), rows to epilogue.jsonl;
2. starts MPS (when `nvidia-cuda-mps-control` exists) so that processes sharing the GPU run
   concurrently instead of time-slicing, runs `pytest -m gpu tests/kernels`;
3. functional check: oneshot and twoshot with 2 and 4 processes on the one GPU, small-integer
   inputs (bit-exact against the reference on every rank), 1 and 64 tokens x 6144, bf16; rows go
   to kernels_functional.jsonl with the per-call time labelled as a functional figure only
   (processes sharing one GPU say nothing about a fabric); then stops MPS.
Prints a short table last; logs and rows are written under --out-dir.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


def _functional_rank(rank, world_size, name, shapes, calls):
    import torch.distributed as dist

    from tpfuse import Communicator
    from tpfuse.reference import small_integer_inputs

    torch.cuda.set_device(0)
    out = []
    with Communicator(strategy=name, device="cuda", timeout_s=20.0) as comm:
        for tokens, hidden in shapes:
            comm.prepare(hidden=hidden, dtype=torch.bfloat16, max_tokens=tokens)
            x, res, w = (small_integer_inputs(r, tokens, hidden, torch.bfloat16, device="cuda")
                         for r in (rank, 100, 101))
            comm.all_reduce_residual_rmsnorm(x, res, w[0])
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                normed, new_res = comm.all_reduce_residual_rmsnorm(x, res, w[0])
            torch.cuda.synchronize()
            per_call_us = (time.perf_counter() - start) / calls * 1e6
            out.append((tokens, hidden, per_call_us, normed.cpu(), new_res.cpu()))
        comm._instances[name].check()
        dist.barrier()
    return out


def functional_check(out_dir: Path) -> list[str]:
    from tpfuse.reference import all_reduce_residual_rmsnorm_ref, small_integer_inputs
    from tpfuse.results import append_rows, make_row
    from tpfuse.spawn import run_ranks

    shapes, calls, lines, rows = [(1, 6144), (64, 6144)], 20, [], []
    for name in ("oneshot", "twoshot"):
        for world in (2, 4):
            try:
                results = run_ranks(_functional_rank, world, args=(name, shapes, calls), env=ENV, timeout_s=300)
            except Exception as exc:
                lines.append(f"{name} W={world}: FAILED {str(exc)[:400]}")
                continue
            for i, (tokens, hidden) in enumerate(shapes):
                xs = [small_integer_inputs(r, tokens, hidden, torch.bfloat16) for r in range(world)]
                ref = all_reduce_residual_rmsnorm_ref(xs, small_integer_inputs(100, tokens, hidden, torch.bfloat16),
                                                      small_integer_inputs(101, tokens, hidden, torch.bfloat16)[0])
                exact = all(torch.equal(res[i][3], ref[0]) and torch.equal(res[i][4], ref[1]) for res in results)
                times = [res[i][2] for res in results]
                rows.append(make_row("all_reduce_residual_rmsnorm", name, {"tokens": tokens, "hidden": hidden},
                                     "bfloat16", world, times, "us", functional_only=True, bit_exact=exact, calls=calls,
                                     note="processes sharing one GPU under MPS: a functional check, "
                                          "not a performance figure"))
                lines.append(f"{name} W={world} {tokens}x{hidden}: bit-exact on all ranks={exact}, "
                             f"~{max(times):.0f} us/call (functional only)")
    append_rows(out_dir / "kernels_functional.jsonl", rows)
    return lines


def _mps(start: bool) -> str:
    tool = shutil.which("nvidia-cuda-mps-control")
    if tool is None:
        return "MPS: not available"
    if start:
        proc = subprocess.run([tool, "-d"], capture_output=True, text=True)
        return f"MPS start rc={proc.returncode} {proc.stderr.strip()}"
    proc = subprocess.run([tool], input="quit\n", capture_output=True, text=True)
    return f"MPS quit rc={proc.returncode}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=os.environ.get("OUT", "gpu-check-out"))
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-functional", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--pytest-args", default="")
    p.add_argument("--bench-args", default="")
    p.add_argument("--bench-timeout", type=float, default=240)
    p.add_argument("--tests-timeout", type=float, default=300)
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(ENV)
    summary = [f"GPU: {torch.cuda.get_device_name()} torch {torch.__version__}"]
    # The benchmark first and without MPS: it is one process, and its figures are the ones reported.
    if not args.skip_bench:
        summary.append(_run("bench_epilogue", [sys.executable, "benchmarks/bench_epilogue.py",
                                               "--out", str(out_dir / "epilogue.jsonl"), *args.bench_args.split()],
                            args.bench_timeout))
    summary.append(_mps(True))
    try:
        if not args.skip_tests:
            summary.append(_run("pytest -m gpu tests/kernels",
                                [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/kernels",
                                 "-p", "no:cacheprovider", "-rf", "--junitxml", str(out_dir / "pytest.xml"),
                                 *args.pytest_args.split()], args.tests_timeout))
        if not args.skip_functional:
            t0 = time.time()
            summary += functional_check(out_dir)
            summary.append(f"functional check: {time.time() - t0:.0f} s")
    finally:
        summary.append(_mps(False))
    print("\n".join(["", "==== summary ===="] + summary))
    return 0


def _run(label: str, cmd: list[str], timeout: float) -> str:
    t0 = time.time()
    try:
        rc = subprocess.run(cmd, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    return f"{label}: rc={rc} in {time.time() - t0:.0f} s"


if __name__ == "__main__":
    sys.exit(main())
