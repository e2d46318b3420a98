"""Residual-add + RMSNorm on one GPU: tpfuse's Triton kernel against torch eager, torch.compile
and FlashInfer's fused_add_rmsnorm (when importable), at decode and prefill shapes.

    python benchmarks/bench_epilogue.py --out benchmarks/results/epilogue.jsonl

Method (`tpfuse.timing.graph_timer`, `sample_rounds`): every provider's call is captured in a
CUDA graph over several input sets (rotated so that one replay touches more than twice the L2
cache at small shapes), the graph is warmed up and replayed `--reps` times between CUDA events;
`--trials` such measurements are taken, interleaving the providers, and the median per call is
reported. Bytes counted: read x and residual, write
new_residual and normed (4 x tokens x hidden x itemsize), as in the recorded baselines. The device
copy bandwidth (read + write of a 1 GiB tensor, same method; the faster of torch's copy_ and
`tpfuse.timing`'s copy kernel) is measured in the same run, and every row carries GB/s and its fraction of
that copy bandwidth. FlashInfer's op works in place (normed into x, new residual into residual),
which keeps its writes in lines it has just read; `tpfuse_inplace` (out=(x, residual)) is the
like-for-like comparison, `tpfuse` the out-of-place API. tpfuse is also timed with other
num_warps choices (`tpfuse[w=N]`) so the launch heuristic can be checked against them.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from tpfuse.results import append_rows, make_row
from tpfuse.timing import copy_bandwidth, graph_timer, sample_rounds

TOKENS = (1, 8, 64, 512, 4096, 16384)
HIDDENS = (4096, 6144, 7168, 8192)
L2_BYTES = 60 * 1024 * 1024  # H200 L2 (KINDS.md: PyTorch reported 60 MB)


def providers(eps: float):
    """name -> factory(x, res, w) -> zero-argument call; plus a note on what could not run."""
    import torch.nn.functional as F

    from tpfuse.kernels.epilogue import launch_config, residual_rmsnorm

    def tpfuse_fn(warps=None):
        def factory(x, res, w):
            out = (torch.empty_like(x), torch.empty_like(x))
            cfg = None
            if warps is not None:
                block, _, rows = launch_config(x.shape[1], x.element_size(), x.shape[0])
                cfg = (block, warps, rows)
            return lambda: residual_rmsnorm(x, res, w, eps, out=out, config=cfg)
        return factory

    def eager(x, res, w):
        def call():
            h = x + res
            return F.rms_norm(h, (x.shape[1],), w, eps), h
        return call

    def fp32_math(x, res, w):
        h = (x.float() + res.float()).to(x.dtype)
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype), h

    compiled = torch.compile(fp32_math, dynamic=True)
    def tpfuse_inplace(x, res, w):
        return lambda: residual_rmsnorm(x, res, w, eps, out=(x, res))  # FlashInfer's in-place contract

    table = {"tpfuse": tpfuse_fn(), "tpfuse_inplace": tpfuse_inplace, "torch_eager": eager, "torch_compile": lambda x, r, w: (lambda: compiled(x, r, w))}
    for warps in (4, 8, 16):
        table[f"tpfuse[w={warps}]"] = tpfuse_fn(warps)
    notes = {}
    try:
        from flashinfer.norm import fused_add_rmsnorm

        table["flashinfer"] = lambda x, r, w: (lambda: fused_add_rmsnorm(x, r, w, eps))  # in place
    except Exception as exc:  # report why, keep benchmarking the rest
        notes["flashinfer"] = f"{type(exc).__name__}: {exc}"
    return table, notes


def time_providers(table: dict, tokens: int, hidden: int, nbytes: int, *, reps: int, trials: int):
    """(samples by provider, failures by provider, input sets) at one bf16 shape: each provider's
    calls over input sets rotated so one replay touches more than twice the L2 (`nbytes` per set),
    as one graph (`tpfuse.timing.graph_timer`), providers interleaved (`sample_rounds`)."""
    sets = max(1, min(32, math.ceil(2 * L2_BYTES / nbytes)))
    data = [tuple(torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16) for _ in range(2)) for _ in range(sets)]
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    timers, failed = {}, {}
    for name, factory in table.items():
        try:
            timers[name] = graph_timer([factory(x, r, w) for x, r in data], reps=reps)
        except Exception as exc:  # report and keep measuring the others
            failed[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return sample_rounds(timers, trials), failed, sets


def copy_rows(reps: int, trials: int) -> list:
    """Rows of the device copy bandwidth (`tpfuse.timing.copy_bandwidth`), each with its GB/s."""
    rows = []
    for name, samples in copy_bandwidth(reps, trials).items():
        rows.append(make_row("device_copy", name, {"bytes": 1 << 30}, "bfloat16", 1, samples, "us"))
        rows[-1].extra["gbps"] = 2 * (1 << 30) / (rows[-1].median * 1e-6) / 1e9  # read + write
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/epilogue.jsonl")
    p.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    p.add_argument("--hidden", type=int, nargs="*", default=list(HIDDENS))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--eps", type=float, default=1e-6)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_epilogue: needs a CUDA GPU; torch sees none", file=sys.stderr)
        return 2
    rows = copy_rows(args.reps, args.trials)
    copy_gbps = max(row.extra["gbps"] for row in rows)
    table, notes = providers(args.eps)
    summary = []
    for hidden in args.hidden:
        for tokens in args.tokens:
            nbytes = 4 * tokens * hidden * 2
            samples, failed, sets = time_providers(table, tokens, hidden, nbytes, reps=args.reps, trials=args.trials)
            shape = {"tokens": tokens, "hidden": hidden}
            medians = {}
            for name, s in samples.items():
                row = make_row("residual_rmsnorm", name, shape, "bfloat16", 1, s, "us", input_sets=sets)
                gbps = nbytes / (row.median * 1e-6) / 1e9
                row.extra.update(gbps=gbps, copy_fraction=gbps / copy_gbps, copy_gbps=copy_gbps)
                rows.append(row)
                medians[name] = row.median
            summary.append((tokens, hidden, medians, nbytes, failed))
    for name, why in notes.items():
        rows.append(make_row("residual_rmsnorm", name, {}, "bfloat16", 1, [], "us", unavailable=why))
    append_rows(args.out, rows)
    _print_summary(summary, copy_gbps, notes)
    return 0


def _print_summary(summary, copy_gbps, notes) -> None:
    print(f"\ndevice copy bandwidth: {copy_gbps:,.0f} GB/s (read + write)")
    print(f"{'tokens':>6} {'hidden':>6} | {'tpfuse us':>11} {'GB/s':>6} {'%copy':>6} | {'eager':>7} {'compile':>7} {'flashinf':>8} | "
          f"{'x eager':>7} {'x FI':>5} | best warps   (x FI: in place vs in place)")
    for tokens, hidden, med, nbytes, failed in summary:
        fg = med.get("tpfuse", float("nan"))
        gbps = nbytes / (fg * 1e-6) / 1e9
        fi = med.get("flashinfer", float("nan"))
        fgi = med.get("tpfuse_inplace", float("nan"))
        variants = {k: v for k, v in med.items() if k.startswith("tpfuse[")}
        best = min(variants, key=variants.get) if variants else "-"
        print(f"{tokens:>6} {hidden:>6} | {fg:>11.2f} {gbps:>6.0f} {gbps / copy_gbps:>6.1%} | {med.get('torch_eager', float('nan')):>7.2f} "
              f"{med.get('torch_compile', float('nan')):>7.2f} {fi:>8.2f} | {med.get('torch_eager', float('nan')) / fg:>7.2f} "
              f"{fi / fgi:>5.2f} | {best} {variants.get(best, float('nan')):.2f}" + (f"  failed: {failed}" if failed else ""))
    for name, why in notes.items():
        print(f"{name} not run: {why}")


if __name__ == "__main__":
    sys.exit(main())
