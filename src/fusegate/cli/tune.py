"""`fusegate tune`: measure every admitted strategy on N local ranks and save the dispatch table.

    fusegate tune --preset glm5 --max-tokens 128            # ranks = GPUs (NCCL), or 2 on CPU (gloo)
    fusegate tune --hidden 4096 --world-size 4 --json
    fusegate tune --preset glm5 --shared-gpu --world-size 2 # functional check on one GPU

The table goes to the cache directory (FUSEGATE_CACHE_DIR, else the XDG cache; `--cache-dir`),
one file per machine fingerprint, merged with the buckets already there (`--fresh` replaces it).
`Communicator(strategy="auto")` picks it up. Exit 0 when a table was built, 2 on usage or
environment errors (including a rank that failed).
"""

from __future__ import annotations

import dataclasses
import json
import os

from fusegate.tune.cli_common import add_launch_args, add_shape_args, hiddens, launch, progress_bar, share_cpu_threads


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("tune", help="measure strategies per token bucket and save a dispatch table",
                              description=__doc__.split("\n\n")[0])
    add_shape_args(p, default_max_tokens=128)
    p.add_argument("--op", choices=("both", "all_reduce_residual_rmsnorm", "all_reduce"), default="both")
    p.add_argument("--strategies", default="", help="comma-separated subset of strategies to consider")
    p.add_argument("--margin", type=float, default=0.03,
                   help="a fused strategy must beat the best unfused one by this fraction (default 0.03)")
    p.add_argument("--rounds", type=int, default=20, help="timed samples per candidate, first pass")
    p.add_argument("--confirm-rounds", type=int, default=40, help="timed samples per leader, confirmation pass")
    p.add_argument("--cache-dir", default=None, help="where to write the table (default: FUSEGATE_CACHE_DIR or XDG cache)")
    p.add_argument("--fresh", action="store_true", help="replace the existing table instead of merging into it")
    p.add_argument("--no-save", action="store_true", help="measure and print, write nothing")
    add_launch_args(p)
    p.set_defaults(run=run)


def _tune_rank(rank, world_size, spec, device, fresh, show_progress):
    """One spawned rank: tune in the world group; rank 0 reports the table and where it goes.
    Ranks write nothing: the parent saves once every rank has finished, so an aborted run never does."""
    import torch.distributed as dist

    from fusegate.probe import probe
    from fusegate.tune.table import load, table_path, versions_of
    from fusegate.tune.tuner import tune_in_group

    share_cpu_threads(world_size, device)
    with progress_bar(spec.num_steps, "tune", show_progress and rank == 0) as advance:
        table = tune_in_group(spec, device=device, progress=advance)
    path = table_path(table.fingerprint)
    if not fresh:
        old, _ = load(path, table.fingerprint, versions_of(probe()))
        table = old.merged(table) if old is not None else table
    dist.barrier()
    return (table.to_json(), str(path)) if rank == 0 else None


def run(args) -> int:
    from fusegate.cli.main import UsageError, dumps_json
    from fusegate.launch import RankFailure, run_ranks
    from fusegate.env import cache_dir
    from fusegate.tune.table import DEFAULT_MARGIN, CacheDirError, check_writable, parse, save, token_buckets
    from fusegate.tune.tuner import ALL_OPS, TuneSpec

    sizes = hiddens(args, "tune")
    world_size, backend, device = launch(args)
    ops = ALL_OPS if args.op == "both" else (args.op,)
    strategies = tuple(s for s in args.strategies.split(",") if s) or None
    if strategies:
        from fusegate.backends import strategy_names

        unknown = [s for s in strategies if s not in strategy_names()]
        if unknown:
            raise UsageError(f"unknown strategy {', '.join(unknown)} in --strategies; registered: {', '.join(strategy_names())}")
    try:
        spec = TuneSpec(hiddens=sizes, buckets=tuple(token_buckets(args.max_tokens)), dtype=args.dtype, ops=ops,
                        strategies=strategies, margin=args.margin if args.margin is not None else DEFAULT_MARGIN,
                        rounds=args.rounds, confirm_rounds=args.confirm_rounds)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    env = {"FUSEGATE_CACHE_DIR": os.path.abspath(args.cache_dir)} if args.cache_dir else {}
    try:
        if not args.no_save:  # before measuring: a read-only cache fails now, not after the run
            check_writable(env.get("FUSEGATE_CACHE_DIR") or cache_dir())
    except CacheDirError as exc:
        raise UsageError(str(exc)) from None
    try:
        results = run_ranks(_tune_rank, world_size, backend=backend, env=env, timeout_s=args.timeout,
                            args=(spec, device, args.fresh, not args.json))
    except RankFailure as exc:
        raise UsageError(f"a rank failed while tuning on {world_size} {backend} rank(s): {exc}") from None
    text, path = results[0]
    table = parse(text)
    try:
        if not args.no_save:
            save(table, path)
    except CacheDirError as exc:
        raise UsageError(str(exc)) from None
    if args.results:
        from fusegate.bench.results import append_rows, results_file
        from fusegate.tune.results import rows_from_table

        fresh = [e for e in table.entries if (e.hidden in sizes and e.dtype == args.dtype and e.op in ops)]
        append_rows(results_file(args.results, "tune.jsonl"), rows_from_table(dataclasses.replace(table, entries=tuple(fresh)), backend=backend, device=device))
    if args.json:
        print(dumps_json({"path": None if args.no_save else path, "world_size": world_size, "backend": backend,
                          "device": device, "table": json.loads(text)}, indent=1))
    else:
        _print_summary(table, path if not args.no_save else None, world_size, backend, device)
    return 0


def _print_summary(table, path, world_size, backend, device) -> None:
    from rich.console import Console
    from rich.table import Table

    names = sorted({n for e in table.entries for n in e.times_us})
    out = Table(title=f"fusegate tune: {world_size} ranks, {backend}, {device} (median us, max over ranks)")
    for col in ("op", "hidden", "tokens", "choice", *names):
        out.add_column(col, overflow="fold")
    for e in table.entries:
        cells = []
        for n in names:
            t = e.median(n)
            cells.append("-" if t is None else (f"[bold]{t:.1f}[/bold]" if n == e.choice else f"{t:.1f}"))
        out.add_row(e.op.replace("all_reduce_residual_rmsnorm", "ar+add+rmsnorm"), str(e.hidden), str(e.tokens),
                    e.choice, *cells)
    console = Console()
    console.print(out)
    guarded = [e for e in table.entries if "fused" in e.reason and "no fused candidate" not in e.reason]
    for e in guarded:
        console.print(f"{e.op} {e.tokens}x{e.hidden}: {e.reason}", soft_wrap=True)
    rejected = {n: r for e in table.entries for n, r in e.rejected.items()}
    for name, reason in rejected.items():
        console.print(f"[dim]not considered: {name}: {reason}[/dim]")
    console.print(f"dispatch table: {path}" if path else "dispatch table not saved (--no-save)")
