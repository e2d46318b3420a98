"""Sample while something runs: a child command, an existing process, or a fixed time.

`watch()` owns the Sampler's lifetime and the child's: it starts the child (command mode), samples
until the watched thing ends (or `duration_s` passes, or Ctrl-C), stops the sampler and returns the
Recording. With `duration_s` in command mode the child is stopped (SIGTERM, then SIGKILL after
CHILD_GRACE_S) when the time is up. A live status line goes to `status` (a callable taking one
string), which the CLI points at a rich Live on stderr.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

from tpfuse.diagnose.report import status_text
from tpfuse.diagnose.sampler import Nvml, Sampler
from tpfuse.diagnose.samples import Recording

# How long a child gets to exit after SIGTERM or Ctrl-C before it is killed: long enough for a
# framework to tear down its process group, short enough that a stuck job does not hold the tool.
CHILD_GRACE_S = 10.0
# How often the watcher checks the child / pid and refreshes the status line.
POLL_S = 0.1


def pid_alive(pid: int) -> bool:
    """True if process `pid` exists and has not exited (signal 0 probes without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    # A process that exited but was not yet reaped by its parent (a zombie) still answers signal 0.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _stop_child(child: subprocess.Popen) -> int:
    if child.poll() is None:
        child.terminate()
        try:
            return child.wait(timeout=CHILD_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
    return child.wait()


def watch(nvml: Nvml, *, command: list[str] | None = None, pid: int | None = None, duration_s: float | None = None,
          interval_s: float, status: Callable[[str], None] | None = None, child_stdout=None) -> Recording:
    """Sample `nvml`'s GPUs while `command` runs (as a child), while `pid` lives, or for `duration_s`.

    Exactly one of command / pid / duration_s must set the end; duration_s also caps the other two.
    `child_stdout`: where the child's stdout goes (None: inherit; the CLI passes stderr under
    --json so that stdout carries one JSON document). Raises ValueError if the command cannot start.
    """
    if command is None and pid is None and duration_s is None:
        raise ValueError("watch: give a command, a pid or a duration")
    mode = "command" if command else ("pid" if pid is not None else "duration")
    child = None
    if command:
        try:
            child = subprocess.Popen(command, stdout=child_stdout)
        except OSError as exc:
            raise ValueError(f"diagnose: cannot start {command[0]!r} ({exc.strerror}); "
                             "check the command after --") from None
    root = child.pid if child is not None else pid
    sampler = Sampler(nvml, interval_s=interval_s, target_root=root).start()
    interrupted, timed_out, exit_code = False, False, None
    try:
        while True:
            if child is not None and child.poll() is not None:
                break
            if child is None and pid is not None and not pid_alive(pid):
                break
            if duration_s is not None and sampler.elapsed_s() >= duration_s:
                # With a command or pid, the time ran out before the watched thing ended.
                timed_out = interrupted = child is not None or pid is not None
                break
            if status is not None:
                status(status_text(sampler.elapsed_s(), sampler.num_samples(), sampler.latest()))
            left = POLL_S if duration_s is None else duration_s - sampler.elapsed_s()
            time.sleep(min(POLL_S, max(0.0, left)))  # end within a tick of the requested duration
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if child is not None:
            if interrupted and not timed_out:
                # Ctrl-C reached the child too (same process group): let it exit on its own first.
                try:
                    child.wait(timeout=CHILD_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
            exit_code = _stop_child(child)
        sampler.stop()
    return sampler.recording(mode=mode, command=tuple(command) if command else None, pid=pid,
                             exit_code=exit_code, interrupted=interrupted)
