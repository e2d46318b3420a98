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
from tpfuse.cli.exits import EXIT_USAGE, UsageError, dumps_json
from tpfuse.cli.ranks import install_warning_format

# subcommand module names under tpfuse.cli, in the order `tpfuse --help` lists them.
COMMANDS = ("doctor", "selftest", "diagnose", "tune", "verify", "bench", "profile", "audit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpfuse", description="Fused tensor-parallel collectives: probe, choose, verify, audit.")
    parser.add_argument("--version", action="version", version=f"tpfuse {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"tpfuse.cli.{name}")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    install_warning_format()
    try:
        return int(args.run(args))
    except UsageError as exc:
        print(f"tpfuse {args.command}: {exc}", file=sys.stderr)
        if getattr(args, "json", False):  # a program reading stdout still gets one JSON document
            print(dumps_json({"error": f"tpfuse {args.command}: {exc}", "exit_code": EXIT_USAGE}, indent=None))
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"tpfuse {args.command}: interrupted", file=sys.stderr)
        return 130
