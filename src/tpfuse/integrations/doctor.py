"""`tpfuse doctor` rows for each serving engine: installed, plugin registered, enabled, what it would do.

Reads package metadata and the environment only: it imports no engine (vLLM's modules need its
compiled extension, sglang's take seconds to import).
"""

from __future__ import annotations

from importlib import metadata

from tpfuse import env

# engine -> (distribution, entry-point group, the versions the plugin was written against, what it does)
ENGINES = {
    "sglang": ("sglang", "sglang.srt.plugins",
               ">= 0.5.23 (plugin hooks); 0.5.10 via `python -m tpfuse.integrations.sglang_legacy`",
               "replaces the fused allreduce + residual + RMSNorm op, its gate and workspaces with tpfuse's "
               "Communicator"),
    "vllm": ("vllm", "vllm.general_plugins", "0.33",
             "adds a post-grad pass rewriting all_reduce + (fused_add_)rms_norm to tpfuse where vLLM's own fusion "
             "is off, and keys vLLM's compile cache on tpfuse"),
}
_FILTER_VARS = {"sglang": "SGLANG_PLUGINS", "vllm": "VLLM_PLUGINS"}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _entry_point(group: str) -> str | None:
    for ep in metadata.entry_points(group=group):
        if ep.name == "tpfuse":
            return ep.value
    return None


def start_up() -> str:
    """What an enabled plugin does at the engine's warm-up here: calibrate or not, and the tables saved."""
    directory = env.cache_dir()
    tables = sorted(directory.glob("dispatch-*.json")) if directory.is_dir() else []
    saved = f"{len(tables)} dispatch table(s) in {directory}"
    try:
        budget = env.calibrate_budget_s()
    except ValueError as exc:
        return f"stands down: {exc}"
    if budget is None:
        return (f"does not calibrate (TPFUSE_CALIBRATE=0): the conservative default serves sizes the table lacks "
                f"({saved})")
    return (f"calibrates the captured batch sizes the dispatch table lacks, within {budget:g} s, and saves them "
            f"({saved})")


def engine_rows(environ=None) -> list[dict]:
    """One row per known engine: installed version, plugin entry point, enabled, and what it would do."""
    import os

    environ = os.environ if environ is None else environ
    try:
        enabled = env.engines_enabled()
        env_error = ""
    except ValueError as exc:
        enabled, env_error = frozenset(), str(exc)
    rows = []
    for engine, (dist, group, versions, action) in ENGINES.items():
        version, entry = _version(dist), _entry_point(group)
        allowed = environ.get(_FILTER_VARS[engine], "")
        filtered = bool(allowed.strip()) and "tpfuse" not in {x.strip() for x in allowed.split(",")}
        if version is None:
            would = "nothing: the engine is not installed here"
        elif entry is None:
            would = f"nothing: no 'tpfuse' entry point in {group}; reinstall tpfuse (pip install -e .)"
        elif env_error:
            would = f"nothing: {env_error}"
        elif engine not in enabled:
            would = f"nothing (inert); set TPFUSE_ENGINES={engine} to enable: it {action}"
        elif filtered:
            would = f"nothing: {_FILTER_VARS[engine]}={allowed!r} does not list tpfuse"
        else:
            would = f"it {action}; at start-up it {start_up()}"
        on = engine in enabled and not filtered and entry is not None and version is not None
        rows.append({"engine": engine, "installed": version, "supported": versions, "entry_point": entry,
                     "enabled": on, "would": would})
    return rows


def engine_table(rows: list[dict]):
    """The rows as a rich table for doctor's human output."""
    from rich.table import Table

    table = Table(title="Serving engines (tpfuse plugins)")
    for column in ("engine", "installed", "plugin", "enabled", "would do here"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["engine"], row["installed"] or "no", row["entry_point"] or "not registered",
                      "yes" if row["enabled"] else "no", row["would"])
    return table
