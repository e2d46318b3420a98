"""`tpfuse tune`: measure every admitted strategy on N local ranks and save the dispatch table.

    tpfuse tune --preset glm5 --max-tokens 128            # ranks = GPUs (NCCL), or 2 on CPU (gloo)
    tpfuse tune --hidden 4096 --world-size 4 --json
    tpfuse tune --preset glm5 --shared-gpu --world-size 2 # functional check on one GPU

The table goes to the cache directory (TPFUSE_CACHE_DIR, else the XDG cache; `--cache-dir`),
one file per machine fingerprint, merged with the buckets already there (`--fresh` replaces it).
`Communicator(strategy="auto")` picks it up. The printed table, `--json`'s "measured" and the
`--results` rows hold only this run's buckets. Exit 0 when a table was built, 2 on usage or
environment errors (including --strategies with nothing admitted for a bucket, and a rank that
failed).
"""

from __future__ import annotations

import dataclasses
import json
import os

from tpfuse.cli.args import add_output_args, add_rank_args, add_shape_args, check_rank_args, hiddens, ranks_of
from tpfuse.cli.preflight import check_positive, check_writable
from tpfuse.rank_setup import progress_bar, share_cpu_threads


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
    p.add_argument("--cache-dir", default=None, help="where to write the table (default: TPFUSE_CACHE_DIR or XDG cache)")
    p.add_argument("--fresh", action="store_true", help="replace the existing table instead of merging into it")
    p.add_argument("--no-save", action="store_true", help="measure and print, write nothing")
    add_rank_args(p, default_timeout_s=1800.0)
    add_output_args(p)
    p.set_defaults(run=run)


def _tune_rank(rank, world_size, spec, device, fresh, show_progress):
    """One spawned rank: tune in the world group; rank 0 reports what this run measured, the table
    to save (merged with earlier runs unless `fresh`) and where it goes. Ranks write nothing: the
    parent saves once every rank has finished, so an aborted run never does."""
    import torch.distributed as dist

    from tpfuse.dispatch.table import merged_with_saved, table_path, versions_of
    from tpfuse.probe import probe
    from tpfuse.tune.tuner import tune_in_group

    share_cpu_threads(world_size, device)
    with progress_bar(spec.num_steps, "tune", show_progress and rank == 0) as advance:
        measured = tune_in_group(spec, device=device, progress=advance)
    path = table_path(measured.fingerprint)
    table = merged_with_saved(measured, path, versions_of(probe()), fresh=fresh)
    dist.barrier()
    return (measured.to_json(), table.to_json(), str(path)) if rank == 0 else None


def _check_args(args) -> tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...] | None]:
    """(hidden sizes, ops, strategies) after every check that needs no torch."""
    from tpfuse.cli.exits import UsageError

    sizes = hiddens(args, "tune")
    check_rank_args(args)
    if not 0 <= args.margin < 1:
        raise UsageError(f"--margin is a fraction in [0, 1), e.g. 0.03; got {args.margin}")
    check_positive(rounds=args.rounds, confirm_rounds=args.confirm_rounds)
    if args.results:
        from tpfuse.results import results_file

        check_writable(str(results_file(args.results, "tune.jsonl")), flag="--results")
    if not args.no_save:  # before measuring (and before torch): a read-only cache fails now, not after the run
        from tpfuse.dispatch.table import CacheDirError
        from tpfuse.dispatch.table import check_writable as table_writable
        from tpfuse.env import cache_dir

        try:
            table_writable(os.path.abspath(args.cache_dir) if args.cache_dir else cache_dir())
        except CacheDirError as exc:
            raise UsageError(str(exc)) from None
    ops = ("all_reduce_residual_rmsnorm", "all_reduce") if args.op == "both" else (args.op,)
    from tpfuse.strategies import strategy_names

    strategies = tuple(s for s in args.strategies.split(",") if s) or None
    if strategies:
        unknown = [s for s in strategies if s not in strategy_names()]
        if unknown:
            raise UsageError(f"unknown strategy {', '.join(unknown)} in --strategies; registered: {', '.join(strategy_names())}")
    return sizes, ops, strategies


def _reject_unservable(strategies, problems, world_size, backend, device) -> None:
    """UsageError when a problem has no admitted strategy among --strategies (each reason once)."""
    from tpfuse.cli.exits import UsageError
    from tpfuse.cli.preflight import admission_here

    verdicts = admission_here(strategies, problems, world_size=world_size, backend=backend, device=device)
    for problem in problems:
        if not any(verdicts[name][problem].ok for name in strategies):
            reasons = "; ".join(f"{name}: {verdicts[name][problem].reason}" for name in strategies)
            op, num_tokens, hidden, dtype, _ = problem
            raise UsageError(f"--strategies {','.join(strategies)}: none is admitted for {op} {num_tokens}x{hidden} {dtype} "
                             f"on {world_size} {backend} rank(s) on {device} ({reasons}); add an admitted strategy "
                             "(`tpfuse doctor` lists them) or drop --strategies")


def run(args) -> int:
    import time

    from tpfuse.cli.exits import UsageError, dumps_json
    from tpfuse.cli.ranks import describe_failure, run_cli_ranks
    from tpfuse.dispatch.table import CacheDirError, parse, save, token_buckets

    sizes, ops, strategies = _check_args(args)
    buckets = tuple(token_buckets(args.max_tokens))
    ranks = ranks_of(args)
    world_size, backend, device = ranks.world_size, ranks.backend, ranks.device
    if strategies:
        _reject_unservable(strategies, [(op, t, h, args.dtype, op == "all_reduce_residual_rmsnorm")
                                        for op in ops for h in sizes for t in buckets], world_size, backend, device)
    from tpfuse.spawn import RankFailure
    from tpfuse.tune.tuner import TuneSpec

    try:
        spec = TuneSpec(hiddens=sizes, buckets=buckets, dtype=args.dtype, ops=ops, strategies=strategies,
                        margin=args.margin, rounds=args.rounds, confirm_rounds=args.confirm_rounds)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    env = {"TPFUSE_CACHE_DIR": os.path.abspath(args.cache_dir)} if args.cache_dir else {}
    started = time.perf_counter()
    try:
        results = run_cli_ranks(_tune_rank, world_size, backend=backend, env=env, timeout_s=args.timeout,
                        args=(spec, device, args.fresh, not args.json))
    except RankFailure as exc:
        raise UsageError(f"tuning on {world_size} {backend} rank(s) failed: {describe_failure(exc)}") from None
    measured_text, saved_text, path = results[0]
    measured = parse(measured_text)
    try:
        if not args.no_save:
            save(parse(saved_text), path)
    except CacheDirError as exc:
        raise UsageError(str(exc)) from None
    if args.results:
        from tpfuse.results import append_rows, results_file
        from tpfuse.tune.results import rows_from_table

        append_rows(results_file(args.results, "tune.jsonl"), rows_from_table(measured, backend=backend, device=device))
    if args.json:
        print(dumps_json({"path": None if args.no_save else path, "world_size": world_size, "backend": backend,
                          "device": device, "table": json.loads(saved_text if not args.no_save else measured_text),
                          "measured": [dataclasses.asdict(e) for e in measured.entries]}, indent=1))
    else:
        kept = len(parse(saved_text).entries) - len(measured.entries) if not args.no_save else 0
        _print_summary(measured, path if not args.no_save else None, world_size, backend, device, kept=kept,
                       seconds=time.perf_counter() - started)
    return 0


def _print_summary(table, path, world_size, backend, device, *, kept: int, seconds: float) -> None:
    """This run's buckets (sorted by op, hidden, tokens), the guard and rejection notes, then one summary line."""
    from rich.console import Console
    from rich.table import Table

    entries = sorted(table.entries, key=lambda e: (e.op, e.hidden, e.tokens))
    names = sorted({n for e in entries for n in e.times_us})
    out = Table(title=f"tpfuse tune: {world_size} ranks, {backend}, {device} (median us, max over ranks)")
    for col in ("op", "hidden", "tokens", "choice", *names):
        out.add_column(col, overflow="fold")
    for e in entries:
        cells = []
        for n in names:
            t = e.median(n)
            cells.append("-" if t is None else (f"[bold]{t:.1f}[/bold]" if n == e.choice else f"{t:.1f}"))
        out.add_row(e.op.replace("all_reduce_residual_rmsnorm", "ar+add+rmsnorm"), str(e.hidden), str(e.tokens),
                    e.choice, *cells)
    console = Console()
    console.print(out)
    for e in (e for e in entries if e.guarded):
        console.print(f"{e.op} {e.tokens}x{e.hidden}: {e.reason}", soft_wrap=True)
    rejected = {n: r for e in entries for n, r in e.rejected.items()}
    for name, reason in rejected.items():
        console.print(f"[dim]not considered: {name}: {reason}[/dim]", soft_wrap=True)
    choices = sorted({e.choice for e in entries})
    where = f"saved to {path}" + (f" (with {kept} bucket(s) kept from earlier runs)" if kept else "") if path else "not saved (--no-save)"
    console.print(f"tune: {len(entries)} bucket(s) measured in {seconds:.1f} s, chosen: {', '.join(choices)}; "
                  f"dispatch table {where}", soft_wrap=True, highlight=False)
