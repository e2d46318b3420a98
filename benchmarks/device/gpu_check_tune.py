"""One device run for selection by measurement: fabric-probe GPU tests, tune and verify on one GPU.

    PYTHONPATH=src python3 benchmarks/device/gpu_check_tune.py --out-dir $OUT      # on the GPU machine
    PYTHONPATH=src python benchmarks/device/gpu_check_tune.py --cpu-smoke --out-dir /tmp/x   # dry run on CPU

1. `pytest tests/probe/test_fabric.py`: the probe kernels on one GPU (peer pairs need 2+ GPUs:
   on one GPU the multi_gpu test skips, and measure_fabric's refusal with one GPU is checked);
2. `tpfuse doctor --measure --json`: what doctor reports for the fabric on this machine;
3. MPS on (when available), so the 2 rank processes sharing the GPU run concurrently;
4. `tpfuse tune --shared-gpu --world-size 2 --preset glm5`: 2 ranks over gloo holding CUDA
   tensors on the one GPU, every admitted strategy verified then timed per token bucket; the
   dispatch table goes to a cache dir, rows to tune_shared_gpu.jsonl;
5. `Communicator(strategy="auto", device="cuda")` on 2 ranks loads that table (digest agreed)
   and its choices compute the reference's bits on small-integer inputs;
6. `tpfuse verify --shared-gpu --strategy oneshot --preset glm5`: KEEP or REVERT against the
   best unfused path; rows to verify_shared_gpu.jsonl;
then MPS off and a short summary last. Ranks sharing one GPU make this a functional check: the
times say nothing about a multi-GPU fabric. With two or more GPUs the same script runs one NCCL
rank per GPU instead (no MPS), so its tune table and verify verdict are real fabric measurements.
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
       "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "PYTHONUNBUFFERED": "1"}
CLI = [sys.executable, "-m", "tpfuse.cli"]


def _run(name: str, argv: list[str], limit_s: float, stdout_path: Path | None = None) -> tuple[int | None, float]:
    print(f"\n=== {name}: {' '.join(argv)}  (limit {limit_s:.0f} s)", flush=True)
    started = time.perf_counter()
    try:
        with open(stdout_path, "w") if stdout_path else open(os.devnull, "w") as sink:
            proc = subprocess.run(argv, timeout=limit_s, env={**os.environ, **ENV},
                                  stdout=sink if stdout_path else None)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    elapsed = time.perf_counter() - started
    print(f"=== {name}: exit {code if code is not None else 'TIMEOUT'} after {elapsed:.0f} s", flush=True)
    return code, elapsed


def _mps(start: bool) -> str:
    tool = shutil.which("nvidia-cuda-mps-control")
    if tool is None:
        return "MPS: not available"
    proc = subprocess.run([tool, "-d"] if start else [tool], input=None if start else "quit\n",
                          capture_output=True, text=True)
    return f"MPS {'start' if start else 'quit'} rc={proc.returncode} {proc.stderr.strip()}"


def _auto_rank(rank, world_size, device, hidden, tokens_list, shared):
    """Communicator(strategy='auto') on the tuned machine: the table, its choices, and their bits."""
    import torch

    from tpfuse import Communicator
    from tpfuse.reference import all_reduce_residual_rmsnorm_ref, small_integer_inputs
    from tpfuse.spec import Op

    if device == "cuda" and shared:
        torch.cuda.set_device(0)
    out = {"rows": []}
    with Communicator(device=device) as comm:
        out["table_digest"] = comm.table.digest if comm.table is not None else None
        out["table_note"] = comm.table_note
        for tokens in tokens_list:
            choice = comm.strategy_for(Op.ALL_REDUCE_RESIDUAL_RMSNORM, tokens, hidden, torch.bfloat16)
            xs = [small_integer_inputs(r, tokens, hidden, torch.bfloat16) for r in range(world_size)]
            res = small_integer_inputs(1000, tokens, hidden, torch.bfloat16)
            w = small_integer_inputs(1001, 1, hidden, torch.bfloat16)[0].abs() + 1
            got = comm.all_reduce_residual_rmsnorm(xs[rank].to(comm.device), res.to(comm.device), w.to(comm.device))
            want = all_reduce_residual_rmsnorm_ref(xs, res, w)
            exact = all(torch.equal(g.cpu(), r) for g, r in zip(got, want))
            out["rows"].append({"tokens": tokens, "choice": choice.name, "source": choice.source,
                                "reason": choice.reason, "bit_exact": exact})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=os.environ.get("OUT", "gpu-check-out"))
    p.add_argument("--cpu-smoke", action="store_true", help="run the same steps on CPU (gloo), to check the script")
    p.add_argument("--preset", default="glm5")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--verify-max-tokens", type=int, default=4)
    p.add_argument("--strategy", default="oneshot", help="strategy for the verify step")
    p.add_argument("--shared-gpu", action="store_true", help="share GPU 0 between 2 ranks even with several GPUs")
    p.add_argument("--budget-s", type=float, default=160.0,
                   help="whole-run time budget; each step's limit is cut to fit")
    args = p.parse_args(argv)
    deadline = time.perf_counter() + args.budget_s

    def limit(want: float) -> float:
        """A step's time limit: `want`, cut to what is left of the budget (at least 5 s)."""
        return max(5.0, min(want, deadline - time.perf_counter() - 5.0))

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path("/tmp/tpfuse-gpu-check-cache")
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["TPFUSE_CACHE_DIR"] = str(cache)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    import torch

    from tpfuse.presets import get_preset

    device = "cpu" if args.cpu_smoke else "cuda"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # Two or more GPUs: one NCCL rank per GPU (real fabric timings); one GPU: 2 ranks share it.
    shared = device == "cuda" and (gpus < 2 or args.shared_gpu)
    world_size = 2 if device == "cpu" or shared else gpus
    backend = "nccl" if device == "cuda" and not shared else "gloo"
    ranks = ["--world-size", str(world_size)] + (["--device", "cpu"] if device == "cpu" else
                                                  ["--shared-gpu"] if shared else [])
    facts = f"torch {torch.__version__}, {torch.cuda.device_count() if torch.cuda.is_available() else 0} GPU(s)"
    if torch.cuda.is_available():
        facts += f": {torch.cuda.get_device_name(0)}"
    print(facts, flush=True)
    summary: list[str] = []

    def note(line: str) -> None:  # print as soon as known: a run cut short still shows it
        print(f"[summary] {line}", flush=True)
        summary.append(line)

    note(facts)

    code, _ = _run("fabric tests", [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                    "tests/probe/test_fabric.py"], limit(60))
    note(f"fabric tests: exit {code}")
    code, _ = _run("doctor --measure", CLI + ["doctor", "--measure", "--json"], limit(30), out / "doctor.json")
    try:
        fabric = json.loads((out / "doctor.json").read_text()).get("fabric")
        note(f"doctor --measure: exit {code}, fabric: {fabric}")
    except (OSError, ValueError) as exc:
        note(f"doctor --measure: exit {code}, unreadable output ({exc})")

    note(_mps(True) if shared else "MPS: not used (one rank per device)")
    try:
        code, secs = _run("tune", CLI + ["tune", *ranks, "--preset", args.preset,
                                         "--max-tokens", str(args.max_tokens), "--op", "all_reduce_residual_rmsnorm",
                                         "--rounds", "8", "--confirm-rounds", "12",
                                         "--json", "--results", str(out / "tune_shared_gpu.jsonl")],
                          limit(90), out / "tune.json")
        note(f"tune: exit {code} after {secs:.0f} s")
        if code == 0:
            table = json.loads((out / "tune.json").read_text())["table"]
            note("bucket  choice      " + "  ".join(sorted(table["entries"][0]["times_us"])) + "   (median us)")
            for e in table["entries"]:
                times = "  ".join(f"{e['times_us'][n]['median']:.0f}" for n in sorted(e["times_us"]))
                note(f"{e['tokens']:>6}  {e['choice']:<10}  {times}   {e['reason']}")
            rejected = {n: r for e in table["entries"] for n, r in e["rejected"].items()}
            for n, r in rejected.items():
                note(f"  not considered: {n}: {r}")

            from tpfuse.spawn import run_ranks

            t0 = time.perf_counter()
            hidden = get_preset(args.preset).hidden
            auto = run_ranks(_auto_rank, world_size, backend=backend, env={**ENV, "TPFUSE_CACHE_DIR": str(cache)},
                             args=(device, hidden, (1, 3, args.max_tokens), shared), timeout_s=limit(45))
            (out / "auto.json").write_text(json.dumps(auto, indent=1))
            same = len({a["table_digest"] for a in auto}) == 1 and auto[0]["table_digest"] == table["digest"]
            note(f"auto: table loaded on both ranks with the tuned digest: {same} ({time.perf_counter() - t0:.0f} s)")
            for row in auto[0]["rows"]:
                note(f"  {row['tokens']} tokens -> {row['choice']} ({row['source']}), bit-exact {row['bit_exact']}")

        code, secs = _run("verify", CLI + ["verify", *ranks, "--strategy", args.strategy, "--preset", args.preset,
                                           "--max-tokens", str(args.verify_max_tokens), "--rounds", "10", "--json",
                                           "--results", str(out / "verify_shared_gpu.jsonl")],
                          limit(60), out / "verify.json")
        note(f"verify {args.strategy}: exit {code} after {secs:.0f} s")
        if code in (0, 1):
            report = json.loads((out / "verify.json").read_text())
            note(f"  overall {report['verdict']} vs {report['baseline']}")
            for b in report["buckets"]:
                note(f"  {b['tokens']:>3} tokens: {b['verdict']} ratio {b['ratio']:.3f} (REVERT above "
                               f"{b['threshold']:.3f}); {b['candidate_us']:.0f} vs {b['baseline_us']:.0f} us")
    finally:
        if shared:
            note(_mps(False))
    title = ("ranks share one GPU: functional check, not fabric timings" if shared else
             f"{world_size} {backend} ranks on {device}")
    print("\n".join(["", f"==== summary ({title}) ===="] + summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
