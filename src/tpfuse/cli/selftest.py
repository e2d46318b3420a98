"""`tpfuse selftest --world-size N`: every admitted strategy on N local ranks against the reference.

Exit 0 when every check passed, 1 when one failed (or a rank did), 2 on usage or environment
errors, among them a --strategy that is admitted for none of the cases here (said once).
"""

from __future__ import annotations

import argparse
import time

from tpfuse.cli.args import add_rank_args, check_rank_args, ranks_of
from tpfuse.cli.exits import EXIT_NEGATIVE, EXIT_OK, CommandError, UsageError, dumps_json

DEFAULT_WORLD_SIZE = 2  # the smallest group with a real collective


def add_parser(sub) -> None:
    p = sub.add_parser(
        "selftest",
        help="run every admitted strategy on N local ranks and check it against the reference",
        description="Spawns N local ranks (gloo on CPU; NCCL, one GPU per rank, on GPUs), runs every admitted "
        "strategy on small-integer inputs (bit-exact against the reference) and on random inputs at "
        "model hidden sizes (relative error against a float64 reference), and prints a table.",
    )
    add_rank_args(p, default_world_size=DEFAULT_WORLD_SIZE, default_timeout_s=300.0)
    p.add_argument("--strategy", action="append", help="only this strategy (repeatable)")
    p.add_argument("--tokens", dest="num_tokens", metavar="TOKENS", type=int, default=4,
                   help="tokens of the random model-shape cases (default 4)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per case (default 10)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(run=run)


def _check_args(args: argparse.Namespace) -> None:
    """Every check that needs no torch, before anything heavy is imported."""
    from tpfuse.cli.preflight import check_positive
    from tpfuse.strategies import strategy_names

    check_rank_args(args)
    check_positive(tokens=args.num_tokens, repeats=args.repeats)
    for name in args.strategy or []:
        if name not in strategy_names():
            raise UsageError(f"unknown strategy {name!r}; registered: {', '.join(strategy_names())}")


def run(args: argparse.Namespace) -> int:
    from tpfuse.cli.preflight import check_bytes, check_rank_memory, reject_not_admitted
    from tpfuse.selftest import default_cases, largest_case

    _check_args(args)
    ranks = ranks_of(args, default_world_size=DEFAULT_WORLD_SIZE)
    check_rank_memory(check_bytes(*largest_case(args.num_tokens)), world_size=ranks.world_size, device=ranks.device,
                      shared_gpu=ranks.shared_gpu, what=f"--tokens {args.num_tokens}",
                      fix="pass fewer --tokens (default 4) or a smaller --world-size")
    if args.strategy:
        reject_not_admitted(args.strategy, lambda: [(c.op, c.num_tokens, c.hidden, c.dtype, c.has_residual)
                                                    for c in default_cases(num_tokens=args.num_tokens)],
                            world_size=ranks.world_size, backend=ranks.backend, device=ranks.device)
    from tpfuse.cli.ranks import describe_failure, run_cli_ranks
    from tpfuse.selftest import merge_ranks, rank_main
    from tpfuse.spawn import RankFailure

    cases = default_cases(num_tokens=args.num_tokens)
    started = time.perf_counter()
    env = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"} if ranks.shared_gpu else {}
    try:
        per_rank = run_cli_ranks(rank_main, ranks.world_size, backend=ranks.backend, timeout_s=args.timeout,
                                 args=(cases, args.repeats, ranks.device, args.strategy, not args.json), env=env)
    except RankFailure as exc:
        raise CommandError(f"{ranks.world_size} {ranks.backend} rank(s) failed: {describe_failure(exc)}") from None
    skipped, rows = merge_ranks(per_rank)
    elapsed = time.perf_counter() - started
    ok = bool(rows) and all(r.passed for r in rows)
    if args.json:
        print(dumps_json({
            "world_size": ranks.world_size, "backend": ranks.backend, "device": ranks.device,
            "passed": ok, "seconds": round(elapsed, 2), "not_admitted": skipped,
            "results": [r.to_dict() for r in rows],
        }, indent=2))
    else:
        _print_table(rows, skipped, ranks, elapsed, ok)
    return EXIT_OK if ok else EXIT_NEGATIVE


# Short labels keep the table within 100 columns: "exact" rows are bit-exact checks
# (error = max abs difference), "random" rows are relative errors against float64.
_OP_LABEL = {"all_reduce": "allreduce", "all_reduce_residual_rmsnorm": "ar+add+norm"}
_DTYPE_LABEL = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def _print_table(rows, skipped, ranks, elapsed, ok) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tpfuse selftest: world size {ranks.world_size}, {ranks.backend}")
    for col in ("strategy", "op", "check", "shape", "dtype", "error", "tol", "median us", "verdict"):
        table.add_column(col, justify="right" if col in ("error", "tol", "median us") else "left", no_wrap=col != "verdict")
    for r in rows:
        c = r.case
        op = _OP_LABEL[c.op] if c.has_residual or c.op == "all_reduce" else "ar+norm"
        verdict = "[green]PASS[/]" if r.passed else f"[red]FAIL[/] {r.detail}"
        table.add_row(r.strategy, op, c.kind, f"{c.num_tokens}x{c.hidden}", _DTYPE_LABEL.get(c.dtype, c.dtype),
                      f"{r.error:.1e}", f"{r.tolerance:.0e}" if r.tolerance else "0", f"{r.median_us:.0f}", verdict)
    console = Console(width=max(Console().width, 100))
    console.print(table)
    for name, reason in skipped.items():
        console.print(f"not admitted: {name}: {reason}")
    failed = sum(not r.passed for r in rows)
    strategies = ", ".join(dict.fromkeys(r.strategy for r in rows)) or "none admitted"
    verdict = "[green]PASSED[/]" if ok else "[red]FAILED[/]"
    console.print(f"selftest {verdict}: {len(rows) - failed} passed, {failed} failed ({strategies}) on "
                  f"{ranks.world_size} {ranks.backend} rank(s) in {elapsed:.1f} s", soft_wrap=True, highlight=False)
