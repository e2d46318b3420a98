"""How much of tpfuse one call runs: the distinct source lines of tpfuse executed by one
steady-state `Communicator.all_reduce_residual_rmsnorm` call, per module.

    python benchmarks/bench_call_path.py [--strategy reference] [--json]

Two gloo ranks on CPU (the `reference` strategy by default, so no GPU is needed); each rank makes
two warm-up calls, then rank 0 traces its third call with `sys.settrace` and counts the distinct
(file, line) pairs under the package's directory. `--construct` traces instead the construction of
the Communicator and its first call (probe, agreement, table lookup, choice: the selection
runtime). A measure of the path a reader follows from the
Communicator to the collective: fewer modules and lines mean fewer places to read.
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

    def tracer(frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(root):
            return None
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
    return per_module


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="reference")
    parser.add_argument("--construct", action="store_true", help="trace the construction and the first call")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        from tpfuse.spawn import run_ranks
    except ImportError:  # checkouts before the module was named tpfuse.spawn
        from tpfuse.launch import run_ranks
    per_module = run_ranks(_traced_call, 2, args=(args.strategy, args.construct), timeout_s=300)[0]
    total = sum(per_module.values())
    if args.json:
        print(json.dumps({"strategy": args.strategy, "construct": args.construct, "lines": total,
                          "modules": len(per_module), "per_module": per_module}, sort_keys=True))
        return 0
    for path, n in sorted(per_module.items(), key=lambda kv: -kv[1]):
        print(f"{n:5d}  tpfuse/{path}")
    what = "construction + first call" if args.construct else "steady-state call"
    print(f"{total:5d}  lines in {len(per_module)} modules for one {args.strategy} {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
