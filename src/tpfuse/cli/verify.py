"""`tpfuse verify`: A/B one strategy against a baseline per token bucket; KEEP or REVERT.

    tpfuse verify --strategy oneshot --preset glm5            # baseline: the best unfused path
    tpfuse verify --strategy ring --baseline reference --hidden 4096 --json

Correctness first (small-integer inputs bit-exact, random inputs within tolerance, identical
bits on every rank), then interleaved timing of candidate, baseline and baseline-again (the
noise band; rule in `tpfuse.tune.verify`). Exit 0 on KEEP, 1 on REVERT, 2 on usage or
environment errors, among them a --strategy or --baseline admitted for none of the buckets here
(said once, with the reason, before any rank starts).
"""

from __future__ import annotations

from tpfuse.cli.args import add_output_args, add_rank_args, add_shape_args, check_rank_args, hiddens, ranks_of
from tpfuse.rank_setup import progress_bar, share_cpu_threads


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("verify", help="A/B a strategy against the baseline: KEEP or REVERT",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", required=True, help="the strategy under test")
    p.add_argument("--baseline", default=None, help="strategy to compare against (default: the best unfused path)")
    add_shape_args(p, default_max_tokens=64)
    p.add_argument("--op", choices=("all_reduce_residual_rmsnorm", "all_reduce"), default="all_reduce_residual_rmsnorm",
                   help="the op to A/B: the fused allreduce + residual + RMSNorm (default) or the plain allreduce")
    p.add_argument("--margin", type=float, default=0.03,
                   help="REVERT when slower than the baseline by more than this fraction plus the noise (default 0.03)")
    p.add_argument("--rounds", type=int, default=30, help="interleaved A/B/B rounds per bucket")
    p.add_argument("--max-rounds", type=int, default=None,
                   help="rounds a bucket may grow to while the samples do not decide (default 4 x --rounds)")
    add_rank_args(p, default_timeout_s=1800.0)
    add_output_args(p)
    p.set_defaults(run=run)


def _verify_rank(rank, world_size, strategy, baseline, sizes, buckets, dtype, op, margin, rounds, max_rounds, device,
                 show_progress):
    from tpfuse.tune.verify import verify_in_group

    share_cpu_threads(world_size, device)
    with progress_bar(len(sizes) * len(buckets), f"verify {strategy}", show_progress and rank == 0) as advance:
        report = verify_in_group(strategy, baseline=baseline, hiddens=sizes, buckets=buckets, dtype=dtype, op=op,
                                 margin=margin, rounds=rounds, max_rounds=max_rounds, device=device, progress=advance)
    return report.to_dict() if rank == 0 else None


def run(args) -> int:
    import time

    from tpfuse.cli.exits import EXIT_NEGATIVE, EXIT_OK, UsageError, dumps_json
    from tpfuse.cli.preflight import check_bytes, check_rank_memory, cuda_only_on_cpu, reject_not_admitted
    from tpfuse.cli.ranks import describe_failure, run_cli_ranks
    from tpfuse.dispatch.table import token_buckets
    from tpfuse.strategies import strategy_names

    sizes = hiddens(args, f"tpfuse verify --strategy {args.strategy} --preset glm5")
    check_rank_args(args)
    known = strategy_names()
    for name in (args.strategy, args.baseline):
        if name is not None and name not in known:
            raise UsageError(f"unknown strategy {name!r}; registered: {', '.join(known)}")
    if args.baseline == args.strategy:
        raise UsageError(f"--baseline {args.baseline} is the strategy under test: an A/B of a strategy against "
                         "itself decides nothing; drop --baseline to compare against the best unfused path")
    if not 0 <= args.margin < 1:
        raise UsageError(f"--margin is a fraction in [0, 1), e.g. 0.03; got {args.margin}")
    if args.rounds < 2:
        raise UsageError(f"--rounds must be >= 2 (the noise band needs repeated samples), got {args.rounds}")
    if args.max_rounds is not None and args.max_rounds < args.rounds:
        raise UsageError(f"--max-rounds {args.max_rounds} is below --rounds {args.rounds}; give at least --rounds")
    if args.results:
        from tpfuse.cli.preflight import check_writable
        from tpfuse.results import results_file

        check_writable(str(results_file(args.results, "verify.jsonl")), flag="--results")
    buckets = tuple(token_buckets(args.max_tokens))
    ranks = ranks_of(args)
    world_size, backend, device = ranks.world_size, ranks.backend, ranks.device
    check_rank_memory(check_bytes(args.max_tokens, max(sizes)), world_size=world_size, device=device,
                      shared_gpu=ranks.shared_gpu, what=f"--max-tokens {args.max_tokens} at hidden {max(sizes)}",
                      fix="pass a smaller --max-tokens (default 64), a smaller hidden size or fewer --world-size ranks")
    problems = [(args.op, t, h, args.dtype, args.op == "all_reduce_residual_rmsnorm") for h in sizes for t in buckets]
    named = [(args.strategy, "--strategy"), *([(args.baseline, "--baseline")] if args.baseline else [])]
    named.sort(key=lambda item: not cuda_only_on_cpu([item[0]], device))  # what is refused without torch first
    for name, flag in named:
        reject_not_admitted([name], problems, world_size=world_size, backend=backend, device=device, flag=flag)
    from tpfuse.spawn import RankFailure

    started = time.perf_counter()
    try:
        results = run_cli_ranks(_verify_rank, world_size, backend=backend, timeout_s=args.timeout,
                        args=(args.strategy, args.baseline, sizes, buckets, args.dtype, args.op, args.margin,
                              args.rounds, args.max_rounds, device, not args.json))
    except RankFailure as exc:
        raise UsageError(f"verifying on {world_size} {backend} rank(s) failed: {describe_failure(exc)}") from None
    report = results[0]
    report.update(world_size=world_size, backend=backend, device=device, dtype=args.dtype,
                  seconds=round(time.perf_counter() - started, 2))
    if args.results:
        from tpfuse.results import append_rows, results_file
        from tpfuse.tune.results import rows_from_verify

        append_rows(results_file(args.results, "verify.jsonl"), rows_from_verify(report))
    if args.json:
        print(dumps_json(report, indent=1))
    else:
        _print_report(report)
    return EXIT_NEGATIVE if report["verdict"] == "REVERT" else EXIT_OK


def _print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Table(title=(f"tpfuse verify: {report['strategy']} vs {report['baseline']} "
                       f"({report['world_size']} ranks, {report['backend']}, {report['device']}, {report['dtype']})"))
    for col in ("hidden", "tokens", "candidate us", "baseline us", "paired ratio", "REVERT above", "verdict"):
        out.add_column(col, overflow="fold")
    for b in report["buckets"]:
        style = "red" if b["verdict"] == "REVERT" else "green"
        verdict = f"[{style}]{b['verdict']}[/{style}]"
        if b["candidate_us"] != b["candidate_us"]:  # nan: not timed (admission or correctness failed)
            out.add_row(str(b["hidden"]), str(b["tokens"]), "-", "-", "-", "-", f"{verdict}: {b['reason']}")
            continue
        out.add_row(str(b["hidden"]), str(b["tokens"]), f"{b['candidate_us']:.1f}", f"{b['baseline_us']:.1f}",
                    f"{b['ratio']:.3f}", f"{b['threshold']:.3f}", verdict)
    console = Console()
    console.print(out)
    style = "red" if report["verdict"] == "REVERT" else "green"
    reverted = sum(b["verdict"] == "REVERT" for b in report["buckets"])
    console.print(f"verify: [bold {style}]{report['verdict']}[/bold {style}] {report['strategy']} vs {report['baseline']}: "
                  f"{len(report['buckets']) - reverted} of {len(report['buckets'])} bucket(s) KEEP, {reverted} REVERT, "
                  f"in {report['seconds']:.1f} s", soft_wrap=True, highlight=False)
