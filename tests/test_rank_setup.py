"""Long commands show a progress bar when stderr is a terminal, and end with one summary line.

(Without a terminal there is no bar: `tpfuse.rank_setup.progress_bar` checks isatty; the
in-process tests of each command run that way.)"""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gloo

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _run(argv: list[str], *, tty: bool) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python -m tpfuse.cli argv`, stderr on a pseudo-terminal when `tty`."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": "120"}
    cmd = [sys.executable, "-m", "tpfuse.cli", *argv]
    if not tty:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        return proc.returncode, proc.stdout, proc.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    out = proc.stdout.read().decode()
    return proc.wait(timeout=300), out, b"".join(chunks).decode(errors="replace")


COMMANDS = [
    (["selftest", "--strategy", "reference", "--repeats", "1"], r"selftest.*\d+/21",
     r"^selftest PASSED: 21 passed, 0 failed \(reference\) on 2 gloo rank\(s\) in [\d.]+ s$"),
    (["verify", "--strategy", "ring", "--baseline", "reference", "--hidden", "64", "--max-tokens", "1", "--rounds", "2",
      "--world-size", "2", "--device", "cpu"], r"verify ring.*0/1",
     r"^verify: (KEEP|REVERT) ring vs reference: \d of 1 bucket\(s\) KEEP, \d REVERT, in [\d.]+ s$"),
]


@pytest.mark.slow
@pytest.mark.parametrize("argv, bar, summary", COMMANDS, ids=["selftest", "verify"])
def test_progress_on_a_terminal_and_a_summary_line(argv, bar, summary):
    rc, out, err = _run(argv, tty=True)
    assert rc in (0, 1), err
    assert re.search(bar, err), err[-2000:]
    assert re.search(summary, out, re.M), out[-2000:]
    assert "Traceback" not in err
