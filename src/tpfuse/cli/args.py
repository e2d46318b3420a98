"""Argument groups and their checks shared by the commands (no torch at import).

- `add_rank_args`: `--world-size`, `--device`, `--shared-gpu` (and `--timeout`) for every command that spawns ranks
  (resolved by `tpfuse.cli.ranks.resolve_ranks`);
- `add_shape_args` and `hiddens`: presets, hidden sizes, token buckets and dtype of tune and verify;
- `add_output_args`: `--json` and `--results` of tune and verify.
"""

from __future__ import annotations

import argparse

from tpfuse.cli.exits import UsageError
from tpfuse.cli.preflight import check_environment, check_positive, check_world_size, require_runtime
from tpfuse.presets import PRESETS, get_preset

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
    g.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the tensors (default bfloat16)")


DEVICE_HELP = "where the ranks' tensors live (auto: cuda when torch sees a GPU; cuda is NCCL, one GPU per rank)"
SHARED_GPU_HELP = "gloo ranks that all hold CUDA tensors on one GPU: a functional check, timings not representative"


def add_rank_args(p: argparse.ArgumentParser, *, default_world_size: int | None = None,
                  default_timeout_s: float | None = None) -> None:
    """The rank flags of every command that spawns ranks, in a group titled "ranks" (with
    `--timeout` when the command takes one). `default_world_size` None: the GPU count if 2 or
    more, else 2; the command passes the same value to `ranks_of`."""
    default = ("default: the number of GPUs if 2 or more, else 2" if default_world_size is None
               else f"default {default_world_size}")
    g = p.add_argument_group("ranks")
    g.add_argument("--world-size", type=int, default=None,
                   help=f"local ranks to spawn ({default}; at most 4 per usable CPU core, and one per GPU with NCCL)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help=DEVICE_HELP)
    g.add_argument("--shared-gpu", action="store_true", help=SHARED_GPU_HELP)
    if default_timeout_s is not None:
        g.add_argument("--timeout", type=float, default=default_timeout_s,
                       help=f"seconds before a hung rank is killed (default {default_timeout_s:g})")


def add_output_args(p: argparse.ArgumentParser) -> None:
    """`--json` and `--results` of tune and verify."""
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--results", default=None, metavar="PATH",
                   help="also append the measured times as result rows to PATH: a file, or a directory "
                        "(then PATH/<command>.jsonl)")


def hiddens(args, example: str) -> tuple[int, ...]:
    """The hidden sizes asked for, after the checks of the shape flags (no torch); `example` is a
    complete command line that gives them, for the message when none is given."""
    sizes = [TINY_HIDDEN if name == "tiny" else get_preset(name).hidden for name in args.preset] + list(args.hidden)
    if not sizes:
        raise UsageError(f"give --preset ({', '.join(PRESET_CHOICES)}) or --hidden H, e.g. `{example}`")
    if any(h < 1 for h in sizes):
        raise UsageError(f"--hidden must be >= 1, got {', '.join(map(str, sizes))}; pass the model's hidden size, e.g. --hidden 4096")
    check_positive(max_tokens=args.max_tokens)
    return tuple(dict.fromkeys(sizes))


def check_rank_args(args) -> None:
    """The rank flags' checks that need no torch, the TPFUSE_* variables the ranks read, and the
    runtime packages the ranks need."""
    check_world_size(args.world_size)
    check_environment()
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {timeout}; pass e.g. --timeout 300")
    require_runtime()


def ranks_of(args, *, default_world_size: int | None = None):
    """`tpfuse.cli.ranks.resolve_ranks` over the rank flags, with the resolved world size checked
    against what this host can run (imports torch only where a GPU could be visible)."""
    from tpfuse.cli.ranks import resolve_ranks

    ranks = resolve_ranks(args.world_size, args.device, shared_gpu=args.shared_gpu,
                          default_world_size=default_world_size)
    check_world_size(ranks.world_size)
    return ranks
