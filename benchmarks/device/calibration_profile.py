"""Where an engine's start-up calibration spends its time: 2 ranks sharing one GPU, per bucket and phase.

Runs the engine start of tests/integrations/test_calibrate.py (vLLM's group names, gloo group,
device "cuda", hidden 4096 bf16, buckets 1-64) with a budget large enough to measure every bucket,
once on a cold kernel cache (a fresh TRITON_CACHE_DIR) and once on the warm cache the first run
left (a fresh dispatch-table cache each time, so both measure every bucket). Each rank wraps the
tuner's phases with timers: creating and preparing candidates (`CandidatePool.get`, which compiles
a bucket's kernel variants), compiling one peer-kernel variant (`PeerLaunch.compile`), the
correctness check (`check_candidate`), graph capture (`timing._capture`), eager and replayed
samples, the object collectives; rank 0 of the warm run is also profiled (cProfile, top functions
by cumulative time). Needs a CUDA GPU; MPS on (nvidia-cuda-mps-control -d) as the GPU tests run.

    python benchmarks/device/calibration_profile.py --out $OUT/calibration_profile.json \
        --rows $OUT/calibration.jsonl

Rows (`--rows`): op "calibration", strategy "vllm start (cold kernel cache)" / "(warm ...)", one
row for the whole start-up step (`runtime.prepare`: calibration and the Communicator's
preparation) and one per bucket, unit s, one sample each (median = p20 = p80), the bucket's
choice and phases in `extra`. `--rows-from FILE` writes them from an earlier run's JSON, with
the GPU and versions of a row file of that same run (`--env-from`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NCCL_NVLS_ENABLE": "0", "TPFUSE_TIMEOUT_S": "20", "TPFUSE_CALIBRATE": "600s"}


def _wrap(owner, attr: str, label, phases: dict) -> None:
    """Replace owner.attr by a timed call adding (count, seconds) to phases[label(args)]."""
    inner = getattr(owner, attr)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            key = label(*args, **kwargs) if callable(label) else label
            count, seconds = phases.get(key, (0, 0.0))
            phases[key] = (count + 1, seconds + time.perf_counter() - t0)

    setattr(owner, attr, timed)


def _rank(rank, world_size, table_cache, hidden, profile, device):
    import cProfile
    import io
    import pstats

    import torch
    import torch.distributed as dist

    from tpfuse import timing
    from tpfuse.integrations import runtime
    from tpfuse.kernels import peer_launch
    from tpfuse.tune import candidates, tuner

    os.environ["TPFUSE_CACHE_DIR"] = table_cache
    if device == "cuda":
        torch.cuda.set_device(0)
    phases: dict = {}
    buckets: list = []
    _wrap(candidates.CandidatePool, "get", lambda self, name, **kw: f"get {name}", phases)
    _wrap(peer_launch.PeerLaunch, "compile", "compile one variant", phases)
    _wrap(tuner, "check_candidate", lambda inst, *a, **kw: f"check {inst.name}", phases)
    _wrap(tuner, "time_interleaved", "time_interleaved", phases)
    _wrap(timing, "_capture", "capture attempt", phases)
    _wrap(timing, "_time_one", "eager sample", phases)
    _wrap(timing, "_time_replay", "replay sample", phases)
    _wrap(dist, "all_gather_object", "all_gather_object", phases)
    _wrap(dist, "broadcast_object_list", "broadcast_object_list", phases)
    inner_bucket = tuner._tune_bucket

    def bucket(spec, pool, op, hidden_, num_tokens, *args):
        before = dict(phases)
        t0 = time.perf_counter()
        entry = inner_bucket(spec, pool, op, hidden_, num_tokens, *args)
        spent = {k: (v[0] - before.get(k, (0, 0.0))[0], round(v[1] - before.get(k, (0, 0.0))[1], 4))
                 for k, v in phases.items() if v != before.get(k)}
        medians = {n: round(t["median"], 2) for n, t in (entry.confirmed_us or entry.times_us).items()}
        buckets.append({"tokens": num_tokens, "seconds": round(time.perf_counter() - t0, 4), "choice": entry.choice,
                        "medians": medians, "phases": spent})
        return entry

    tuner._tune_bucket = bucket
    group = runtime.EngineGroup("tp:0", dist.new_group([0, 1]), dist.new_group([0, 1], backend="gloo"), device)
    prof = cProfile.Profile() if profile and rank == 0 else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    served = runtime.prepare("vllm", group, hidden=hidden, dtype=torch.bfloat16, max_tokens=64, buckets=BUCKETS)
    if prof is not None:
        prof.disable()
    total = time.perf_counter() - t0
    top = ""
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
        top = text.getvalue()
    down = runtime.state("tp:0").down
    runtime.close_all()
    return {"rank": rank, "hidden": hidden, "served": served, "down": down, "prepare_s": round(total, 3),
            "buckets": buckets, "phases": {k: (c, round(s, 4)) for k, (c, s) in phases.items()}, "profile": top}


def rows_of(results: dict, env_row: dict | None = None) -> list:
    """The result rows of both runs (see the module doc); `env_row`: take gpu/versions/date from it."""
    import dataclasses

    from tpfuse.results import make_row

    rows = []
    for run, result in results.items():
        r0 = result["ranks"][0]
        name = f"vllm start ({run} kernel cache)"
        shape = {"hidden": r0.get("hidden", 4096), "buckets": list(BUCKETS)}
        common = dict(ranks_share_one_gpu=True, served=r0["served"], note="2 ranks sharing one GPU under MPS")
        rows.append(make_row("calibration", name, shape, "bfloat16", 2, [r0["prepare_s"]], "s", step="prepare",
                             buckets_measured=len(r0["buckets"]), **common))
        for b in r0["buckets"]:
            rows.append(make_row("calibration", name, {**shape, "tokens": b["tokens"]}, "bfloat16", 2, [b["seconds"]],
                                 "s", step="bucket", choice=b["choice"], medians_us=b["medians"],
                                 phases={k: {"calls": c, "s": t} for k, (c, t) in b["phases"].items()}, **common))
    if env_row is not None:
        rows = [dataclasses.replace(r, gpu=env_row["gpu"], versions=env_row["versions"], date=env_row["date"])
                for r in rows]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON file for both runs' results (needed unless --rows-from)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the harness")
    ap.add_argument("--rows", help="append result rows here (JSON lines)")
    ap.add_argument("--rows-from", help="write the rows of this earlier run's --out JSON instead of running")
    ap.add_argument("--env-from", help="with --rows-from: a row file of the same run to take gpu/versions from")
    args = ap.parse_args(argv)
    from tpfuse.results import append_rows

    if args.rows_from:
        env_row = json.loads(Path(args.env_from).read_text().splitlines()[0]) if args.env_from else None
        append_rows(args.rows, rows_of(json.loads(Path(args.rows_from).read_text()), env_row))
        return 0
    if not args.out:
        ap.error("--out FILE is needed to run the profile (or --rows-from FILE --rows FILE to write rows)")
    from tpfuse.spawn import run_ranks

    kernels = tempfile.mkdtemp(prefix="tpfuse-kernel-cache-")
    results = {}
    for run in ("cold", "warm"):
        env = {**ENV, "TRITON_CACHE_DIR": kernels}
        t0 = time.perf_counter()
        table = tempfile.mkdtemp(prefix="tpfuse-table-")
        out = run_ranks(_rank, 2, args=(table, args.hidden, run == "warm", args.device), env=env, timeout_s=580)
        results[run] = {"wall_s": round(time.perf_counter() - t0, 2), "ranks": out}
        r0 = out[0]
        print(f"== {run}: prepare {r0['prepare_s']} s, served {r0['served']} {r0['down']}")
        for b in r0["buckets"]:
            top = sorted(b["phases"].items(), key=lambda kv: -kv[1][1])[:6]
            print(f"  {b['tokens']:>3} tok {b['seconds']:6.2f} s {b['choice']:10} " +
                  ", ".join(f"{k} {c}x {s:.2f}" for k, (c, s) in top))
    Path(args.out).write_text(json.dumps(results, indent=1))
    if args.rows:
        append_rows(args.rows, rows_of(results))
    print(results["warm"]["ranks"][0]["profile"][:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
