"""The host cost of one call: eager us/call and graph us/call of `Communicator.all_reduce_residual_rmsnorm`
per strategy and shape, beside a bare eager launch of the epilogue kernel and `torch.add` in the
same process (hosts differ: the ratio to the bare launch is what counts), and the same epilogue
launched through Triton's own `kernel[grid](...)` (how `residual_rmsnorm` launched it before its
launches were pre-bound).

    python benchmarks/bench_host_path.py                 # one GPU, world size 1 (NCCL group of one rank)
    python benchmarks/bench_host_path.py --stub --json   # no GPU: the Python path, launches stubbed

Method. One process, world size 1, so no rank waits for another and the time is the host's: a
sample is the wall time of `--calls` back-to-back eager calls (synchronised before and after)
divided by their number, so an eager call that costs the host more than the GPU shows its host
cost; the variants are interleaved in `--rounds` rotated rounds (`tpfuse.timing.sample_rounds`)
and the median and p20/p80 over rounds reported. Graph: the same call captured GRAPH_CALLS times
in one CUDA graph and replayed (`tpfuse.timing.graph_timer`): device time per call. After timing,
every strategy's call is checked against `tpfuse.reference` on small-integer inputs (exact sums):
new residual bit for bit, normed within the dtype's tolerance.

`--stub` (CI, no GPU): a gloo group of one rank on CPU tensors, every Triton compile and launch
replaced by a recording no-op (`tpfuse.kernels.launcher.StubbedLaunches`) and the strategies' GPU
needs waived, so the whole Python path of a call (validation, route, strategy, launcher, Triton
where it is still called) runs and is timed; torch's own CPU ops (a clone, nccl_eager's reference
math, `torch.add`) run for real. Each row says how many Triton launches a call made
(`launches_per_call`). Nothing is checked for values there: the stubbed kernels write nothing.

Rows (`tpfuse.results`) go to `--out` (default benchmarks/results/host_path.jsonl): op
`host_path`, strategy (`tpfuse/<name>`, `bare_epilogue_launch`, `epilogue_triton_launch`,
`torch.add`), extra.mode eager or graph, extra.ratio_to_bare (eager us/call over the bare
launch's, same shape), extra.stub.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from tpfuse.results import append_rows, make_row
from tpfuse.strategies import get_strategy, register
from tpfuse.timing import GRAPH_CALLS, graph_timer, sample_rounds

STRATEGIES = ("oneshot", "twoshot", "nccl_epilogue", "nccl_eager")
TOKENS = (1, 64)
HIDDEN = 6144  # GLM-5's hidden size (tpfuse.presets)
BARE = "bare_epilogue_launch"
TRITON_LAUNCH = "epilogue_triton_launch"
ADD = "torch.add"
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "host_path.jsonl")


def _cpu_class(name: str):
    """`name`'s strategy class with its CUDA, NCCL and peer-access needs waived (for --stub)."""
    base = get_strategy(name)
    needs = dataclasses.replace(base.needs, cuda=False, nccl=False, peer_access=False)
    return type(f"Stub{base.__name__}", (base,), {"needs": needs, "__module__": __name__})


@contextlib.contextmanager
def stubbed_group(strategies):
    """A gloo group of one rank in this process, every Triton compile and launch stubbed
    (`StubbedLaunches`, yielded) and `strategies` registered with their GPU needs waived: the host
    path of a GPU call, on a machine without a GPU (bench_call_path.py --stub uses it too)."""
    from tpfuse.kernels.launcher import StubbedLaunches

    with StubbedLaunches() as stub:
        for name in strategies:
            cls = _cpu_class(name)
            globals()[cls.__name__] = cls  # registered by import path: this module's attribute
            register(name, f"{__name__}:{cls.__name__}")
        _init_group(True)
        try:
            yield stub
        finally:
            dist.destroy_process_group()


def _init_group(stub: bool) -> None:
    store = dist.HashStore()
    if stub:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))


def _eager_sampler(call, calls: int, device, counter):
    """us per call over `calls` back-to-back calls; also counts the Triton launches they made."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    stats = {"launches": 0, "calls": 0}

    def sample() -> float:
        sync()
        before = counter()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        us = (time.perf_counter() - t0) * 1e6 / calls
        stats["launches"] += counter() - before
        stats["calls"] += calls
        return us

    return sample, stats


def _inputs(tokens: int, device, *, integers: bool = False):
    from tpfuse.reference import random_inputs, small_integer_inputs

    make = small_integer_inputs if integers else random_inputs
    x = make(0, tokens, HIDDEN, torch.bfloat16).to(device)
    residual = make(1, tokens, HIDDEN, torch.bfloat16).to(device)
    weight = make(2, 1, HIDDEN, torch.bfloat16)[0] if integers else torch.ones(HIDDEN, dtype=torch.bfloat16)
    weight = weight.to(device)
    return x, residual, weight


def _triton_launch(x, residual, weight):
    """The epilogue's outputs and its kernel launched through Triton's own `kernel[grid](...)`."""
    from tpfuse.kernels.epilogue import interpreting, launch_config, residual_rmsnorm_kernel

    m, h = x.shape
    block, warps, rows = launch_config(h, x.element_size(), m)

    def call():
        normed, new_res = torch.empty_like(x), torch.empty_like(x)
        residual_rmsnorm_kernel[(-(-m // rows),)](x, residual, weight, normed, new_res, m, h, 1e-6, BLOCK_H=block,
                                                  ROWS=rows, HAS_RES=True, SOFT_BF16=interpreting(), num_warps=warps)
        return normed, new_res

    return call


def _check(comm, tokens: int, device) -> bool:
    """One call on small-integer inputs against the reference (raises if wrong)."""
    from tpfuse.reference import TOLERANCE, all_reduce_residual_rmsnorm_ref, relative_error

    x, residual, weight = _inputs(tokens, device, integers=True)
    normed, new_res = comm.all_reduce_residual_rmsnorm(x, residual, weight)
    want = all_reduce_residual_rmsnorm_ref([x.cpu()], residual.cpu(), weight.cpu())
    if not torch.equal(new_res.cpu(), want[1]) or relative_error(normed.cpu(), want[0]) > TOLERANCE[torch.bfloat16]:
        raise AssertionError(f"bench_host_path: {comm.requested} at {tokens} tokens differs from tpfuse.reference")
    return True


def run(args) -> tuple[list, list[str]]:
    if args.stub:
        with stubbed_group(args.strategies) as stub:
            return _run(args, stub)
    _init_group(False)
    try:
        return _run(args, None)
    finally:
        dist.destroy_process_group()


def _run(args, stub) -> tuple[list, list[str]]:
    from tpfuse import Communicator
    from tpfuse.kernels.epilogue import residual_rmsnorm

    device = torch.device("cpu") if args.stub else torch.device("cuda", 0)
    counter = (lambda: stub.launches) if stub is not None else (lambda: 0)
    comms, notes = {}, []
    for name in args.strategies:
        try:
            # max_tokens sizes a peer workspace for every shape here at its first (eager) call, which
            # compiles only the variants timed (prepare() would compile every plan up to it)
            comms[name] = Communicator(strategy=name, device=device.type, max_tokens=max(args.tokens))
        except (ValueError, RuntimeError) as exc:
            notes.append(f"{name}: not run: {exc}")
    rows = []
    for tokens in args.tokens:
        x, residual, weight = _inputs(tokens, device)
        variants = {f"tpfuse/{name}": (lambda c=comm: c.all_reduce_residual_rmsnorm(x, residual, weight))
                    for name, comm in comms.items()}
        variants[BARE] = lambda: residual_rmsnorm(x, residual, weight, 1e-6)
        variants[TRITON_LAUNCH] = _triton_launch(x, residual, weight)
        variants[ADD] = lambda: torch.add(x, residual)
        samplers, stats = {}, {}
        for name, call in variants.items():
            for _ in range(args.warmup):
                call()
            samplers[name], stats[name] = _eager_sampler(call, args.calls, device, counter)
        eager = sample_rounds(samplers, args.rounds)
        graph = {}
        if not args.stub:
            timers = {name: graph_timer([call] * GRAPH_CALLS, reps=args.graph_reps) for name, call in variants.items()}
            graph = sample_rounds(timers, args.rounds)
        bare = sorted(eager[BARE])[len(eager[BARE]) // 2]
        shape = {"tokens": tokens, "hidden": HIDDEN}
        done = len(rows)
        for name in variants:
            median = sorted(eager[name])[len(eager[name]) // 2]
            checked = _check(comms[name.removeprefix("tpfuse/")], tokens, device) if (
                not args.stub and name.startswith("tpfuse/")) else None
            extra = dict(mode="eager", stub=args.stub, calls_per_sample=args.calls, ratio_to_bare=median / bare,
                         launches_per_call=(stats[name]["launches"] / stats[name]["calls"]) if args.stub else None,
                         checked=checked)
            rows.append(make_row("host_path", name, shape, "bfloat16", 1, eager[name], "us", **extra))
            if graph:
                rows.append(make_row("host_path", name, shape, "bfloat16", 1, graph[name], "us", mode="graph",
                                     stub=False, graph_calls=GRAPH_CALLS, checked=checked))
        if args.out:  # each shape's rows as soon as they exist: a run cut short keeps what it measured
            append_rows(args.out, rows[done:])
    for comm in comms.values():
        comm.close()
    return rows, notes


def _table(rows) -> str:
    by = {}
    for r in rows:
        by.setdefault((r["strategy"], r["shape"]["tokens"]), {})[r["extra"]["mode"]] = r
    lines = [f"{'variant':28} {'tokens':>6} {'eager us':>9} {'x bare':>7} {'graph us':>9}"]
    for (name, tokens), modes in by.items():
        eager, graph = modes["eager"], modes.get("graph")
        lines.append(f"{name:28} {tokens:>6} {eager['median']:9.2f} {eager['extra']['ratio_to_bare']:7.2f} "
                     f"{graph['median'] if graph else float('nan'):9.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stub", action="store_true", help="no GPU: time the Python path with launches stubbed")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--calls", type=int, default=200, help="eager calls per sample")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved samples per variant")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--graph-reps", type=int, default=20, help="graph replays per graph sample")
    parser.add_argument("--out", default=DEFAULT_OUT, help="rows file ('' writes none)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    args = parser.parse_args(argv)
    if not args.stub and not torch.cuda.is_available():
        print("bench_host_path: torch sees no CUDA GPU; run with --stub to time the Python path", file=sys.stderr)
        return 2
    rows, notes = run(args)
    dicts = [dataclasses.asdict(r) for r in rows]
    if args.json:
        print(json.dumps({"rows": dicts, "notes": notes}, allow_nan=False))
    else:
        print(_table(dicts))
        for note in notes:
            print(note)
        what = "Python path, launches stubbed" if args.stub else torch.cuda.get_device_name()
        print(f"world size 1, bf16, hidden {HIDDEN}; {what}" + (f"; rows appended to {args.out}" if args.out else ""))
    return 0 if all(math.isfinite(r["median"]) for r in dicts) else 1


if __name__ == "__main__":
    sys.exit(main())
