"""How a diagnosis is shown: a JSON document for programs, rich tables for people.

`report_dict` is the stable `--json` shape: {"source", "mode", "command", "pid", "exit_code",
"interrupted", "interval_s", "duration_s", "num_samples", "driver", "tick_ms_median", "notes",
"gpus": [GpuSummary fields], "findings": [Finding fields], "thresholds", "png", "saved"}.
"""

from __future__ import annotations

import dataclasses

from tpfuse.diagnose import analysis
from tpfuse.diagnose.samples import Finding, GpuSummary, Recording

GIB = 1024**3


def report_dict(rec: Recording, summaries: tuple[GpuSummary, ...], findings: tuple[Finding, ...], *,
                source: str, png: str | None = None, saved: str | None = None) -> dict:
    return {
        "source": source,
        "mode": rec.mode,
        "command": list(rec.command) if rec.command else None,
        "pid": rec.pid,
        "exit_code": rec.exit_code,
        "interrupted": rec.interrupted,
        "interval_s": rec.interval_s,
        "duration_s": rec.duration_s,
        "num_samples": len(rec.samples),
        "driver": rec.driver,
        "tick_ms_median": rec.tick_ms_median,
        "notes": list(rec.notes),
        "gpus": [dataclasses.asdict(s) for s in summaries],
        "findings": [dataclasses.asdict(f) for f in findings],
        "thresholds": analysis.thresholds(),
        "png": png,
        "saved": saved,
    }


def _f(x, fmt: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, fmt)


def _p(fraction) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def print_report(console, rec: Recording, summaries: tuple[GpuSummary, ...], findings: tuple[Finding, ...], *,
                 source: str) -> None:
    """Tables for people on a rich Console: one row per GPU, then the findings."""
    from rich.table import Table

    what = " ".join(rec.command) if rec.command else (f"pid {rec.pid}" if rec.pid is not None else rec.mode)
    per_gpu = max((s.num_samples for s in summaries), default=0)
    head = (f"{what}: {rec.duration_s:.1f} s, {per_gpu} samples per GPU every {1000 * rec.interval_s:.0f} ms "
            f"({source})")
    if rec.exit_code is not None:
        head += f"; exit code {rec.exit_code}"
    if rec.interrupted:
        head += "; interrupted"
    table = Table(title=head, title_justify="left")
    for col in ("GPU", "name", "util mean / p95 %", "power mean / p95 W", "limit W", "power/limit all / active",
                "waiting", "SM clock mean / max MHz", "mem used max / total GiB", "energy J"):
        table.add_column(col, justify="left" if col in ("GPU", "name") else "right")
    for s in summaries:
        table.add_row(
            str(s.gpu), s.name,
            f"{_f(s.util_mean_pct, '.0f')} / {_f(s.util_p95_pct, '.0f')}",
            f"{_f(s.power_mean_w, '.0f')} / {_f(s.power_p95_w, '.0f')}",
            _f(s.power_limit_w, ".0f"),
            f"{_p(s.power_fraction_mean)} / {_p(s.power_fraction_active)}",
            _p(s.waiting_share),
            f"{_f(s.sm_clock_mean_mhz, '.0f')} / {_f(s.sm_clock_max_mhz, '.0f')}",
            f"{_f(s.mem_used_max_bytes, '.1f', 1 / GIB)} / {_f(s.mem_total_bytes, '.1f', 1 / GIB)}",
            _f(s.energy_j, ".0f"),
        )
    console.print(table)
    style = {"warn": "bold yellow", "info": "cyan", "ok": "green"}
    for f in findings:
        console.print(f"[{style.get(f.severity, '')}]{f.severity.upper():5}[/] {f.kind}: {f.message}", highlight=False)
    for note in rec.notes:
        console.print(f"[dim]note: {note}[/]", highlight=False)


def status_text(elapsed_s: float, num_samples: int, latest: dict) -> str:
    """The live status line while sampling: elapsed time and each GPU's last power and utilisation."""
    parts = [f"diagnose: {elapsed_s:6.1f} s, {num_samples} samples"]
    for gpu in sorted(latest):
        s = latest[gpu]
        frac = s.power_fraction
        parts.append(f"GPU{gpu} {_f(s.power_w, '.0f')} W ({_p(frac)}) util {_f(s.util_pct, '.0f')}%")
    return " | ".join(parts)
