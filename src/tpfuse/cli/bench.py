"""`tpfuse bench e2e`: decode throughput, step latency, J/token and allreduces per step of the reference model.

Runs the tensor-parallel MoE decoder of tpfuse.models (a preset, cut with --layers/--experts)
with fusion on and/or off over a list of batch sizes, prints a table (or `--json`), and with
`--results PATH` appends one result row per point to PATH (or PATH/e2e.jsonl for a directory). Exit 0 when every point counted exactly two
allreduces per layer per step, 1 when one did not, 2 on usage or environment errors.
"""

from __future__ import annotations

import argparse
import sys

from tpfuse.cli.args import add_rank_args
from tpfuse.cli.exits import EXIT_NEGATIVE, EXIT_OK, UsageError, dumps_json

DEFAULT_WORLD_SIZE = 1  # the model on one GPU (or one CPU process) unless asked for tensor parallelism


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1,8,64") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,8,64")
    return values


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Model and run options shared by `bench e2e` and `profile`."""
    p.add_argument("--preset", default="glm5", help="model preset: glm5, deepseek-v3, qwen3-235b, llama3-70b, tiny (default glm5)")
    p.add_argument("--layers", type=int, help="cut the model to this many layers (dense:MoE ratio kept)")
    p.add_argument("--experts", type=int, help="routed experts (top-k and expert width kept)")
    p.add_argument("--dense-layers", type=int, help="how many of the first layers are dense (default: the preset's ratio)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: the preset's)")
    add_rank_args(p, default_world_size=DEFAULT_WORLD_SIZE)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--strategy", default="auto", help="Communicator strategy (default auto)")
    p.add_argument("--moe-runner", help="force one MoE runner (loop, dense, grouped_mm); default: measured choice")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per sequence (default 16)")
    p.add_argument("--context", type=int, default=64, help="KV-cache slots per sequence (default 64)")
    p.add_argument("--seed", type=int, default=0, help="weight and prompt seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--results", default=None, metavar="PATH",
                   help="also append result rows to PATH: a file, or a directory (then PATH/e2e.jsonl for bench e2e, "
                        "PATH/profile.jsonl for profile); default: none written")


def fusion_modes(text: str) -> tuple[bool, ...]:
    return {"on": (True,), "off": (False,), "both": (True, False)}[text]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks of the reference model", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    e2e = sub.add_parser("e2e", help="prefill + CUDA-graph decode of the reference TP MoE model, fusion on/off",
                         description=__doc__.split("\n\n")[0])
    add_model_arguments(e2e)
    e2e.add_argument("--batch", type=_int_list, default=(1, 8, 64), help="decode batch sizes, comma-separated (default 1,8,64)")
    e2e.add_argument("--fusion", choices=("on", "off", "both"), default="both", help="fused allreduce+norm (default both)")
    e2e.add_argument("--steps", type=int, default=20, help="timed decode steps per point, at least (default 20)")
    e2e.add_argument("--min-seconds", type=float, default=1.0,
                     help="time each point for at least this long, for the NVML energy counter (default 1.0)")
    e2e.add_argument("--no-graphs", action="store_true", help="eager decode steps on CUDA too")
    e2e.set_defaults(run=run)
    p.set_defaults(run=lambda args: _no_subcommand(p))


def _no_subcommand(p) -> int:
    p.print_help(sys.stderr)
    return 2


def make_spec(args, **extra):
    """The E2ESpec the flags ask for, after the checks that need no torch (the world size is checked
    again by `check_model`, and resolved with the device by `resolve_spec_ranks`)."""
    from tpfuse.cli.preflight import check_positive, check_world_size
    from tpfuse.e2e.decode import E2ESpec

    check_world_size(args.world_size)
    if args.shared_gpu:  # the one rank flag these commands refuse
        raise UsageError("--shared-gpu: the reference model is timed with one GPU per rank over NCCL, and ranks "
                         "sharing a GPU would time the sharing; drop --shared-gpu (`tpfuse selftest --shared-gpu` "
                         "checks the GPU code paths on one GPU)")
    check_positive(layers=args.layers, experts=args.experts, vocab=args.vocab, prompt_len=args.prompt_len,
                   context=args.context, steps=extra.get("steps"))
    num_ranks = args.world_size if args.world_size is not None else DEFAULT_WORLD_SIZE
    try:
        return E2ESpec(
            preset=args.preset, layers=args.layers, experts=args.experts, dense_layers=args.dense_layers,
            vocab=args.vocab, tp=num_ranks, device=args.device, dtype=args.dtype, strategy=args.strategy,
            moe_runner=args.moe_runner, prompt_len=args.prompt_len, context=args.context, seed=args.seed, **extra,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_model(spec) -> None:
    """Usage errors for a bad preset, cut or --world-size, before any process starts or torch is imported."""
    from tpfuse.cli.preflight import check_world_size, require_runtime

    check_world_size(spec.tp)
    require_runtime()
    try:
        spec.config().check_world_size(spec.tp)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if spec.moe_runner is not None:
        from tpfuse.models.moe_runners import RUNNERS

        if spec.moe_runner not in RUNNERS:
            raise UsageError(f"--moe-runner {spec.moe_runner!r} is not a runner; use one of: {', '.join(RUNNERS)}")


def resolve_spec_ranks(spec, args):
    """(`spec` with its device resolved, Ranks) by `tpfuse.cli.ranks.resolve_ranks`; imports torch."""
    import dataclasses

    from tpfuse.cli.ranks import resolve_ranks

    ranks = resolve_ranks(spec.tp, args.device, default_world_size=DEFAULT_WORLD_SIZE)
    return dataclasses.replace(spec, device=ranks.device), ranks


def run(args) -> int:
    spec = make_spec(args, batches=args.batch, fusion=fusion_modes(args.fusion), steps=args.steps,
                     min_seconds=args.min_seconds, graphs=not args.no_graphs, progress=True)
    check_model(spec)
    if args.results:
        from tpfuse.cli.preflight import check_writable
        from tpfuse.results import results_file

        check_writable(str(results_file(args.results, "e2e.jsonl")), flag="--results")
    import time

    from tpfuse.cli.ranks import describe_failure, run_cli_ranks
    from tpfuse.e2e.decode import e2e_rows, run_e2e
    from tpfuse.results import append_rows, results_file
    from tpfuse.spawn import RankFailure

    spec, _ = resolve_spec_ranks(spec, args)
    started = time.perf_counter()
    try:
        result = run_e2e(spec, runner=run_cli_ranks)
    except RuntimeError as exc:
        if isinstance(exc, RankFailure):
            print(f"tpfuse bench e2e: {spec.tp} rank(s) failed: {describe_failure(exc)}", file=sys.stderr)
            return EXIT_NEGATIVE
        raise UsageError(str(exc)) from None
    path = None
    if args.results:
        path = str(append_rows(results_file(args.results, "e2e.jsonl"), e2e_rows(spec, result)).resolve())
    counts_ok = all(sum(p["allreduces_per_step"].values()) == p["expected_allreduces_per_step"] for p in result["points"])
    if args.json:
        out = dict(result, results_file=path, allreduce_count_ok=counts_ok)
        for p in out["points"]:
            p.pop("step_us")
        print(dumps_json(out, default=str))
    else:
        _print_table(result, path)
        best = max(result["points"], key=lambda p: p["tok_per_s"])
        print(f"bench e2e: {len(result['points'])} point(s) in {time.perf_counter() - started:.1f} s, best "
              f"{best['tok_per_s']:.1f} tok/s (batch {best['batch']}, fusion {'on' if best['fusion'] else 'off'}); "
              f"allreduce count {'ok' if counts_ok else 'WRONG'}")
    if not counts_ok:
        print("tpfuse bench e2e: a decode step did not make exactly 2 allreduces per layer", file=sys.stderr)
    return EXIT_OK if counts_ok else EXIT_NEGATIVE


def _print_table(result: dict, path: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from tpfuse.results import percentiles

    cfg = result["config"]
    title = (f"bench e2e: {cfg['name']} cut to {cfg['num_layers']} layers ({cfg['first_dense_layers']} dense), "
             f"{cfg['num_experts']} experts top-{cfg['top_k']}, TP{result['world_size']}, {result['dtype']} on "
             f"{result['gpu_name'] or result['device']}")
    table = Table(title=title)
    for col in ("batch", "fusion", "strategy", "MoE runner", "step us (p20-p80)", "tok/s", "J/token",
                "AR/step", "prefill ms"):
        table.add_column(col, justify="right")
    for p in result["points"]:
        _, lo, hi = percentiles(p["step_us"])
        jpt = "n/a" if p["j_per_token"] is None else f"{p['j_per_token']:.4f}"
        table.add_row(str(p["batch"]), "on" if p["fusion"] else "off", p["strategy"], str(p["moe_runner"]),
                      f"{p['median_us']:.0f} ({lo:.0f}-{hi:.0f})", f"{p['tok_per_s']:.1f}", jpt,
                      f"{sum(p['allreduces_per_step'].values())} / {p['expected_allreduces_per_step']}",
                      f"{p['prefill_ms']:.1f}")
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # pipes and logs: keep the table on one line per row
    console.print(table)
    for note in result["notes"]:
        console.print(f"note: {note}")
    if any(p["fusion"] and p["strategy_source"] == "default" for p in result["points"]):
        console.print(f"note: no dispatch table for this machine, so fusion on used the conservative default; "
                      f"measure it with `tpfuse tune --world-size {result['world_size']} --preset {cfg['name']}`",
                      highlight=False, soft_wrap=True)
    if result["points"] and result["points"][0]["j_per_token"] is None:
        console.print(f"note: J/token: {result['points'][0]['energy_note']}")
    console.print(f"rows appended to {path}" if path else "result rows not kept (pass --results PATH to keep them)",
                  highlight=False, soft_wrap=True)
