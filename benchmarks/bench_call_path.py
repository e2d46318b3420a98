"""How much of tpfuse one call runs: the distinct source lines of tpfuse executed by one
steady-state `Communicator.all_reduce_residual_rmsnorm` call, per module, and its hops (calls from
one tpfuse file into another).

    python benchmarks/bench_call_path.py [--strategy reference] [--json]
    python benchmarks/bench_call_path.py --stub --strategy nccl_epilogue   # a GPU strategy's path, no GPU

Two gloo ranks on CPU (the `reference` strategy by default, so no GPU is needed); each rank makes
two warm-up calls, then rank 0 traces its third call with `sys.settrace` and counts the distinct
(file, line) pairs under the package's directory, and every call event whose caller runs in
another tpfuse file (a hop; calls into torch or Triton are not hops). `--construct` traces instead
the construction of the Communicator and its first call (probe, agreement, table lookup, choice:
the selection runtime). `--stub` traces a strategy that needs a GPU (nccl_epilogue, oneshot,
twoshot, nccl_eager) on one in-process CPU rank, Triton's compile and launch stubbed
(bench_host_path.py's `stubbed_group`; the stub's own lines are not counted). A measure of the
path a reader follows from the Communicator to the collective: fewer modules, hops and lines mean
fewer places to read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _traced_call(rank: int, world_size: int, strategy: str, construct: bool = False):
    import torch

    import tpfuse
    from tpfuse import Communicator

    root = os.path.dirname(tpfuse.__file__)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(rank))
    residual, weight = torch.randn(4, 256), torch.ones(256)
    seen: set = set()
    hops: list = []

    def tracer(frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(root) or frame.f_code.co_qualname.startswith("StubbedLaunches."):
            return None
        if event == "call":
            caller = frame.f_back
            while caller is not None and not caller.f_code.co_filename.startswith(root):
                caller = caller.f_back  # through torch or Triton frames back to tpfuse
            if caller is not None and caller.f_code.co_filename != path:
                hops.append((os.path.relpath(caller.f_code.co_filename, root), os.path.relpath(path, root)))
        if event == "line":
            seen.add((os.path.relpath(path, root), frame.f_lineno))
        return tracer

    trace = (lambda: sys.settrace(tracer)) if rank == 0 else (lambda: None)
    if construct:
        trace()
    try:
        with Communicator(strategy=strategy, device="cpu") as comm:
            comm.all_reduce_residual_rmsnorm(x, residual, weight)
            sys.settrace(None)
            comm.all_reduce_residual_rmsnorm(x, residual, weight)
            if not construct:
                trace()
            comm.all_reduce_residual_rmsnorm(x, residual, weight)
            sys.settrace(None)
    finally:
        sys.settrace(None)
    per_module: dict = {}
    for path, _ in seen:
        per_module[path] = per_module.get(path, 0) + 1
    return per_module, hops


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="reference")
    parser.add_argument("--construct", action="store_true", help="trace the construction and the first call")
    parser.add_argument("--stub", action="store_true", help="one CPU rank, Triton's compile and launch stubbed")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.stub:
        from bench_host_path import stubbed_group

        with stubbed_group([args.strategy]):
            per_module, hops = _traced_call(0, 1, args.strategy, args.construct)
    else:
        from tpfuse.spawn import run_ranks

        per_module, hops = run_ranks(_traced_call, 2, args=(args.strategy, args.construct), timeout_s=300)[0]
    total = sum(per_module.values())
    if args.json:
        print(json.dumps({"strategy": args.strategy, "construct": args.construct, "stub": args.stub, "lines": total,
                          "modules": len(per_module), "hops": len(hops), "per_module": per_module,
                          "hop_list": [f"{a} -> {b}" for a, b in hops]}, sort_keys=True))
        return 0
    for path, n in sorted(per_module.items(), key=lambda kv: -kv[1]):
        print(f"{n:5d}  tpfuse/{path}")
    for a, b in hops:
        print(f"  hop  tpfuse/{a} -> tpfuse/{b}")
    what = "construction + first call" if args.construct else "steady-state call"
    print(f"{total:5d}  lines in {len(per_module)} modules, {len(hops)} hops, for one {args.strategy} {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
