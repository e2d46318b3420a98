"""examples/ run as a user runs them, and the README quotes them as they are.

`examples/two_ranks_cpu.py` is the README's "Use it" snippet, complete: two gloo ranks on the CPU,
the fused allreduce + residual + RMSNorm and the plain allreduce, each checked against the float64
reference. A wrong strategy forced in makes it fail, so its check is a real one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "two_ranks_cpu.py"


def _run(**extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]), **extra_env}
    return subprocess.run([sys.executable, str(EXAMPLE.relative_to(ROOT))], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.gloo
def test_the_example_runs_and_checks_its_results():
    proc = _run()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok: 2 ranks, 4x1024 bfloat16, within 7.8e-03 of float64"


@pytest.mark.gloo
def test_the_example_fails_when_the_collective_is_wrong():
    proc = _run(TPFUSE_STRATEGIES="drops_last_rank=support.broken_strategy:DropsLastRankStrategy",
                TPFUSE_STRATEGY="drops_last_rank")
    assert proc.returncode != 0 and "is off by" in proc.stderr and "ok:" not in proc.stdout


def test_the_readme_quotes_the_example_as_it_is():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Use it\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks and blocks[0] == EXAMPLE.read_text(), "README's first Use-it block must be examples/two_ranks_cpu.py"
