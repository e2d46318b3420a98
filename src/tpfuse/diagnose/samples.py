"""The data of a diagnosis: what was sampled (Sample, GpuMeta, Recording) and what analysis
concluded (GpuSummary, Finding), as frozen plain data, plus the JSON file format of a recording.

A recording saved with `tpfuse diagnose --save FILE` can be re-analysed anywhere with
`--from FILE` (no NVML needed); this is also how the analysis is tested on CPU.

File format (JSON, one object): {"format": FORMAT, "version": VERSION, "gpus": [GpuMeta...],
"fields": [Sample field names], "rows": [[one Sample's values in `fields` order], ...], plus the
Recording's scalar fields}. Rows are lists, not objects, so a long recording stays small
(8 GPUs x 10 min at 100 ms is 48,000 rows). A reader accepts files whose `fields` are a
superset or a reordering of today's, so fields may be appended later; never rename one.
Imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "tpfuse.diagnose.recording"
VERSION = 1


@dataclass(frozen=True)
class GpuMeta:
    """Facts about one GPU that do not change during a recording (read once, at the start)."""

    index: int  # NVML index (the order nvidia-smi lists; not CUDA_VISIBLE_DEVICES order)
    name: str
    uuid: str | None = None
    mem_total_bytes: int | None = None
    sm_clock_max_mhz: int | None = None
    mem_clock_max_mhz: int | None = None


@dataclass(frozen=True)
class Sample:
    """One reading of one GPU. A field NVML could not read on this GPU is None.

    `t_s` is seconds since the recording started (monotonic clock). `power_w` is what
    nvmlDeviceGetPowerUsage returns: on Ampere (except GA100) and newer GPUs an average over the
    last second, on older ones the instantaneous draw (NVML API reference). `util_pct` is NVML's
    "gpu" utilisation: the percentage of the last sample period (1/6 s to 1 s depending on the
    product) during which at least one kernel was executing. It is not SM occupancy: a kernel that
    spins on one SM waiting for a peer counts as 100%, which is exactly why high utilisation with
    low power means waiting. `target_mem_bytes` is the device memory the watched process tree holds
    on this GPU (None when no process is watched or NVML cannot list processes).
    """

    t_s: float
    gpu: int
    power_w: float | None
    power_limit_w: float | None
    util_pct: float | None
    mem_util_pct: float | None
    sm_clock_mhz: float | None
    mem_clock_mhz: float | None
    mem_used_bytes: int | None
    target_mem_bytes: int | None = None

    @property
    def power_fraction(self) -> float | None:
        """Power over the enforced power limit, or None when either is unknown."""
        if self.power_w is None or not self.power_limit_w:
            return None
        return self.power_w / self.power_limit_w


SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))


@dataclass(frozen=True)
class Recording:
    """Samples of every GPU over one run, and what was watched.

    `mode` is "command" (a child process ran `command`), "pid" (an existing process was watched),
    or "duration" (a fixed time). `exit_code` is the child's exit status in command mode.
    `started_unix` is the wall-clock time of t_s = 0, so a recording can be aligned with a
    workload's own log. `notes` says what could not be read and why.
    """

    gpus: tuple[GpuMeta, ...]
    samples: tuple[Sample, ...]
    interval_s: float
    mode: str
    started_unix: float = 0.0
    duration_s: float = 0.0
    command: tuple[str, ...] | None = None
    pid: int | None = None
    exit_code: int | None = None
    driver: str | None = None
    interrupted: bool = False
    tick_ms_median: float | None = None  # measured cost of reading every GPU once
    notes: tuple[str, ...] = ()

    def samples_of(self, gpu: int) -> list[Sample]:
        return [s for s in self.samples if s.gpu == gpu]


@dataclass(frozen=True)
class GpuSummary:
    """Statistics of one GPU over a recording; see analysis.summarise for each definition.

    Fractions are in [0, 1]; percentages in [0, 100]; None where the inputs were unreadable.
    """

    gpu: int
    name: str
    num_samples: int
    active_share: float  # samples with util >= analysis.IDLE_UTIL_PCT, over all samples
    util_mean_pct: float | None
    util_p50_pct: float | None
    util_p95_pct: float | None
    mem_util_mean_pct: float | None
    power_mean_w: float | None
    power_p50_w: float | None
    power_p95_w: float | None
    power_limit_w: float | None
    power_fraction_mean: float | None  # mean of power / limit over all samples
    power_fraction_active: float | None  # the same over active samples only
    waiting_share: float | None  # active samples in the waiting signature, over active samples
    energy_j: float | None  # power integrated over time (trapezoid rule)
    sm_clock_mean_mhz: float | None
    sm_clock_max_mhz: int | None
    mem_clock_mean_mhz: float | None
    mem_clock_max_mhz: int | None
    mem_used_max_bytes: int | None
    mem_total_bytes: int | None
    target_mem_max_bytes: int | None


@dataclass(frozen=True)
class Finding:
    """One conclusion: `kind` ("waiting", "idle", "uneven", "gaps", "busy", "unjudged", "no_samples"),
    `severity` ("warn", "info", "ok"), the GPUs it concerns, a sentence for people, and the
    numbers behind it (`evidence`, plain JSON values)."""

    kind: str
    severity: str
    gpus: tuple[int, ...]
    message: str
    evidence: dict = field(default_factory=dict)


def _finite(value):
    # JSON has no NaN/inf; a reading that produced one is stored as unknown.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def recording_to_dict(rec: Recording) -> dict:
    out = {"format": FORMAT, "version": VERSION}
    for f in dataclasses.fields(Recording):
        if f.name in ("gpus", "samples"):
            continue
        value = getattr(rec, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else _finite(value)
    out["gpus"] = [dataclasses.asdict(g) for g in rec.gpus]
    out["fields"] = list(SAMPLE_FIELDS)
    out["rows"] = [[_finite(getattr(s, name)) for name in SAMPLE_FIELDS] for s in rec.samples]
    return out


def recording_from_dict(data: dict, *, source: str = "recording") -> Recording:
    """Inverse of recording_to_dict; raises ValueError naming `source` and what is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"load_recording: {source} is not a tpfuse diagnose recording (no format={FORMAT!r}); "
                         "make one with `tpfuse diagnose --save FILE`")
    if data.get("version") != VERSION:
        raise ValueError(f"load_recording: {source} has version {data.get('version')!r}, this tpfuse reads "
                         f"version {VERSION}; re-record it with this tpfuse")
    try:
        names = list(data["fields"])
        missing = [n for n in SAMPLE_FIELDS if n not in names and n != "target_mem_bytes"]
        if missing:
            raise ValueError(f"load_recording: {source} lacks sample fields {missing}; re-record it")
        index = {n: names.index(n) for n in SAMPLE_FIELDS if n in names}
        samples = tuple(
            Sample(**{n: (row[i] if i < len(row) else None) for n, i in index.items()}) for row in data["rows"]
        )
        gpus = tuple(
            GpuMeta(**{k: v for k, v in g.items() if k in {f.name for f in dataclasses.fields(GpuMeta)}})
            for g in data["gpus"]
        )
        scalars = {f.name: data[f.name] for f in dataclasses.fields(Recording)
                   if f.name not in ("gpus", "samples") and f.name in data}
    except (KeyError, TypeError) as exc:
        raise ValueError(f"load_recording: {source} is malformed ({type(exc).__name__}: {exc}); "
                         "re-record it with `tpfuse diagnose --save FILE`") from None
    for key in ("command", "notes"):
        if scalars.get(key) is not None:
            scalars[key] = tuple(scalars[key])
    if "interval_s" not in scalars or "mode" not in scalars:
        raise ValueError(f"load_recording: {source} lacks interval_s or mode; re-record it")
    return Recording(gpus=gpus, samples=samples, **scalars)


def save_recording(rec: Recording, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recording_to_dict(rec), separators=(",", ":")) + "\n")
    return path


def load_recording(path: str | Path) -> Recording:
    """Read a recording written by save_recording; ValueError (naming the file) if it is not one."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"load_recording: cannot read {path} ({exc.strerror}); give the path of a file "
                         "written by `tpfuse diagnose --save FILE`") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"load_recording: {path} is not JSON ({exc}); give a file written by "
                         "`tpfuse diagnose --save FILE`") from None
    return recording_from_dict(data, source=str(path))
