"""`tpfuse bench e2e`: decode throughput, step latency, J/token and allreduces per step of the reference model.

Runs the tensor-parallel MoE decoder of tpfuse.models (a preset, cut with --layers/--experts)
with fusion on and/or off over a list of batch sizes, prints a table (or `--json`), and with
`--results PATH` appends one result row per point to PATH (or PATH/e2e.jsonl for a directory).
Before any rank starts: the cut, the --world-size split, a --strategy asked for by name, and the
memory one rank would hold (`ModelConfig.rank_memory_bytes`) are checked, each refusal naming the
fix. Exit 0 when every point counted exactly two allreduces per layer per step, 1 when one did not
(or a rank failed), 2 on usage or environment errors.
"""

from __future__ import annotations

import argparse
import sys

from tpfuse.cli.args import PRESET_CHOICES, add_rank_args
from tpfuse.cli.exits import EXIT_NEGATIVE, EXIT_OK, CommandError, UsageError, dumps_json

DEFAULT_WORLD_SIZE = 1  # the model on one GPU (or one CPU process) unless asked for tensor parallelism
# The preset when none is given: GLM-5 (the model of the design's story) on GPUs; on CPU ranks the
# test-sized model, which runs in seconds there (GLM-5 cut to 2 layers and 8 experts holds 14 GiB).
DEFAULT_PRESET = {"cuda": "glm5", "cpu": "tiny"}
# The messages of tpfuse.models and tpfuse.e2e start with the function or class that raised; the
# CLI names its flags instead.
_INTERNAL_PREFIXES = ("ModelConfig: ", "model_config: ", "E2ESpec: ", "get_preset: ")


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
    p.add_argument("--preset", choices=PRESET_CHOICES, default=None,
                   help="model preset (default: glm5 on CUDA ranks, tiny on CPU ranks)")
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


def user_message(exc: Exception) -> str:
    """`exc`'s message without the internal name it starts with (`_INTERNAL_PREFIXES`)."""
    text = str(exc)
    for prefix in _INTERNAL_PREFIXES:
        text = text.removeprefix(prefix)
    return text


def make_spec(args, **extra):
    """The E2ESpec and the ranks the flags ask for, after every check that needs no rank: the cut,
    the split over --world-size, the MoE runner, a --strategy asked for by name, and the memory a
    rank would hold. Imports torch only where the device needs it (`tpfuse.cli.ranks`)."""
    from tpfuse.cli.args import check_rank_args
    from tpfuse.cli.preflight import check_positive
    from tpfuse.cli.ranks import resolve_ranks
    from tpfuse.e2e.decode import E2ESpec

    check_rank_args(args)
    if args.shared_gpu:  # the one rank flag these commands refuse
        raise UsageError("--shared-gpu: the reference model is timed with one GPU per rank over NCCL, and ranks "
                         "sharing a GPU would time the sharing; drop --shared-gpu (`tpfuse selftest --shared-gpu` "
                         "checks the GPU code paths on one GPU)")
    check_positive(layers=args.layers, experts=args.experts, vocab=args.vocab, prompt_len=args.prompt_len,
                   context=args.context, steps=extra.get("steps"))
    if args.dense_layers is not None and args.dense_layers < 0:
        raise UsageError(f"--dense-layers must be >= 0, got {args.dense_layers}; pass 0 for an all-MoE cut")
    ranks = resolve_ranks(args.world_size, args.device, default_world_size=DEFAULT_WORLD_SIZE)
    preset = args.preset or DEFAULT_PRESET[ranks.device]
    if args.experts is not None:
        from tpfuse.models.config import model_config

        top_k = model_config(preset).top_k
        if top_k and args.experts < top_k:
            raise UsageError(f"--experts {args.experts} is below {preset}'s top-{top_k} routing; pass --experts "
                             f"{top_k} or more")
    try:
        spec = E2ESpec(
            preset=preset, layers=args.layers, experts=args.experts, dense_layers=args.dense_layers,
            vocab=args.vocab, tp=ranks.world_size, device=ranks.device, dtype=args.dtype, strategy=args.strategy,
            moe_runner=args.moe_runner, prompt_len=args.prompt_len, context=args.context, seed=args.seed, **extra,
        )
        cfg = spec.config()
    except ValueError as exc:
        raise UsageError(_cut_message(args, exc)) from None
    _check_split(cfg, ranks.world_size)
    if spec.moe_runner is not None:
        from tpfuse.models.moe_runners import RUNNERS

        if spec.moe_runner not in RUNNERS:
            raise UsageError(f"--moe-runner {spec.moe_runner!r} is not a runner; use one of: {', '.join(RUNNERS)}")
    _check_memory(spec, cfg, ranks, explicit_preset=args.preset is not None)
    if spec.strategy != "auto":
        _check_strategy(spec, cfg, ranks)
    return spec, ranks


def _cut_message(args, exc: ValueError) -> str:
    """A cut the model refuses, said in the flags' words."""
    text = user_message(exc)
    if "first_dense_layers" in text:
        return f"--dense-layers {args.dense_layers} is more than the cut's {args.layers or 'preset'} layers; pass fewer"
    return text


def _check_split(cfg, world_size: int) -> None:
    try:
        cfg.check_world_size(world_size)
    except ValueError as exc:
        why = user_message(exc).replace("a tensor-parallel size", "a --world-size")
        raise UsageError(f"--world-size {world_size}: {why}") from None


def _itemsize(spec) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[spec.dtype or ("bfloat16" if spec.device == "cuda" else "float32")]


def _check_memory(spec, cfg, ranks, *, explicit_preset: bool) -> None:
    """UsageError when one rank of this cut does not fit, naming a cut that does."""
    from tpfuse.cli.preflight import check_rank_memory

    def need(c) -> int:
        return c.rank_memory_bytes(ranks.world_size, itemsize=_itemsize(spec), batch=max(spec.batches),
                                   context=spec.context, prompt_len=spec.prompt_len)

    if not _fits(need(cfg), ranks):
        fits = _fitting_cut(spec, cfg, ranks, need)
        fix = (f"cut it with {fits}, " if fits else "") + "or pass --preset tiny (the test-sized model)"
        check_rank_memory(need(cfg), world_size=ranks.world_size, device=ranks.device,
                          what=f"{cfg.name}{'' if explicit_preset else ' (the default preset)'} with {cfg.num_layers} "
                               f"layers and {cfg.num_experts} experts at batch {max(spec.batches)}",
                          fix=fix)


def _budget(ranks) -> int | None:
    """The bytes one rank's model may take here: its share of the host memory for CPU ranks (less
    the process itself), its GPU's memory for CUDA ranks; None if unknown."""
    from tpfuse import host_memory
    from tpfuse.cli.preflight import RANK_MEMORY_BYTES, gpu_memory_bytes

    if ranks.device != "cpu":
        return gpu_memory_bytes()
    available = host_memory.available_bytes()
    return None if available is None else available // ranks.world_size - RANK_MEMORY_BYTES


def _fits(need: int, ranks) -> bool:
    budget = _budget(ranks)
    return budget is None or need <= budget


def _fitting_cut(spec, cfg, ranks, need) -> str:
    """The flags of the largest of a few cuts of the preset that would fit here, or "" (estimates)."""
    from tpfuse.models.config import model_config

    experts = [e for e in (64, 32, 16, 8) if cfg.top_k <= e < cfg.num_experts and e % ranks.world_size == 0]
    for layers in sorted({min(cfg.num_layers, 4), 2, 1}, reverse=True):
        for num_experts in ([None, *experts] if cfg.num_moe_layers else [None]):
            for vocab in (spec.vocab, 32768):
                try:
                    cut = model_config(spec.preset, layers=layers, experts=num_experts or spec.experts,
                                       dense_layers=spec.dense_layers, vocab=vocab)
                    cut.check_world_size(ranks.world_size)
                except ValueError:
                    continue
                if _fits(need(cut), ranks):
                    flags = [f"--layers {layers}", *([f"--experts {num_experts}"] if num_experts else []),
                             *([f"--vocab {vocab}"] if vocab else [])]
                    return " ".join(flags)
    return ""


def _check_strategy(spec, cfg, ranks) -> None:
    """A --strategy asked for by name, admitted for the calls this run makes, or UsageError."""
    from tpfuse.cli.preflight import reject_not_admitted

    dtype = spec.dtype or ("bfloat16" if ranks.device == "cuda" else "float32")
    problems = [("all_reduce_residual_rmsnorm" if fused else "all_reduce", batch, cfg.hidden, dtype, fused)
                for fused in spec.fusion for batch in spec.batches]
    reject_not_admitted([spec.strategy], problems, world_size=ranks.world_size, backend=ranks.backend,
                        device=ranks.device)


def run(args) -> int:
    spec, ranks = make_spec(args, batches=args.batch, fusion=fusion_modes(args.fusion), steps=args.steps,
                            min_seconds=args.min_seconds, graphs=not args.no_graphs, progress=True)
    if args.results:
        from tpfuse.cli.preflight import check_writable
        from tpfuse.results import results_file

        check_writable(str(results_file(args.results, "e2e.jsonl")), flag="--results")
    import time

    from tpfuse.cli.ranks import describe_failure, run_cli_ranks
    from tpfuse.e2e.decode import e2e_rows, run_e2e
    from tpfuse.results import append_rows, results_file
    from tpfuse.spawn import RankFailure

    started = time.perf_counter()
    try:
        result = run_e2e(spec, runner=run_cli_ranks)
    except RankFailure as exc:
        raise CommandError(f"{spec.tp} rank(s) failed: {describe_failure(exc)}") from None
    except RuntimeError as exc:
        raise UsageError(user_message(exc)) from None
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
