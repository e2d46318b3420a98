"""`tpfuse diagnose`: sample every GPU through NVML while a workload runs, summarise, flag findings.

    tpfuse diagnose [options] -- COMMAND ...   run COMMAND as a child, sample until it exits
    tpfuse diagnose [options] --pid P          sample until process P exits (or --duration)
    tpfuse diagnose [options] --duration S     sample for S seconds
    tpfuse diagnose [options] --from FILE      analyse a recording made with --save (no NVML needed)

Exit codes: 0 analysed; 1 the watched command exited with a non-zero status (its code is in the
report); 2 usage error, or no NVML / no GPU (the message names what is missing).
With --json, stdout carries one JSON document (tpfuse.diagnose.report.report_dict) and the
child's stdout goes to stderr.
"""

from __future__ import annotations

import argparse
import sys

from tpfuse.cli.exits import EXIT_NEGATIVE, EXIT_OK, EXIT_USAGE, UsageError, dumps_json

# Mirrors tpfuse.diagnose.sampler (not imported here: a subcommand's parser imports nothing heavy).
DEFAULT_INTERVAL_S = 0.1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "diagnose",
        help="sample GPU power, utilisation and clocks while a workload runs; flag waiting, idle and uneven GPUs",
        description="Sample every GPU through NVML (power against the enforced limit, utilisation, clocks, memory) "
                    "while a workload runs, summarise per GPU and flag the signature of GPUs waiting on "
                    "communication (high utilisation with low power), idle GPUs and uneven ranks.",
    )
    p.add_argument("--pid", type=int, help="watch this running process until it exits")
    p.add_argument("--duration", type=float, metavar="S",
                   help="sample for S seconds (alone), or at most S seconds (with --pid or a command)")
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="S",
                   help=f"seconds between samples (default {DEFAULT_INTERVAL_S}: NVML updates utilisation every "
                        "1/6 s to 1 s and power as a 1 s average, so 100 ms reads every update)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of tables")
    p.add_argument("--png", metavar="FILE", help="write a PNG of power/limit and utilisation over time (needs matplotlib)")
    p.add_argument("--save", metavar="FILE", help="save the samples as JSON, to re-analyse later with --from")
    p.add_argument("--from", dest="from_file", metavar="FILE", help="analyse a recording saved with --save; no NVML needed")
    # dest is not "command": tpfuse.cli.main stores the subcommand's name there.
    p.add_argument("workload", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="run COMMAND as a child and sample until it exits")
    p.set_defaults(run=run)


def _command(args) -> list[str]:
    command = list(args.workload or [])
    if command and command[0] == "--":
        command = command[1:]
    return command


def _check(args, command: list[str]) -> None:
    if args.from_file and (command or args.pid is not None or args.duration is not None):
        raise UsageError("--from analyses a recording; it takes no command, --pid or --duration")
    if command and args.pid is not None:
        raise UsageError("give either -- COMMAND or --pid P, not both")
    if not (args.from_file or command or args.pid is not None or args.duration is not None):
        raise UsageError("nothing to watch; give -- COMMAND ..., --pid P, --duration S or --from FILE")
    if args.duration is not None and not args.duration > 0:
        raise UsageError(f"--duration {args.duration} must be > 0 seconds; pass e.g. --duration 10")
    from tpfuse.diagnose.sampler import MAX_INTERVAL_S, MIN_INTERVAL_S

    if not MIN_INTERVAL_S <= args.interval <= MAX_INTERVAL_S:
        raise UsageError(f"--interval {args.interval} is outside [{MIN_INTERVAL_S}, {MAX_INTERVAL_S}] seconds; "
                         f"the default {DEFAULT_INTERVAL_S} suits most runs")
    if args.pid is not None:
        from tpfuse.diagnose.watch import pid_alive

        if args.pid <= 0 or not pid_alive(args.pid):
            raise UsageError(f"--pid {args.pid}: no such process; give the pid of a running process")


def _environment_error(args, message: str) -> int:
    print(f"tpfuse {message}", file=sys.stderr)
    if args.json:
        print(dumps_json({"error": message, "exit_code": EXIT_USAGE}, indent=None))
    return EXIT_USAGE


def _record(args, command: list[str]):
    """Sample live; returns (recording, None) or (None, exit code) when NVML is unusable."""
    from tpfuse.diagnose.sampler import NvmlUnavailable, open_nvml
    from tpfuse.diagnose.watch import watch

    try:
        nvml = open_nvml()
    except NvmlUnavailable as exc:
        return None, _environment_error(args, str(exc))
    try:
        kwargs = dict(command=command or None, pid=args.pid, duration_s=args.duration, interval_s=args.interval,
                      # fd 2, not sys.stderr: the child needs a real descriptor.
                      child_stdout=2 if args.json else None)
        if args.json:
            return watch(nvml, **kwargs), None
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        with Live(Text("diagnose: starting"), console=Console(stderr=True), refresh_per_second=4, transient=True) as live:
            return watch(nvml, status=lambda line: live.update(Text(line)), **kwargs), None
    except ValueError as exc:  # the command could not start
        raise UsageError(str(exc).removeprefix("diagnose: ")) from None
    finally:
        nvml.close()


def run(args) -> int:
    command = _command(args)
    _check(args, command)
    from tpfuse.diagnose import analysis, plot, report
    from tpfuse.diagnose.samples import load_recording, save_recording

    if args.png:
        try:
            plot.require_matplotlib()
        except RuntimeError as exc:  # before sampling: do not run a workload only to fail at the end
            return _environment_error(args, str(exc))
    if args.from_file:
        try:
            rec = load_recording(args.from_file)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        source = args.from_file
    else:
        rec, code = _record(args, command)
        if rec is None:
            return code
        source = "nvml"
    summaries = analysis.summarise(rec)
    findings = analysis.find(rec, summaries)
    saved = str(save_recording(rec, args.save)) if args.save else None
    png = str(plot.write_png(rec, args.png)) if args.png else None
    if args.json:
        print(dumps_json(report.report_dict(rec, summaries, findings, source=source, png=png, saved=saved)))
    else:
        from rich.console import Console

        console = Console()
        report.print_report(console, rec, summaries, findings, source=source)
        for label, path in (("samples saved to", saved), ("plot written to", png)):
            if path:
                console.print(f"{label} {path}", highlight=False)
    if rec.exit_code:
        print(f"tpfuse diagnose: the command exited with status {rec.exit_code}", file=sys.stderr)
        return EXIT_NEGATIVE
    return EXIT_OK
