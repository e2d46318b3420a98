"""Residual-add + RMSNorm with quantized output on one GPU: tpfuse's fused epilogue + quantization
against the epilogue followed by a separate quantization kernel (torch eager, torch.compile,
tpfuse's own quantizer as a second Triton kernel, FlashInfer's fp4_quantize where it runs).

    python benchmarks/bench_quant.py --out benchmarks/results/quant.jsonl

Formats: fp8_static, fp8_per_token, fp8_per_group (128, DeepGEMM's column-major scales), nvfp4
(128x4-swizzled scales). Shapes: tokens 1 .. 16384, hidden 6144 (GLM-5) and 7168 (DeepSeek-V3).
Method (bench_epilogue.py's `time_providers`): each provider's call is captured in a CUDA graph
over input sets rotated so one replay touches more than twice the L2, replayed `--reps` times
between CUDA events, `--trials` measurements interleaved across providers, medians reported. Bytes counted: read x,
residual and weight; write the new residual, the quantized output and its scales. The device copy
bandwidth is measured in the same run. The unfused providers quantize the epilogue's bf16 normed
output (what an engine has between two kernels), so their codes may differ from the fused ones in
the last step; correctness is the tests' job (tests/kernels/test_quant.py), not this script's.
The torch quantizers are plain fp32 torch code (the float64 reference would be no fair baseline).

Targets (benchmark figures): at >= 4096 tokens the fused path reaches >= 85% of the copy
bandwidth; at 1-64 tokens it costs <= 0.3 us more than the unquantized epilogue and is >= 1.5x
faster than epilogue + separate quantization. The table printed last shows each.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_epilogue import copy_rows, time_providers  # same directory
from tpfuse import quant as Q
from tpfuse.results import append_rows, make_row

TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
HIDDENS = (6144, 7168)
FORMATS = ("fp8_static", "fp8_per_token", "fp8_per_group", "nvfp4")
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints of the e2m1 grid


def spec_for(kind: str, device) -> Q.QuantSpec:
    one = lambda v: torch.full((1,), v, dtype=torch.float32, device=device)  # noqa: E731
    return {
        "fp8_static": Q.fp8_static(one(0.02)),
        "fp8_per_token": Q.fp8_per_token(),
        "fp8_per_group": Q.fp8_per_group(128, layout="col"),
        "nvfp4": Q.nvfp4(one(448.0 * 6 / 8.0), swizzled=True),
    }[kind]


def out_bytes(kind: str, tokens: int, hidden: int) -> int:
    """Bytes written for the quantized output and its scales."""
    if kind == "nvfp4":
        return tokens * hidden // 2 + (-(-tokens // 128) * 128) * (-(-hidden // 64) * 4)
    scales = {"fp8_static": 0, "fp8_per_token": 4 * tokens, "fp8_per_group": 4 * tokens * hidden // 128}[kind]
    return tokens * hidden + scales


# ---- separate quantizers in torch (fp32 math, as an engine's unfused quant op) --------------

def torch_quant(kind: str, spec: Q.QuantSpec):
    def fp8(a, scale):
        inv = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
        return (a * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

    def run(normed):
        a = normed.float()
        m, h = a.shape
        if kind == "fp8_static":
            return fp8(a, spec.scale), spec.scale
        if kind == "fp8_per_token":
            scale = a.abs().amax(-1, keepdim=True) / 448.0
            return fp8(a, scale), scale
        if kind == "fp8_per_group":
            g = a.view(m, h // 128, 128)
            scale = g.abs().amax(-1, keepdim=True) / 448.0
            return fp8(g, scale).view(m, h), scale.view(m, -1).t().contiguous().t()
        g = a.view(m, h // 16, 16)
        gs = spec.scale
        sf = (gs * (g.abs().amax(-1, keepdim=True) * (1.0 / 6.0))).clamp(max=448.0).to(torch.float8_e4m3fn)
        sfv = sf.float()
        q = g * torch.where(sfv == 0, torch.zeros_like(sfv), gs / sfv)
        bounds = torch.tensor(E2M1_BOUNDS, device=a.device)
        codes = (torch.bucketize(q.abs(), bounds) + 8 * (q < 0)).to(torch.uint8).view(m, h)
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        mp, k = -(-m // 128) * 128, h // 16
        padded = torch.zeros(mp, -(-k // 4) * 4, dtype=torch.uint8, device=a.device)
        padded[:m, :k] = sf.view(m, k).view(torch.uint8)
        swz = padded.view(mp // 128, 4, 32, -1, 4).permute(0, 3, 2, 1, 4).contiguous()
        return packed, swz.view(mp, -1)

    return run


def providers(kind: str, spec: Q.QuantSpec, eps: float):
    """name -> factory(x, res, w) -> zero-argument call; plus notes on what could not run."""
    from tpfuse.kernels.epilogue import hardware_fp4, hardware_fp8, residual_rmsnorm
    from tpfuse.kernels.quant import quantize

    hw = dict(hw_fp8=hardware_fp8("cuda"), hw_fp4=hardware_fp4("cuda"))  # the fused kernel's conversions
    eager = torch_quant(kind, spec)
    compiled = torch.compile(eager, dynamic=True)

    def separate(quantizer):
        def factory(x, res, w):
            normed, new_res = torch.empty_like(x), torch.empty_like(x)
            return lambda: quantizer(residual_rmsnorm(x, res, w, eps, out=(normed, new_res))[0])
        return factory

    table = {
        "fused": lambda x, r, w: (lambda: residual_rmsnorm(x, r, w, eps, quant=spec)),
        "epilogue_only": separate(lambda normed: normed),
        "epilogue+torch": separate(eager),
        "epilogue+compile": separate(compiled),
        "epilogue+tpfuse_quant": separate(lambda normed: quantize(normed, spec, **hw)),
    }
    notes = {}
    if kind == "nvfp4":
        try:
            from flashinfer import fp4_quantize

            if torch.cuda.get_device_capability() < (10, 0):
                raise RuntimeError("fp4_quantize converts only on sm_100+ (cvt_warp_fp16_to_fp4 needs __CUDA_ARCH__ >= 1000)")
            table["epilogue+flashinfer"] = separate(lambda normed: fp4_quantize(normed, spec.scale, 16, False, True))
        except Exception as exc:
            notes["epilogue+flashinfer"] = f"{type(exc).__name__}: {exc}"
    return table, notes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/quant.jsonl")
    p.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    p.add_argument("--hidden", type=int, nargs="*", default=list(HIDDENS))
    p.add_argument("--formats", nargs="*", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--eps", type=float, default=1e-6)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_quant: needs a CUDA GPU; torch sees none", file=sys.stderr)
        return 2
    import torch._dynamo as dynamo

    dynamo.config.cache_size_limit = 256  # one graph per (format, shape): bench_epilogue hit the default limit
    rows = copy_rows(args.reps, args.trials)
    copy_gbps = max(row.extra["gbps"] for row in rows)
    summary, all_notes = [], {}
    for kind in args.formats:
        spec = spec_for(kind, "cuda")
        table, notes = providers(kind, spec, args.eps)
        all_notes.update({f"{kind} {k}": v for k, v in notes.items()})
        for hidden in args.hidden:
            for tokens in args.tokens:
                nbytes = 3 * tokens * hidden * 2 + hidden * 2 + out_bytes(kind, tokens, hidden)
                samples, failed, sets = time_providers(table, tokens, hidden, nbytes, reps=args.reps, trials=args.trials)
                medians = {}
                for name, s in samples.items():
                    row = make_row(f"residual_rmsnorm_quant:{kind}", name, {"tokens": tokens, "hidden": hidden},
                                   "bfloat16", 1, s, "us", input_sets=sets, quant=spec.key)
                    if name == "fused":
                        gbps = nbytes / (row.median * 1e-6) / 1e9
                        row.extra.update(gbps=gbps, copy_fraction=gbps / copy_gbps, copy_gbps=copy_gbps, bytes=nbytes)
                    rows.append(row)
                    medians[name] = row.median
                for name, why in failed.items():
                    rows.append(make_row(f"residual_rmsnorm_quant:{kind}", name, {"tokens": tokens, "hidden": hidden},
                                         "bfloat16", 1, [], "us", failed=why))
                summary.append((kind, tokens, hidden, medians, nbytes))
    for name, why in all_notes.items():
        rows.append(make_row("residual_rmsnorm_quant", name, {}, "bfloat16", 1, [], "us", unavailable=why))
    append_rows(args.out, rows)
    _print_summary(summary, copy_gbps, all_notes)
    return 0


def _print_summary(summary, copy_gbps, notes) -> None:
    nan = float("nan")
    print(f"\ndevice copy bandwidth: {copy_gbps:,.0f} GB/s (read + write)")
    print(f"{'format':>13} {'tokens':>6} {'hidden':>6} | {'fused us':>8} {'%copy':>6} | {'epi us':>7} {'+us':>6} | "
          f"{'best sep.':>9} {'(which)':>24} {'x sep.':>6}")
    for kind, tokens, hidden, med, nbytes in summary:
        fused = med.get("fused", nan)
        epi = med.get("epilogue_only", nan)
        separate = {k: v for k, v in med.items() if k.startswith("epilogue+")}
        best = min(separate, key=separate.get) if separate else "-"
        best_us = separate.get(best, nan)
        frac = nbytes / (fused * 1e-6) / 1e9 / copy_gbps
        print(f"{kind:>13} {tokens:>6} {hidden:>6} | {fused:>8.2f} {frac:>6.1%} | {epi:>7.2f} {fused - epi:>+6.2f} | "
              f"{best_us:>9.2f} {best:>24} {best_us / fused:>6.2f}")
    for name, why in notes.items():
        print(f"{name} not run: {why}")
    print("targets: %copy >= 85% at >= 4096 tokens; at 1-64 tokens +us <= 0.30 and x sep. >= 1.5")


if __name__ == "__main__":
    sys.exit(main())
