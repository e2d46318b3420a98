"""Spawning ranks for a command: where they run, the CLI's warning format in every rank, and rank
failures in one line each.

`resolve_ranks` is the one rule every command that spawns ranks (selftest, tune, verify, bench e2e,
profile) and `doctor` apply to `--world-size`, `--device` and `--shared-gpu` (`tpfuse.cli.args`
adds the flags):
- `--device cpu` (auto without a GPU): gloo, CPU tensors;
- `--device cuda` (auto with a GPU): NCCL, one GPU per rank, so at most as many ranks as GPUs;
- `--shared-gpu`: gloo with CUDA tensors, all ranks on the current GPU; a functional check of the
  GPU code paths on one GPU, timings not representative.

`run_cli_ranks(fn, N, ...)` is `tpfuse.spawn.run_ranks` with `fn` run through `rank_entry`, which makes
the rank print tpfuse's warnings as one plain line (the library's `warnings.warn` would show the
file, the line number and the caller's source line). `describe_failure` turns a `RankFailure`
into one line per distinct error, naming the ranks; the full tracebacks go to the debug log
(`tpfuse -v ...`), so a user error never prints a Python traceback.
"""

from __future__ import annotations

import glob
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpfuse.cli.exits import UsageError

log = logging.getLogger("tpfuse.cli")

_default_formatwarning = warnings.formatwarning


def _format_warning(message, category, filename, lineno, line=None) -> str:
    if category.__module__.startswith("tpfuse"):
        return f"tpfuse: warning: {message}\n"
    return _default_formatwarning(message, category, filename, lineno, line)


@dataclass(frozen=True)
class Ranks:
    """Where a command's local ranks run: how many, their process-group backend, their tensors' device."""

    world_size: int
    backend: str  # "gloo" or "nccl"
    device: str  # "cpu" or "cuda"

    @property
    def shared_gpu(self) -> bool:
        return self.backend == "gloo" and self.device == "cuda"


def no_gpu_visible() -> bool:
    """True when torch could see no CUDA GPU here, known without importing it: CUDA_VISIBLE_DEVICES
    hides every GPU, or the host has neither an NVIDIA driver's devices nor ROCm's (`/dev/kfd`)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return True
    nvidia = Path("/proc/driver/nvidia/gpus")
    return not (nvidia.is_dir() and any(nvidia.iterdir())) and not glob.glob("/dev/nvidia[0-9]*") \
        and not os.path.exists("/dev/kfd")


def visible_gpus() -> int:
    """The CUDA GPUs torch sees (0 without importing torch when `no_gpu_visible`)."""
    if no_gpu_visible():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_ranks(world_size: int | None, device: str = "auto", *, shared_gpu: bool = False,
                  default_world_size: int | None = None, num_gpus: int | None = None) -> Ranks:
    """The ranks asked for by the rank flags (module doc), or UsageError naming the fix.

    `world_size` None takes `default_world_size`, or when that is None too the GPU count if 2 or
    more, else 2. `num_gpus`: the GPUs to plan for (default: what torch sees here; torch is not
    imported when the flags alone decide, or when no GPU can be visible here)."""
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {device!r} is not a device; use auto, cpu or cuda")
    if shared_gpu and device == "cpu":
        raise UsageError("--shared-gpu needs --device cuda (or auto on a GPU machine)")
    if num_gpus is None:
        needed = device != "cpu" or (world_size is None and default_world_size is None)
        num_gpus = visible_gpus() if needed else 0
    resolved = device if device != "auto" else ("cuda" if num_gpus else "cpu")
    if resolved == "cuda" and not num_gpus:
        raise UsageError("--device cuda but torch sees no CUDA GPU; use --device cpu")
    if shared_gpu and resolved == "cpu":
        raise UsageError("--shared-gpu needs a CUDA GPU and torch sees none; drop --shared-gpu to run on CPU")
    if world_size is None:
        world_size = default_world_size if default_world_size is not None else (num_gpus if num_gpus >= 2 else 2)
    if resolved == "cpu":
        return Ranks(world_size, "gloo", "cpu")
    if shared_gpu:
        return Ranks(world_size, "gloo", "cuda")
    if world_size > num_gpus:
        raise UsageError(f"{world_size} ranks but {num_gpus} GPU(s); NCCL needs one GPU per rank. Pass --shared-gpu "
                         f"for a functional check with ranks sharing a GPU, --world-size {num_gpus} or less, or "
                         "--device cpu")
    return Ranks(world_size, "nccl", "cuda")


def install_warning_format() -> None:
    """tpfuse warnings as `tpfuse: warning: <message>` lines in this process (the CLI's choice;
    the library never changes warning formatting)."""
    warnings.formatwarning = _format_warning


def rank_entry(rank: int, world_size: int, fn: Callable[..., Any], *args: Any) -> Any:
    install_warning_format()
    return fn(rank, world_size, *args)


def run_cli_ranks(fn: Callable[..., Any], world_size: int, *, backend: str, args: tuple = (), timeout_s: float,
          env: dict[str, str] | None = None) -> list[Any]:
    from tpfuse.spawn import run_ranks

    return run_ranks(rank_entry, world_size, backend=backend, args=(fn, *args), timeout_s=timeout_s, env=env)


def describe_failure(exc) -> str:
    """One clause per distinct error of a RankFailure: "rank(s) 0, 1: RuntimeError: ..."."""
    log.debug("%s", exc)
    groups: dict[str, list[int]] = {}
    for rank, text in sorted(exc.failures.items()):
        lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
        groups.setdefault(lines[-1] if lines else "failed without a message", []).append(rank)
    clauses = [f"rank(s) {', '.join(map(str, ranks))}: {error}" for error, ranks in groups.items()]
    return "; ".join(clauses) + " (`tpfuse -v ...` prints the ranks' tracebacks)"
