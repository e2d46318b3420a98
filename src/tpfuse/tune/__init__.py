"""Measuring: tune (measure and choose per bucket into a dispatch table) and verify (A/B).

Heavy imports (torch) happen in the submodules, not here. Timing is `tpfuse.timing`'s protocol
and verify-before-time is `tpfuse.correctness.check_candidate`, shared with selftest and the
benchmarks. The entry points: `tune_in_group(TuneSpec(...))` and `verify_in_group(...)`, both
collective, inside an existing process group.

The table these write, and what a Communicator does with it at run time, is `tpfuse.dispatch`;
`DispatchTable`, `table_path`, `save` and `load` are re-exported here for tuning in place.
"""

_LAZY = {
    "TuneSpec": "tpfuse.tune.tuner",
    "tune_in_group": "tpfuse.tune.tuner",
    "verify_in_group": "tpfuse.tune.verify",
    "VerifyReport": "tpfuse.tune.verify",
    "DispatchTable": "tpfuse.dispatch.table",
    "table_path": "tpfuse.dispatch.table",
    "save": "tpfuse.dispatch.table",
    "load": "tpfuse.dispatch.table",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    """In-process use inside an existing group, e.g. an engine tuning in place:

        from tpfuse.tune import TuneSpec, tune_in_group, save, table_path
        table = tune_in_group(TuneSpec(hiddens=(6144,), buckets=(1, 2, 4, 8)))  # collective
        save(table, table_path(table.fingerprint))                               # every rank
    """
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tpfuse.tune' has no attribute {name!r}")
