"""`tpfuse doctor`: what this machine can do, and which strategies may run here and why not.

Prints the capability probe as tables (machine, GPUs, GPU pairs, versions, optional packages),
then the admission verdict of every registered strategy for one representative problem (built
from --op/--tokens/--hidden/--dtype/--world-size), the MoE runner report when that part is
installed, and with --measure the measured peer fabric. `--json` prints the same content as one
JSON object on stdout and nothing else there (progress goes to stderr). Exit 0 when the probe
ran (a strategy that is not admitted is information, not a failure), 2 on usage errors or when a
package the ranks need at run time (numpy) is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tpfuse.cli.exits import EXIT_OK, EXIT_USAGE, UsageError, dumps_json

# GLM-5's hidden size; 8 tokens is a decode batch, where allreduce latency dominates a step.
# Both are labelled defaults, not measurements.
DEFAULT_HIDDEN = 6144
DEFAULT_TOKENS = 8
DEFAULT_DTYPE = "bfloat16"
DEFAULT_OP = "all_reduce_residual_rmsnorm"
CPU_DEFAULT_WORLD_SIZE = 2  # the smallest group with a real collective


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="probe this machine and say which strategies are admitted here, and why not",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--world-size", type=int, default=None, help="ranks of the problem (default: the number of GPUs, or 2 on CPU)")
    p.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN, help=f"hidden size (default {DEFAULT_HIDDEN}, GLM-5)")
    p.add_argument("--tokens", dest="num_tokens", metavar="TOKENS", type=int, default=DEFAULT_TOKENS,
                   help=f"tokens per call (default {DEFAULT_TOKENS})")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, help=f"activation dtype (default {DEFAULT_DTYPE})")
    p.add_argument("--op", default=DEFAULT_OP, help=f"collective op (default {DEFAULT_OP})")
    p.add_argument("--quant", default=None, help="quantized output format of the problem: fp8_static, fp8_per_token, "
                   "fp8_per_group or nvfp4 (admission then says which conversion each strategy uses)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the problem's ranks hold their tensors (auto: cuda when the probe finds a GPU)")
    p.add_argument("--shared-gpu", action="store_true",
                   help="model ranks that share one GPU (gloo with CUDA tensors); allows --world-size above the GPU count")
    p.add_argument("--measure", action="store_true", help="also measure peer read/write bandwidth and latency between GPUs")
    p.set_defaults(run=run)


def _check_args(args) -> object:
    """Validates the problem flags before anything is probed; returns the Op."""
    from tpfuse.spec import DTYPE_BYTES, Op

    ops = [op.value for op in Op]
    if args.op not in ops:
        raise UsageError(f"--op {args.op!r} is not an op; use one of: {', '.join(ops)}")
    from tpfuse.quant import KINDS

    if args.quant is not None and (args.quant not in KINDS or args.op != DEFAULT_OP):
        raise UsageError(f"--quant {args.quant!r} needs --op {DEFAULT_OP} and one of: {', '.join(KINDS)}")
    if args.dtype not in DTYPE_BYTES:
        raise UsageError(f"--dtype {args.dtype!r} is not supported; use one of: {', '.join(DTYPE_BYTES)}")
    for flag, value in (("--hidden", args.hidden), ("--tokens", args.num_tokens), ("--world-size", args.world_size)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value} must be at least 1; pass a positive integer")
    return Op(args.op)


def problem_of(args, caps, op):
    """The Problem admission is asked about: the flags' ranks (`tpfuse.cli.ranks.resolve_ranks`,
    planned for the GPUs the probe found) and `tpfuse.group.representative_problem`."""
    from tpfuse.cli.ranks import resolve_ranks
    from tpfuse.group import representative_problem

    num_gpus = len(caps.gpus)
    # Default: every GPU (even one), or the smallest CPU group.
    default = num_gpus if num_gpus and args.device != "cpu" else CPU_DEFAULT_WORLD_SIZE
    ranks = resolve_ranks(args.world_size, args.device, shared_gpu=args.shared_gpu, default_world_size=default,
                          num_gpus=num_gpus)
    return representative_problem(op, args.num_tokens, args.hidden, args.dtype, caps, world_size=ranks.world_size,
                                  backend=ranks.backend, device_type=ranks.device, quant=getattr(args, "quant", None))


def moe_runner_section(caps) -> dict:
    """The MoE runner report of tpfuse.models.moe_runners, or why there is none."""
    try:
        from tpfuse.models.moe_runners import runner_report
    except ImportError as exc:
        return {"available": False, "reason": f"not available: {exc}", "runners": []}
    try:
        runners = [dict(row) for row in runner_report(caps)]
    except Exception as exc:  # a failing optional section must not hide the rest of the report
        return {"available": False, "reason": f"runner_report failed: {type(exc).__name__}: {exc}", "runners": []}
    return {"available": True, "reason": "", "runners": runners}


def _progress_adapter(progress, task):
    """progress(description, completed, total) for measure_fabric; also accepts (completed, total),
    a fraction in [0, 1], or the same as keywords, so the callback tolerates either calling style."""

    def update(*args, **kwargs):
        text = [a for a in args if isinstance(a, str)]
        numbers = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        fields = {}
        if text or "description" in kwargs:
            fields["description"] = kwargs.get("description", text[0] if text else "")
        if len(numbers) >= 2:
            fields["completed"], fields["total"] = numbers[0], numbers[1]
        elif len(numbers) == 1:
            fields["completed"], fields["total"] = numbers[0], 1.0
        for key in ("completed", "total", "advance"):
            if key in kwargs:
                fields[key] = kwargs[key]
        progress.update(task, **fields)

    return update


def measure_section(caps):
    """(caps with fabric, section dict); failures become the reason, never an exit code."""
    from rich.console import Console
    from rich.progress import Progress

    try:
        from tpfuse.probe.fabric import measure_fabric
    except ImportError as exc:
        return caps, {"measured": False, "reason": f"fabric measurement not available: {exc}"}
    try:
        with Progress(console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task("measuring peer traffic", total=None)
            fabric = measure_fabric(caps, progress=_progress_adapter(progress, task))
    except Exception as exc:  # RuntimeError with a reason (e.g. fewer than 2 GPUs), or a failure
        reason = str(exc) if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: {exc}"
        return caps, {"measured": False, "reason": reason}
    return dataclasses.replace(caps, fabric=fabric), {"measured": True, "reason": ""}


def build_report(args):
    """(Capabilities, report dict): the dict is exactly what --json prints."""
    from tpfuse.integrations.doctor import engine_rows
    from tpfuse.probe import probe
    from tpfuse.strategies import admission, strategy_names

    op = _check_args(args)
    caps = probe()
    problem = problem_of(args, caps, op)
    verdicts = admission(problem, caps, strategy_names())
    fabric = None
    if args.measure:
        caps, fabric = measure_section(caps)
    return caps, {
        "probe": caps.to_dict(),
        "problem": {
            "op": problem.op.value, "num_tokens": problem.num_tokens, "hidden": problem.hidden,
            "dtype": problem.dtype, "quant": problem.quant, "facts": dataclasses.asdict(problem.facts),
        },
        "admission": {name: {"admitted": v.ok, "reason": v.reason} for name, v in verdicts.items()},
        "moe_runners": moe_runner_section(caps),
        "engines": engine_rows(),
        "fabric": fabric,
        "runtime_packages": runtime_packages(),
    }


def runtime_packages() -> dict:
    """{package: {installed, needed_for}} for the packages the ranks need at run time (preflight)."""
    import importlib.util

    from tpfuse.cli.preflight import RUNTIME_PACKAGES

    return {name: {"installed": importlib.util.find_spec(name) is not None, "needed_for": why}
            for name, why in RUNTIME_PACKAGES.items()}


def missing_runtime(report: dict) -> list[str]:
    return [name for name, row in report["runtime_packages"].items() if not row["installed"]]


def render(caps, report: dict, console) -> None:
    from rich.table import Table
    from rich.text import Text

    from tpfuse.probe.tables import add_row, capability_tables

    def line(text: str) -> None:  # plain text: reasons may contain "[...]", which is not markup
        console.print(text, soft_wrap=True, markup=False, highlight=False)

    for table in capability_tables(caps):
        console.print(table)
    for note in caps.notes:
        line(f"note: {note}")
    p, g = report["problem"], report["problem"]["facts"]
    line(
        f"Strategy admission for {p['op']}{', ' + p['quant'] + ' output' if p.get('quant') else ''}, "
        f"{p['num_tokens']} tokens x {p['hidden']} hidden, {p['dtype']}, world size "
        f"{g['world_size']} ({g['backend']}, {g['device_type']}, peer access {'yes' if g['peer_access'] else 'no'}"
        f"{', one shared GPU' if g['shares_device'] else ''}):"
    )
    table = Table(title="Strategy admission")
    for column in ("strategy", "verdict", "reason"):
        table.add_column(column)
    for name, v in report["admission"].items():
        verdict = Text("admitted", style="green") if v["admitted"] else Text("not admitted", style="red")
        add_row(table, name, verdict, v["reason"])
    console.print(table)
    moe = report["moe_runners"]
    if not moe["available"]:
        line(f"MoE runners: {moe['reason']}")
    else:
        table = Table(title="MoE runners")
        for column in ("runner", "verdict", "reason", "chosen", "why"):
            table.add_column(column)
        for row in moe["runners"]:
            add_row(table, row.get("name"), "admitted" if row.get("admitted") else "not admitted",
                    row.get("reason", ""), "yes" if row.get("chosen") else "no", row.get("why", ""))
        console.print(table)
    from tpfuse.integrations.doctor import engine_table

    console.print(engine_table(report["engines"]))
    fabric = report["fabric"]
    if fabric is not None and not fabric["measured"]:
        line(f"Fabric not measured: {fabric['reason']}")
    for name in missing_runtime(report):
        line(f"MISSING: {name} is not installed; {report['runtime_packages'][name]['needed_for']}, so no Communicator "
             f"can be built here. Install it with `pip install {name}`.")


def run(args: argparse.Namespace) -> int:
    caps, report = build_report(args)
    code = EXIT_USAGE if missing_runtime(report) else EXIT_OK
    if args.json:
        sys.stdout.write(dumps_json(report) + "\n")
        return code
    from rich.console import Console

    render(caps, report, Console())
    return code
