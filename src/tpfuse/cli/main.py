"""`tpfuse` entry point: builds the argument parser from one module per subcommand.

Each subcommand module defines `add_parser(subparsers)` (cheap: no torch import) and
`run(args) -> int`. Exit codes: 0 ok, 1 negative verdict (REVERT, gates found with
--fail-on-gates, a failed check), 2 usage or environment error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import sys
from typing import Any

from tpfuse._version import __version__

# subcommand module names under tpfuse.cli, in the order `tpfuse --help` lists them.
COMMANDS = ("doctor", "selftest", "diagnose", "tune", "verify", "bench", "profile", "audit")

EXIT_OK, EXIT_NEGATIVE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Raised by a subcommand for bad arguments or an unusable environment (exit code 2)."""


def _finite(obj: Any) -> Any:
    """`obj` with every NaN/inf float replaced by None (JSON has no such numbers)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps_json(obj: Any, *, indent: int | None = 2, default: Any = None) -> str:
    """Strict JSON for every `--json` output: a value that was not measured (NaN) becomes null,
    so that any JSON parser, not only Python's, reads what tpfuse prints."""
    return json.dumps(_finite(obj), indent=indent, default=default, allow_nan=False)


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
    from tpfuse.cli.ranks import install_warning_format

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
