"""What every command returns: the exit codes, `UsageError` (exit 2) and `dumps_json`, the strict
JSON every `--json` prints.

The entry point (`tpfuse.cli.main`) and every subcommand module share these names, so they live
here, below both: a subcommand never imports the entry point that imports it.
"""

from __future__ import annotations

import json
import math
from typing import Any

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
