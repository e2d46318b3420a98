"""benchmarks/bench_host_path.py --stub on CPU, as CI runs it: one row per variant and shape with
sane values (the structure CI tracks, no speed threshold), the rows file equal to what it prints,
and the launch count per call that each path must make. No ranks are spawned: the script's group
is one in-process gloo rank."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpfuse.results import read_rows

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="TRITON_INTERPRET=1 makes interpreted kernels: nothing to stub")

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = ("oneshot", "twoshot", "nccl_epilogue", "nccl_eager")
# Triton launches one call makes: one kernel for the fused paths and the bare epilogue launch, none
# for nccl_eager (torch ops) and torch.add.
LAUNCHES = {"tpfuse/oneshot": 1, "tpfuse/twoshot": 1, "tpfuse/nccl_epilogue": 1, "tpfuse/nccl_eager": 0,
            "bare_epilogue_launch": 1, "epilogue_triton_launch": 1, "torch.add": 0}
REQUIRED = {"op", "strategy", "shape", "dtype", "world_size", "median", "p20", "p80", "unit", "gpu", "versions", "date",
            "command", "extra"}


def test_stub_mode_prints_one_sane_row_per_variant_and_shape(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "host_path.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_host_path.py"), "--stub", "--json",
                           "--calls", "5", "--rounds", "3", "--warmup", "2", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    rows = printed["rows"]
    assert printed["notes"] == []  # every strategy ran
    assert rows == read_rows(out)
    assert sorted((r["strategy"], r["shape"]["tokens"]) for r in rows) == sorted(
        (name, tokens) for name in LAUNCHES for tokens in (1, 64))
    bare = {r["shape"]["tokens"]: r["median"] for r in rows if r["strategy"] == "bare_epilogue_launch"}
    for r in rows:
        assert REQUIRED <= set(r) and r["op"] == "host_path" and r["unit"] == "us" and r["world_size"] == 1
        assert r["shape"] == {"tokens": r["shape"]["tokens"], "hidden": 6144} and r["dtype"] == "bfloat16"
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("median", "p20", "p80"))
        assert r["p20"] <= r["median"] <= r["p80"]
        extra = r["extra"]
        assert extra["mode"] == "eager" and extra["stub"] is True and extra["checked"] is None
        assert extra["ratio_to_bare"] == pytest.approx(r["median"] / bare[r["shape"]["tokens"]])
        assert extra["launches_per_call"] == LAUNCHES[r["strategy"]], (r["strategy"], extra)
