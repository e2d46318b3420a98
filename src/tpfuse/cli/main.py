"""`tpfuse` entry point: builds the argument parser from one module per subcommand.

Each subcommand module defines `add_parser(subparsers)` (cheap: no torch import) and
`run(args) -> int`. Exit codes: 0 ok, 1 negative verdict (REVERT, gates found with
--fail-on-gates, a failed check), 2 usage or environment error.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from tpfuse._version import __version__
from tpfuse.cli.exits import EXIT_USAGE, CommandError, dumps_json
from tpfuse.cli.ranks import install_warning_format

# subcommand module names under tpfuse.cli, in the order `tpfuse --help` lists them.
COMMANDS = ("doctor", "selftest", "diagnose", "tune", "verify", "bench", "profile", "audit")


class _ParseError(Exception):
    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors reach `main` (which prints them as argparse does, and as one
    JSON object with --json) instead of exiting from inside argparse. Subparsers are this class too."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        raise _ParseError(self.prog, message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tpfuse", description="Fused tensor-parallel collectives: probe, choose, verify, audit.")
    parser.add_argument("--version", action="version", version=f"tpfuse {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"tpfuse.cli.{name}")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _ParseError as exc:
        print(f"{exc.prog}: error: {exc}", file=sys.stderr)
        if "--json" in argv:
            print(dumps_json({"error": f"{exc.prog}: {exc}", "exit_code": EXIT_USAGE}, indent=None))
        return EXIT_USAGE
    except SystemExit as exc:  # --help and --version exit 0 from inside argparse
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    install_warning_format()
    try:
        return int(args.run(args))
    except CommandError as exc:
        return _failed(args, str(exc), exc.exit_code)
    except KeyboardInterrupt:
        return _failed(args, "interrupted", EXIT_INTERRUPTED)
    except Exception as exc:  # a defect: the traceback goes to stderr, a program reading stdout still gets JSON
        if getattr(args, "json", False):
            _json_error(args, f"internal error: {type(exc).__name__}: {exc}", EXIT_INTERNAL)
        raise


# 128 + SIGINT, what a shell reports for a command ended by Ctrl-C; 1 for a defect (Python's own code
# for an uncaught exception, which it still is).
EXIT_INTERRUPTED, EXIT_INTERNAL = 130, 1


def _command(args) -> str:
    """The command as typed: `tpfuse bench e2e`, `tpfuse tune`."""
    return " ".join(["tpfuse", args.command, *([args.bench_command] if getattr(args, "bench_command", None) else [])])


def _json_error(args, message: str, exit_code: int) -> None:
    print(dumps_json({"error": f"{_command(args)}: {message}", "exit_code": exit_code}, indent=None), flush=True)


def _failed(args, message: str, exit_code: int) -> int:
    """One line on stderr and, with --json, one JSON object on stdout; `exit_code`."""
    print(f"{_command(args)}: {message}", file=sys.stderr)
    if getattr(args, "json", False):  # a program reading stdout still gets one JSON document
        _json_error(args, message, exit_code)
    return exit_code
