"""Benchmark result rows: one schema for every figure tpfuse reports.

Rows are appended as JSON lines to `benchmarks/results/<name>.jsonl` (one object per line), so
runs accumulate and any row can be traced to the command that produced it.
Schema: op, strategy, shape (dict), dtype, world_size, median, p20, p80, unit, gpu, versions
(dict), date (ISO-8601 UTC), command, plus free-form `extra`. Rows are strict JSON: a value that
was not measured (a row made from no samples, a NaN or infinite float anywhere) is written as null.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tpfuse._version import __version__


@dataclass(frozen=True)
class ResultRow:
    op: str
    strategy: str
    shape: dict
    dtype: str
    world_size: int
    median: float | None
    p20: float | None
    p80: float | None
    unit: str
    gpu: str
    versions: dict
    date: str
    command: str
    extra: dict = field(default_factory=dict)


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    """(median, p20, p80) of `samples`: `tpfuse.timing.summary`, the statistics every report uses."""
    if not samples:
        raise ValueError("percentiles: no samples")
    from tpfuse.timing import summary  # imports torch, which make_row's environment() reads anyway

    stats = summary(samples)
    return stats["median"], stats["p20"], stats["p80"]


def environment() -> tuple[str, dict]:
    """(gpu name or 'cpu: <machine>', versions) of this process, read now."""
    versions = {"python": platform.python_version()}
    gpu = f"cpu: {platform.machine()}"
    try:
        import torch

        versions["torch"] = torch.__version__
        versions["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
            versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except ImportError:
        pass
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass

    versions["tpfuse"] = __version__
    return gpu, versions


def make_row(op: str, strategy: str, shape: dict, dtype: str, world_size: int, samples: list[float], unit: str, **extra) -> ResultRow:
    """A row of `samples`; with no samples (nothing could be measured; say why in `extra`) its
    median, p20 and p80 are None."""
    median, p20, p80 = percentiles(samples) if samples else (None, None, None)
    gpu, versions = environment()
    return ResultRow(
        op=op, strategy=strategy, shape=shape, dtype=dtype, world_size=world_size,
        median=median, p20=p20, p80=p80, unit=unit, gpu=gpu, versions=versions,
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join(sys.argv), extra=extra,
    )


def results_file(target: str | Path, default_name: str) -> Path:
    """Where `--results TARGET` rows go: the file `default_name` inside TARGET when TARGET is an
    existing directory or has no suffix, else TARGET itself (every command takes either form)."""
    target = Path(target)
    return target / default_name if target.is_dir() or not target.suffix else target


def append_rows(path: str | Path, rows: list[ResultRow]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(_finite(asdict(row)), sort_keys=True, allow_nan=False) + "\n")
    return path


def _finite(value):
    """`value` with every NaN or infinite float replaced by None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def read_rows(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
