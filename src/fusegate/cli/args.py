"""Argument groups and their checks shared by `fusegate tune` and `fusegate verify` (no torch at import).

Launch modes for `--world-size N` local ranks (`fusegate.launch.run_ranks`):
- CPU (default without a GPU): gloo, CPU tensors;
- GPUs, N <= number of GPUs: NCCL, one GPU per rank (the only mode whose timings mean anything
  for a multi-GPU deployment);
- `--shared-gpu`: gloo with CUDA tensors, all ranks on the current GPU; a functional check of
  the GPU code paths on one GPU, timings not representative.
"""

from __future__ import annotations

import argparse

from fusegate.cli.main import UsageError
from fusegate.cli.preflight import check_positive, check_world_size, require_runtime
from fusegate.presets import PRESETS, get_preset

# The model presets plus `tiny`, the test-sized model of `bench e2e` and `profile` (hidden 64), so
# that the preset a benchmark ran with can be tuned and verified by the same name.
TINY_HIDDEN = 64
PRESET_CHOICES = (*PRESETS, "tiny")

DTYPES = ("bfloat16", "float16", "float32")


def add_shape_args(p: argparse.ArgumentParser, *, default_max_tokens: int) -> None:
    g = p.add_argument_group("shapes")
    g.add_argument("--preset", action="append", choices=list(PRESET_CHOICES), default=[],
                   help="model preset whose hidden size to use (repeatable)")
    g.add_argument("--hidden", action="append", type=int, default=[], help="hidden size (repeatable)")
    g.add_argument("--max-tokens", type=int, default=default_max_tokens,
                   help=f"largest token bucket; buckets are 1, 2, 4, ... up to it (default {default_max_tokens})")
    g.add_argument("--dtype", choices=DTYPES, default="bfloat16")


def add_launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ranks")
    g.add_argument("--world-size", type=int, default=None,
                   help="local ranks to spawn (default: the number of GPUs if 2 or more, else 2; at most "
                        "4 per usable CPU core, and one per GPU with NCCL)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where tensors live (auto: cuda if torch sees a GPU)")
    g.add_argument("--shared-gpu", action="store_true",
                   help="gloo with all ranks on one GPU: a functional check, timings not representative")
    g.add_argument("--timeout", type=float, default=1800.0, help="seconds before a hung rank is killed (default 1800)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--results", default=None, metavar="PATH",
                   help="also append the measured times as result rows to PATH: a file, or a directory "
                        "(then PATH/<command>.jsonl)")


def hiddens(args, command: str) -> tuple[int, ...]:
    """The hidden sizes asked for, after the checks of the shape flags (no torch)."""
    sizes = [TINY_HIDDEN if name == "tiny" else get_preset(name).hidden for name in args.preset] + list(args.hidden)
    if not sizes:
        raise UsageError(f"give --preset ({', '.join(PRESET_CHOICES)}) or --hidden H, e.g. `fusegate {command} --preset glm5`")
    if any(h < 1 for h in sizes):
        raise UsageError(f"--hidden must be >= 1, got {', '.join(map(str, sizes))}; pass the model's hidden size, e.g. --hidden 4096")
    check_positive(max_tokens=args.max_tokens)
    return tuple(dict.fromkeys(sizes))


def check_launch_args(args) -> None:
    """The launch flags' checks that need no torch, and the runtime packages the ranks need."""
    check_world_size(args.world_size)
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}; pass e.g. --timeout 600")
    require_runtime()


def launch(args) -> tuple[int, str, str]:
    """(world size, process-group backend, tensor device) for the requested ranks, or UsageError."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = args.device if args.device != "auto" else ("cuda" if gpus else "cpu")
    if device == "cuda" and not gpus:
        raise UsageError("--device cuda but torch sees no CUDA GPU; use --device cpu")
    world_size = args.world_size if args.world_size is not None else (gpus if gpus >= 2 else 2)
    check_world_size(world_size)
    if device == "cpu":
        if args.shared_gpu:
            raise UsageError("--shared-gpu needs --device cuda (or auto on a GPU machine)")
        return world_size, "gloo", "cpu"
    if args.shared_gpu:
        return world_size, "gloo", "cuda"
    if world_size > gpus:
        raise UsageError(f"{world_size} ranks but {gpus} GPU(s); NCCL needs one GPU per rank. Pass --shared-gpu for "
                         "a functional check with ranks sharing a GPU, or --world-size <= the GPU count")
    return world_size, "nccl", "cuda"
