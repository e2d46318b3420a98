"""A small one-GPU workload with three known phases, for checking `tpfuse diagnose` on a real GPU.

    matmul  back-to-back bf16 GEMMs (8192 x 8192 x 8192, random inputs): kernels resident, high power
    spin    one single-thread kernel after another that spins on the clock (torch.cuda._sleep):
            kernels resident the whole time but almost no work, the way a collective waits for its
            peers: the waiting signature (high utilisation, low power)
    idle    the host sleeps; no kernel runs

Writes the wall-clock start and end of each phase to --phases (JSON), so a recording made by
`tpfuse diagnose --save` can be cut into phases (benchmarks/device/diagnose_phases.py). Usage:

    tpfuse diagnose --json --png plot.png --save samples.json -- \
        python3 benchmarks/device/diagnose_workload.py --phases phases.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

# Cycles per torch.cuda._sleep launch: about 0.1 s at the H200's 1980 MHz boost clock (read by
# KINDS.md on this machine), short enough that the phase ends within 0.1 s of its deadline.
SPIN_CYCLES = 200_000_000
# 8192^3 bf16 GEMM: about 1.1 TFLOP, about 1.4 ms at the ~790 TFLOP/s measured on an H200 (KINDS.md),
# large enough that back-to-back launches keep the GPU full.
GEMM_N = 8192


def run_for(seconds: float, step) -> int:
    """Call step() until `seconds` of GPU-synchronised wall time passed; returns the number of calls."""
    n, end = 0, time.time() + seconds
    while time.time() < end:
        for _ in range(8):
            step()
        n += 8
        torch.cuda.synchronize()  # keep the host from queueing far past the deadline
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", required=True, help="write phase times (wall clock, JSON) here")
    ap.add_argument("--matmul-s", type=float, default=5.0)
    ap.add_argument("--spin-s", type=float, default=8.0)
    ap.add_argument("--idle-s", type=float, default=3.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("diagnose_workload: needs a CUDA GPU; torch sees none")
    torch.manual_seed(0)
    a = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    torch.mm(a, b, out=c)  # warm-up: cuBLAS handle and kernel selection stay out of the phase
    torch.cuda.synchronize()
    # A finite check that the GEMM ran on real data (an all-NaN or zero result would mean no work).
    ref = (a[:4].double() @ b.double()[:, :4]).float()
    assert torch.allclose(c[:4, :4].float(), ref, rtol=2e-2, atol=1.0), "diagnose_workload: GEMM result is wrong"
    phases = []
    for name, seconds, step in (
        ("matmul", args.matmul_s, lambda: torch.mm(a, b, out=c)),
        ("spin", args.spin_s, lambda: torch.cuda._sleep(SPIN_CYCLES)),
        ("idle", args.idle_s, None),
    ):
        start = time.time()
        calls = run_for(seconds, step) if step is not None else (time.sleep(seconds) or 0)
        phases.append({"name": name, "start_unix": start, "end_unix": time.time(), "calls": calls})
        print(f"diagnose_workload: {name:6s} {phases[-1]['end_unix'] - start:5.2f} s, {calls} launches", flush=True)
    with open(args.phases, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "gemm_n": GEMM_N, "spin_cycles": SPIN_CYCLES,
                   "phases": phases}, f, indent=2)


if __name__ == "__main__":
    main()
