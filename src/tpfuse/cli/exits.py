"""What every command returns: the exit codes, `CommandError` (a failure told as one line with its
exit code: 1 for a negative outcome such as a failed rank) and `UsageError` (exit 2), and
`dumps_json`, the strict JSON every `--json` prints. The entry point turns either error into one
line on stderr and, with `--json`, one JSON object on stdout.

The entry point (`tpfuse.cli.main`) and every subcommand module share these names, so they live
here, below both: a subcommand never imports the entry point that imports it.
"""

from __future__ import annotations

import json
import math
from typing import Any

EXIT_OK, EXIT_NEGATIVE, EXIT_USAGE = 0, 1, 2


class CommandError(Exception):
    """A command's failure, told as one line; `exit_code` 1 (a negative outcome) unless given."""

    def __init__(self, message: str, exit_code: int = EXIT_NEGATIVE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class UsageError(CommandError):
    """Raised by a subcommand for bad arguments or an unusable environment (exit code 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_USAGE)


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
