"""`tpfuse profile`: per-stage time of the reference model's decode steps, fusion on and/or off.

Profiles a few eager decode steps of the tpfuse.models decoder under torch.profiler and
attributes GPU kernel time (CPU operator time on a CPU run) to stages: attention, MoE GEMMs, other
GEMMs, allreduce/communication, norm, other; with kernel launches per step and estimated bytes.
Prints a table (or `--json`), optionally writes Chrome traces (--trace: the path itself for one
fusion mode, `<stem>.fusion-on.json` and `<stem>.fusion-off.json` beside it for both) and a PNG bar
chart (--plot, needs matplotlib), and with `--results PATH` appends one result row per stage to
PATH (or PATH/profile.jsonl for a directory). Every path is checked before any rank starts, and
the files written are the ones printed. Exit 0 when each step made 2 allreduces per layer, 1
otherwise (or when a rank failed), 2 on usage or environment errors.
"""

from __future__ import annotations

from tpfuse._version import extra_hint
from tpfuse.cli.exits import EXIT_NEGATIVE, EXIT_OK, CommandError, UsageError, dumps_json


def add_parser(subparsers) -> None:
    from tpfuse.cli.bench import add_model_arguments

    p = subparsers.add_parser("profile", help="per-stage time breakdown of the reference model's decode steps",
                              description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--batch", type=int, default=8, help="decode batch size (default 8)")
    p.add_argument("--steps", type=int, default=5, help="profiled decode steps (default 5)")
    p.add_argument("--fusion", choices=("on", "off", "both"), default="both",
                   help="fused allreduce+norm (default both)")
    p.add_argument("--trace", help="write a Chrome trace to this .json path (with --fusion both: "
                                   "<stem>.fusion-on.json and <stem>.fusion-off.json beside it)")
    p.add_argument("--plot", help="write a PNG bar chart of the breakdown to this path")
    p.set_defaults(run=run)


PLOT_HINT = f"install matplotlib with {extra_hint('plot')} or drop --plot"


def run(args) -> int:
    from tpfuse.cli.bench import fusion_modes, make_spec, user_message
    from tpfuse.cli.preflight import check_positive, check_writable
    from tpfuse.e2e.profile import trace_paths
    from tpfuse.results import results_file

    check_positive(batch=args.batch, steps=args.steps)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(f"--plot needs matplotlib; {PLOT_HINT}") from None
    traces = trace_paths(args.trace, fusion_modes(args.fusion)) if args.trace else None
    for flag, path in (("--results", args.results and str(results_file(args.results, "profile.jsonl"))),
                       *(("--trace", p) for p in (traces or {}).values()), ("--plot", args.plot)):
        if path:
            check_writable(path, flag=flag)
    spec, ranks = make_spec(args, batches=(args.batch,), fusion=fusion_modes(args.fusion), progress=False)
    from rich.console import Console

    from tpfuse.cli.ranks import describe_failure, run_cli_ranks
    from tpfuse.e2e.profile import profile_rank
    from tpfuse.spawn import RankFailure

    try:
        with Console(stderr=True).status(f"profile: {args.steps} decode steps per fusion mode ...", spinner="dots"):
            result = run_cli_ranks(profile_rank, ranks.world_size, backend=ranks.backend,
                                   args=(spec, args.batch, args.steps, traces), timeout_s=1800)[0]
    except RankFailure as exc:
        raise CommandError(f"{spec.tp} rank(s) failed: {describe_failure(exc)}") from None
    except RuntimeError as exc:
        raise UsageError(user_message(exc)) from None
    if args.plot:
        from tpfuse.e2e.profile import plot_stages

        result["plot"] = plot_stages(result, args.plot)
    if traces:
        result["trace"] = list(traces.values())
    if args.results:
        from tpfuse.e2e.profile import profile_rows
        from tpfuse.results import append_rows

        path = append_rows(results_file(args.results, "profile.jsonl"), profile_rows(spec, result))
        result["results_file"] = str(path.resolve())
    expected = 2 * result["config"]["num_layers"]
    ok = all(sum(m["allreduces_per_step"].values()) == expected for m in result["modes"])
    result["allreduce_count_ok"] = ok
    if args.json:
        print(dumps_json(result, default=str))
    else:
        _print(result)
    return EXIT_OK if ok else EXIT_NEGATIVE


def format_gbps(gbps: float) -> str:
    """Three significant digits at any scale: a CPU run's 0.02 GB/s must not print as 0."""
    if gbps >= 100:
        return f"{gbps:.0f}"
    return f"{gbps:.3g}" if gbps >= 0.001 else f"{gbps:.1e}"


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from tpfuse.e2e.profile import STAGE_TITLES, STAGES

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    cfg = result["config"]
    unit = "GPU" if result["device"] == "cuda" else "CPU"
    what = "kernels" if result["device"] == "cuda" else "ops"
    for mode in result["modes"]:
        title = (f"profile: {cfg['name']} cut to {cfg['num_layers']} layers, {cfg['num_experts']} experts, batch "
                 f"{result['batch']}, TP{result['world_size']}, fusion {'on' if mode['fusion'] else 'off'} "
                 f"({mode['strategy']}, MoE runner {mode['moe_runner']}), {result['steps']} eager steps")
        table = Table(title=title)
        for col in ("stage", f"{unit} us/step", "share", f"{what}/step", "est. MB/step", "est. GB/s"):
            table.add_column(col, justify="right" if col != "stage" else "left")
        total = 0.0
        for s in STAGES:
            row = mode["stages"][s]
            total += row["time_us_per_step"]
            mb = "-" if row["bytes_per_step"] is None else f"{row['bytes_per_step'] / 1e6:.2f}"
            gbps = "-" if row["gbps"] is None else format_gbps(row["gbps"])
            table.add_row(STAGE_TITLES[s], f"{row['time_us_per_step']:.1f}", f"{100 * row['share']:.1f}%",
                          f"{row['launches_per_step']:.1f}", mb, gbps)
        table.add_row("total", f"{total:.1f}", "100%", "", "", "")
        console.print(table)
        console.print(f"allreduces per step: {sum(mode['allreduces_per_step'].values())} "
                      f"(expected {2 * cfg['num_layers']}: 2 per layer)")
    for trace in result.get("trace") or []:
        console.print(f"trace: {trace}", highlight=False, soft_wrap=True)
    for key in ("plot", "results_file"):
        if result.get(key):
            console.print(f"{key.replace('_', ' ')}: {result[key]}", highlight=False, soft_wrap=True)
    if not result.get("results_file"):
        console.print("result rows not kept (pass --results PATH to keep them)", highlight=False)
    per_mode = ", ".join(f"fusion {'on' if m['fusion'] else 'off'} "
                         f"{sum(r['time_us_per_step'] for r in m['stages'].values()):.1f} us/step"
                         for m in result["modes"])
    console.print(f"profile: {per_mode}; allreduce count {'ok' if result['allreduce_count_ok'] else 'WRONG'}",
                  highlight=False, soft_wrap=True)
