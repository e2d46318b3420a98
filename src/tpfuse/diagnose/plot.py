"""A PNG of a recording: power as a fraction of the limit, and utilisation, over time, per GPU.

matplotlib is an optional extra (`pip install 'tpfuse[plot]'`); `require_matplotlib()` says so
clearly before any sampling starts, and `write_png` renders off-screen (Agg), so it works on a
machine without a display.
"""

from __future__ import annotations

from pathlib import Path

from tpfuse._version import extra_hint
from tpfuse.diagnose import analysis
from tpfuse.diagnose.samples import Recording


def require_matplotlib() -> None:
    """RuntimeError naming the fix when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"diagnose: --png needs matplotlib ({exc}); install it with "
                           f"{extra_hint('plot')} or drop --png") from None


def write_png(rec: Recording, path: str | Path, *, title: str | None = None) -> Path:
    """Render `rec` to `path` (a PNG) and return the path."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # off-screen; no display needed
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_power, ax_util) = plt.subplots(2, 1, sharex=True, figsize=(12, 6))
    try:
        for meta in rec.gpus or ():
            samples = sorted(rec.samples_of(meta.index), key=lambda s: s.t_s)
            frac = [(s.t_s, 100 * s.power_fraction) for s in samples if s.power_fraction is not None]
            util = [(s.t_s, s.util_pct) for s in samples if s.util_pct is not None]
            label = f"GPU {meta.index}"
            if frac:
                ax_power.plot(*zip(*frac), label=label, linewidth=1)
            if util:
                ax_util.plot(*zip(*util), label=label, linewidth=1)
        ax_power.axhline(100 * analysis.WAIT_POWER_FRACTION, color="grey", linestyle="--", linewidth=0.8,
                         label="waiting: power below this")
        ax_util.axhline(analysis.WAIT_UTIL_PCT, color="grey", linestyle="--", linewidth=0.8,
                        label="waiting: utilisation above this")
        ax_power.set_ylabel("power, % of enforced limit")
        ax_util.set_ylabel("utilisation, % (kernel resident)")
        ax_util.set_xlabel("time since start, s")
        for ax in (ax_power, ax_util):
            ax.set_ylim(0, 105)
            ax.grid(True, alpha=0.3)
            # outside the axes: a busy GPU's lines sit exactly where an inside legend would go
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        what = " ".join(rec.command) if rec.command else (f"pid {rec.pid}" if rec.pid else f"{rec.duration_s:.1f} s")
        fig.suptitle(title or f"tpfuse diagnose: {what}"[:120])
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)
    return path
