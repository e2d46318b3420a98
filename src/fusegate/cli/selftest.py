"""`fusegate selftest --world-size N`: every admitted strategy on N local ranks against the reference.

Exit 0 when every check passed, 1 when one failed (or a rank did), 2 on usage or environment
errors, among them a --strategy that is admitted for none of the cases here (said once).
"""

from __future__ import annotations

import argparse
import sys
import time

from fusegate.cli.main import EXIT_NEGATIVE, EXIT_OK, UsageError, dumps_json


def add_parser(sub) -> None:
    p = sub.add_parser(
        "selftest",
        help="run every admitted strategy on N local ranks and check it against the reference",
        description="Spawns N local ranks (gloo on CPU; NCCL when there are N GPUs), runs every admitted "
        "strategy on small-integer inputs (bit-exact against the reference) and on random inputs at "
        "model hidden sizes (relative error against a float64 reference), and prints a table.",
    )
    p.add_argument("--world-size", type=int, default=2,
                   help="number of local ranks (default 2; at most 4 per usable CPU core, one per GPU with NCCL)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl when torch sees >= N GPUs, else gloo")
    p.add_argument("--shared-gpu", action="store_true",
                   help="gloo ranks that all hold CUDA tensors on GPU 0 (tests peer-memory strategies on one GPU)")
    p.add_argument("--strategy", action="append", help="only this strategy (repeatable)")
    p.add_argument("--tokens", type=int, default=4, help="tokens of the random model-shape cases (default 4)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per case (default 10)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before hung ranks are killed")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(run=run)


def _backend(args: argparse.Namespace) -> tuple[str, str | None]:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.shared_gpu:
        if gpus < 1:
            raise UsageError("--shared-gpu needs a CUDA GPU; torch sees none (drop --shared-gpu to run on CPU)")
        return "gloo", "cuda"
    if args.backend == "nccl" and gpus < args.world_size:
        raise UsageError(f"--backend nccl needs {args.world_size} GPUs (one per rank), torch sees {gpus}; "
                         "use --backend gloo or --shared-gpu")
    if args.backend == "nccl" or (args.backend == "auto" and gpus >= args.world_size):
        return "nccl", None
    return "gloo", None


def _check_args(args: argparse.Namespace) -> None:
    """Every check that needs no torch, before anything heavy is imported."""
    from fusegate.strategies import canonical_name, strategy_names
    from fusegate.cli.preflight import check_positive, check_world_size, require_runtime

    check_world_size(args.world_size)
    check_positive(tokens=args.tokens, repeats=args.repeats)
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}; pass e.g. --timeout 300")
    args.strategy = [canonical_name(n) for n in args.strategy] if args.strategy else args.strategy
    for name in args.strategy or []:
        if name not in strategy_names():
            raise UsageError(f"unknown strategy {name!r}; registered: {', '.join(strategy_names())}")
    require_runtime()


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    from fusegate.cli.preflight import reject_not_admitted
    from fusegate.cli.ranks import describe_failure, spawn
    from fusegate.selftest import default_cases, merge_ranks, rank_main

    backend, device = _backend(args)
    cases = default_cases(num_tokens=args.tokens)
    if args.strategy:
        problems = [(c.op, c.num_tokens, c.hidden, c.dtype, c.has_residual) for c in cases]
        reject_not_admitted(args.strategy, problems, world_size=args.world_size, backend=backend,
                            device=device or ("cuda" if backend == "nccl" else "cpu"))
    from fusegate.launch import RankFailure

    started = time.perf_counter()
    env = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"} if args.shared_gpu else {}
    try:
        per_rank = spawn(rank_main, args.world_size, backend=backend, timeout_s=args.timeout,
                         args=(cases, args.repeats, device, args.strategy, not args.json), env=env)
    except RankFailure as exc:
        print(f"fusegate selftest: {args.world_size} {backend} rank(s) failed: {describe_failure(exc)}", file=sys.stderr)
        return EXIT_NEGATIVE
    skipped, rows = merge_ranks(per_rank)
    elapsed = time.perf_counter() - started
    ok = bool(rows) and all(r.passed for r in rows)
    if args.json:
        print(dumps_json({
            "world_size": args.world_size, "backend": backend, "device": device or ("cuda" if backend == "nccl" else "cpu"),
            "passed": ok, "seconds": round(elapsed, 2), "not_admitted": skipped,
            "results": [r.to_dict() for r in rows],
        }, indent=2))
    else:
        _print_table(rows, skipped, args, backend, elapsed, ok)
    return EXIT_OK if ok else EXIT_NEGATIVE


# Short labels keep the table within 100 columns: "exact" rows are bit-exact checks
# (error = max abs difference), "random" rows are relative errors against float64.
_OP_LABEL = {"all_reduce": "allreduce", "all_reduce_residual_rmsnorm": "ar+add+norm"}
_DTYPE_LABEL = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def _print_table(rows, skipped, args, backend, elapsed, ok) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fusegate selftest: world size {args.world_size}, {backend}")
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
                  f"{args.world_size} {backend} rank(s) in {elapsed:.1f} s", soft_wrap=True, highlight=False)
