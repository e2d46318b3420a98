"""`tpfuse tune`: measure every admitted strategy on N local ranks and save the dispatch table.

    tpfuse tune --preset glm5 --max-tokens 128            # ranks = GPUs (NCCL), or 2 on CPU (gloo)
    tpfuse tune --hidden 4096 --world-size 4 --json
    tpfuse tune --preset glm5 --shared-gpu --world-size 2 # functional check on one GPU

The table goes to the cache directory (TPFUSE_CACHE_DIR, else the XDG cache; `--cache-dir`),
one file per machine fingerprint, merged with the buckets already there (`--fresh` replaces it).
`Communicator(strategy="auto")` picks it up. The printed table, `--json`'s "measured" and the
`--results` rows hold only this run's buckets. Nothing measured is lost: the table is printed
(with `--json`, in the one JSON object) before it is saved; the merge and save run under a lock
that concurrent tunes share; a file in the table's place that cannot be merged (another schema,
other versions, corrupt) is renamed aside, never overwritten, and named; a save that fails
writes a copy elsewhere and names it. Exit 0 when a table was built (and saved unless
`--no-save`), 2 on usage or environment errors (including --strategies with nothing admitted for
a bucket, a rank that failed, and a table that could not be saved).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from tpfuse.cli.args import add_output_args, add_rank_args, add_shape_args, check_rank_args, hiddens, ranks_of
from tpfuse.cli.exits import EXIT_OK, EXIT_USAGE, UsageError, dumps_json
from tpfuse.cli.preflight import check_bytes, check_positive, check_rank_memory, check_writable
from tpfuse.rank_setup import progress_bar, share_cpu_threads

OPS = ("all_reduce_residual_rmsnorm", "all_reduce")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("tune", help="measure strategies per token bucket and save a dispatch table",
                              description=__doc__.split("\n\n")[0])
    add_shape_args(p, default_max_tokens=128)
    p.add_argument("--op", choices=("both", *OPS), default="both",
                   help="the op to tune: the fused allreduce + residual + RMSNorm, the plain allreduce, or both "
                        "(default both)")
    p.add_argument("--strategies", default=None,
                   help="comma-separated subset of strategies to consider (default: every admitted one)")
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


def _tune_rank(rank, world_size, spec, device, show_progress):
    """One spawned rank: tune in the world group; rank 0 reports what this run measured. Ranks write
    nothing: the parent saves once every rank has finished, so an aborted run never does."""
    import torch.distributed as dist

    from tpfuse.tune.tuner import tune_in_group

    share_cpu_threads(world_size, device)
    with progress_bar(spec.num_steps, "tune", show_progress and rank == 0) as advance:
        measured = tune_in_group(spec, device=device, progress=advance)
    dist.barrier()
    return measured.to_json() if rank == 0 else None


def _strategies(text: str | None) -> tuple[str, ...] | None:
    """The names `--strategies` gives (None without the flag), checked against the registry."""
    from tpfuse.strategies import strategy_names

    if text is None:
        return None
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not names:
        raise UsageError(f"--strategies {text!r} names no strategy; give a comma-separated subset, e.g. "
                         "--strategies reference,ring, or drop --strategies to consider every admitted one")
    unknown = [s for s in names if s not in strategy_names()]
    if unknown:
        raise UsageError(f"unknown strategy {', '.join(unknown)} in --strategies; registered: "
                         f"{', '.join(strategy_names())}")
    return names


def _check_args(args) -> tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...] | None, Path | None]:
    """(hidden sizes, ops, strategies, cache directory or None with --no-save) after every check
    that needs no torch."""
    sizes = hiddens(args, "tpfuse tune --preset glm5")
    check_rank_args(args)
    if not 0 <= args.margin < 1:
        raise UsageError(f"--margin is a fraction in [0, 1), e.g. 0.03; got {args.margin}")
    check_positive(rounds=args.rounds, confirm_rounds=args.confirm_rounds)
    if args.fresh and args.no_save:
        raise UsageError("--fresh replaces the saved table and --no-save saves none; give one of them")
    strategies = _strategies(args.strategies)
    if args.results:
        from tpfuse.results import results_file

        check_writable(str(results_file(args.results, "tune.jsonl")), flag="--results")
    directory = None
    if not args.no_save:  # before measuring (and before torch): a read-only cache fails now, not after the run
        from tpfuse.dispatch.table import CacheDirError
        from tpfuse.dispatch.table import check_writable as table_writable
        from tpfuse.env import cache_dir

        directory = Path(os.path.abspath(os.path.expanduser(args.cache_dir))) if args.cache_dir else cache_dir()
        try:
            table_writable(directory)
        except CacheDirError as exc:
            raise UsageError(str(exc)) from None
    ops = OPS if args.op == "both" else (args.op,)
    return sizes, ops, strategies, directory


def _reject_unservable(strategies, problems, world_size, backend, device) -> None:
    """UsageError when a problem has no admitted strategy among --strategies (each reason once);
    built-ins that need CUDA are refused for CPU ranks without torch."""
    from tpfuse.cli.preflight import admission_here, cuda_only_on_cpu

    refused = cuda_only_on_cpu(strategies, device)
    rest = [name for name in strategies if name not in refused]
    verdicts = admission_here(rest, problems, world_size=world_size, backend=backend, device=device) if rest else {}
    for problem in problems:
        if not any(verdicts[name][problem].ok for name in rest):
            reasons = "; ".join(f"{name}: {refused[name] if name in refused else verdicts[name][problem].reason}"
                                for name in strategies)
            op, num_tokens, hidden, dtype, _ = problem
            raise UsageError(f"--strategies {','.join(strategies)}: none is admitted for {op} {num_tokens}x{hidden} {dtype} "
                             f"on {world_size} {backend} rank(s) on {device} ({reasons}); add an admitted strategy "
                             "(`tpfuse doctor` lists them) or drop --strategies")


def _save_copy(table) -> Path | None:
    """A copy of `table` where one can still be written (the temp directory, then the current
    one), for a save that failed; None if neither takes it."""
    name = f"tpfuse-dispatch-{table.fingerprint_digest[:16]}-{int(time.time())}.json"
    for directory in (tempfile.gettempdir(), os.getcwd()):
        path = Path(directory) / name
        try:
            path.write_text(table.to_json())
            return path
        except OSError:
            path.unlink(missing_ok=True)
    return None


def run(args) -> int:
    from tpfuse.dispatch.table import token_buckets

    sizes, ops, strategies, directory = _check_args(args)
    buckets = tuple(token_buckets(args.max_tokens))
    ranks = ranks_of(args)
    world_size, backend, device = ranks.world_size, ranks.backend, ranks.device
    check_rank_memory(check_bytes(args.max_tokens, max(sizes)), world_size=world_size, device=device,
                      shared_gpu=ranks.shared_gpu, what=f"--max-tokens {args.max_tokens} at hidden {max(sizes)}",
                      fix="pass a smaller --max-tokens (default 128), a smaller hidden size or fewer --world-size ranks")
    if strategies:
        _reject_unservable(strategies, [(op, t, h, args.dtype, op == "all_reduce_residual_rmsnorm")
                                        for op in ops for h in sizes for t in buckets], world_size, backend, device)
    from tpfuse.cli.ranks import describe_failure, run_cli_ranks
    from tpfuse.dispatch.table import CacheDirError, parse, save_merged, table_path
    from tpfuse.spawn import RankFailure
    from tpfuse.tune.tuner import TuneSpec

    try:
        spec = TuneSpec(hiddens=sizes, buckets=buckets, dtype=args.dtype, ops=ops, strategies=strategies,
                        margin=args.margin, rounds=args.rounds, confirm_rounds=args.confirm_rounds)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    env = {"TPFUSE_CACHE_DIR": str(directory)} if directory is not None else {}
    started = time.perf_counter()
    try:
        measured_text = run_cli_ranks(_tune_rank, world_size, backend=backend, env=env, timeout_s=args.timeout,
                                      args=(spec, device, not args.json))[0]
    except RankFailure as exc:
        raise UsageError(f"tuning on {world_size} {backend} rank(s) failed: {describe_failure(exc)}") from None
    measured = parse(measured_text)
    seconds = time.perf_counter() - started
    if args.results:
        from tpfuse.results import append_rows, results_file
        from tpfuse.tune.results import rows_from_table

        append_rows(results_file(args.results, "tune.jsonl"), rows_from_table(measured, backend=backend, device=device))
    out = {"path": None, "world_size": world_size, "backend": backend, "device": device,
           "table": json.loads(measured_text), "measured": [dataclasses.asdict(e) for e in measured.entries],
           "kept": None}
    if not args.json:  # what was measured is on the screen before anything can fail to save it
        _print_measured(measured, world_size, backend, device)
    saved, failure = None, None
    if directory is not None:
        try:
            saved = save_merged(measured, table_path(measured.fingerprint, directory), fresh=args.fresh)
        except CacheDirError as exc:
            copy = _save_copy(measured)
            where = f"a copy of the measured table is at {copy}" if copy else "no copy could be written anywhere"
            shown = "in this JSON object's \"table\"" if args.json else "above"
            failure = f"{exc}; the measured table is {shown}, and {where}"
            out.update(error=f"tpfuse tune: {failure}", exit_code=EXIT_USAGE, copy=str(copy) if copy else None)
    if saved is not None:
        out.update(path=str(saved.path), table=json.loads(saved.table.to_json()),
                   kept={"path": str(saved.kept), "why": saved.kept_why} if saved.kept else None)
    if args.json:
        print(dumps_json(out, indent=1))
    else:
        _print_outcome(measured, saved, failure, seconds)
    if failure:
        if args.json:
            print(f"tpfuse tune: {failure}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def _print_measured(table, world_size, backend, device) -> None:
    """This run's buckets (sorted by op, hidden, tokens), then the guard and rejection notes."""
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


def _print_outcome(measured, saved, failure: str | None, seconds: float) -> None:
    """The summary line (and, when a save failed, the error on stderr)."""
    from rich.console import Console

    choices = ", ".join(sorted({e.choice for e in measured.entries}))
    if failure:
        where = "not saved"
    elif saved is None:
        where = "not saved (--no-save)"
    else:
        kept = len(saved.table.entries) - len(measured.entries)
        where = f"saved to {saved.path}" + (f" (with {kept} bucket(s) kept from earlier runs)" if kept else "")
        if saved.kept:
            where += f"; the file there could not be merged ({saved.kept_why}) and was kept as {saved.kept}"
    Console().print(f"tune: {len(measured.entries)} bucket(s) measured in {seconds:.1f} s, chosen: {choices}; "
                    f"dispatch table {where}", soft_wrap=True, highlight=False)
    if failure:
        print(f"tpfuse tune: {failure}", file=sys.stderr)
