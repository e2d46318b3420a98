"""verify's A-vs-A control on CPU ranks: is the baseline's second timing B' the same instance as B,
or a second instance, as the candidate A is?

    python benchmarks/bench_verify_control.py --blocks 25 --out benchmarks/results/verify_control_cpu.jsonl

Two gloo ranks, three instances of one strategy (`--strategy`, default `reference`): A, B and a
third C. Blocks of `--rounds` interleaved rounds (`tpfuse.timing.time_interleaved`, what verify
times with) of {A, B, B' = B} and of {A, B, B' = C}, alternately. Every call is the same code, so
A/B should be 1 and B'/B should match it; where B' is B, B runs twice per round and A once. Rows:
op "verify_control", strategy "same_instance" / "second_instance", unit "ratio", per tokens and
ratio ("A/B", "B'/B"); median over all rounds pooled (exp of the median log-ratio), p20/p80 over
the blocks' medians; `extra.false_revert` counts the blocks `judge` called REVERT.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys

from tpfuse.results import append_rows, make_row
from tpfuse.spawn import run_ranks

HIDDEN = 64


def _rank(rank: int, world_size: int, strategy: str, blocks: int, rounds: int, tokens: tuple) -> dict:
    import torch

    from tpfuse.spec import Op
    from tpfuse.timing import time_interleaved
    from tpfuse.tune.candidates import CandidatePool, timed_call

    pool = CandidatePool.for_group(None)
    other = CandidatePool.for_group(None)  # the third instance
    out = {}
    try:
        for t in tokens:
            def call(source, twin=False, t=t):
                instance = source.get(strategy, hidden=HIDDEN, dtype=torch.bfloat16, max_tokens=max(tokens), twin=twin)
                return timed_call(instance, Op.ALL_REDUCE_RESIDUAL_RMSNORM, rank=rank, num_tokens=t, hidden=HIDDEN,
                                  dtype=torch.bfloat16, device=pool.device)

            fa, fb, fc = call(pool), call(pool, twin=True), call(other)
            for _ in range(blocks):
                for design, control in (("same_instance", fb), ("second_instance", fc)):
                    s = time_interleaved({"A": fa, "B": fb, "B2": control}, group=pool.group, device=pool.device,
                                         rounds=rounds, warmup=3)
                    out.setdefault((t, design), []).append(s)
    finally:
        other.close()
        pool.close()
    return out


def _log_ratios(num: list, den: list) -> list:
    return [math.log(a / b) for a, b in zip(num, den)]


def main(argv=None) -> int:
    from tpfuse.tune.verify import judge

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/verify_control_cpu.jsonl")
    p.add_argument("--strategy", default="reference")
    p.add_argument("--blocks", type=int, default=25)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 8])
    args = p.parse_args(argv)
    if args.blocks < 2 or args.rounds < 2:
        p.error("--blocks and --rounds must be >= 2")
    print(f"verify control: {args.blocks} blocks of {args.rounds} rounds x 2 designs x {len(args.tokens)} sizes "
          "on 2 gloo ranks", file=sys.stderr)
    results = run_ranks(_rank, 2, args=(args.strategy, args.blocks, args.rounds, tuple(args.tokens)),
                        timeout_s=3600)[0]
    rows = []
    header = ("tokens", "design", "A/B", "B'/B", "false REVERT")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (6, 16, 6, 6, 13))))
    for (t, design), blocks in sorted(results.items()):
        reverts = sum(judge(b["A"], b["B"], b["B2"], 0.03)[0] == "REVERT" for b in blocks)
        medians = {}
        for label, key in (("A/B", "A"), ("B'/B", "B2")):
            pooled = [x for b in blocks for x in _log_ratios(b[key], b["B"])]
            per_block = sorted(math.exp(statistics.median(_log_ratios(b[key], b["B"]))) for b in blocks)
            row = make_row("verify_control", design, {"tokens": t, "hidden": HIDDEN}, "bfloat16", 2, per_block,
                           "ratio", ratio=label, baseline=args.strategy, blocks=len(blocks), rounds=args.rounds,
                           false_revert=reverts, cpus=os.cpu_count())
            medians[label] = math.exp(statistics.median(pooled))
            rows.append(dataclasses.replace(row, median=medians[label]))
        ab, control = medians["A/B"], medians["B'/B"]
        print(f"{t:>6} {design:>16} {ab:6.3f} {control:6.3f} {reverts:>6} of {len(blocks)}")
    append_rows(args.out, rows)
    print(f"{len(rows)} rows -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
