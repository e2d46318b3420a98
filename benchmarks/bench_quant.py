"""Residual-add + RMSNorm with quantized output on one GPU: tpfuse's fused epilogue beside the
engines' own fused kernels and torch.compile of the reference, with the unquantized epilogue and
the epilogue + tpfuse's separate quantizer for scale.

    python benchmarks/bench_quant.py --out benchmarks/results/quant.jsonl

Formats: fp8_static, fp8_per_token, fp8_per_group (128, DeepGEMM's column-major scales), nvfp4
(128x4-swizzled scales). Shapes: tokens 1 .. 16384, hidden 6144 (GLM-5) and 7168 (DeepSeek-V3).
Providers (`providers`):
- `fused`: tpfuse's epilogue with quantized output (one kernel); `epilogue_only`: the same
  epilogue writing the bf16 normed rows (the unquantized call the decode targets compare with);
- `torch_compile`: the whole reference (add, RMSNorm in fp32, the format's quantizer in fp32)
  under torch.compile, what Inductor fuses it into (dynamic shapes; not at 1 token, where it
  specialises and recompiles);
- `flashinfer`: FlashInfer's fused kernels where one exists for the format and GPU:
  `fused_add_rmsnorm_quant` (static FP8) and `fused_add_rmsnorm_fp8_block_quant` (1x128 FP8,
  column-major scales; it also writes the bf16 normed rows and quantizes those). Both work in
  place (new residual into `residual`). FlashInfer has no per-token FP8 RMSNorm kernel and its
  FP4 quantizers need sm_100; vLLM's and sglang's fused kernels sit in wheels too large to carry
  to the device (a row `unavailable` says so for each);
- `epilogue+tpfuse_quant`: the epilogue then tpfuse's standalone Triton quantizer.
Every provider runs on the same inputs; before timing, each one's codes and scales are compared
with `fused`'s (`extra.agreement`: the fraction of code bytes that differ, the largest difference
in grid steps, the largest relative scale difference; `fused` itself is bit-exact to
`tpfuse.reference.quantize_ref`, which the tests check).

Method (bench_epilogue.py's `time_providers`): each provider's call is captured in a CUDA graph
over input sets rotated so one replay touches more than twice the L2, replayed `--reps` times
between CUDA events, `--trials` measurements interleaved across providers, medians reported.
Bytes counted for `fused`: read x, residual and weight; write the new residual, the quantized
output and its scales; each engine row carries its own bytes (FlashInfer's block quant also
writes the normed rows). The device copy bandwidth is measured in the same run.

Targets (benchmark figures): at >= 4096 tokens `fused` reaches >= 90% (fp8_static), >= 88%
(per token, per group) and >= 80% (nvfp4) of the copy bandwidth; at 1-64 tokens it costs <= 0.3 us
(FP8) / 0.8 us (NVFP4) more than `epilogue_only`. The table printed last shows each.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

from bench_epilogue import copy_rows, time_providers  # same directory
from tpfuse import quant as Q
from tpfuse.results import append_rows, make_row

TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
HIDDENS = (6144, 7168)
FORMATS = ("fp8_static", "fp8_per_token", "fp8_per_group", "nvfp4")
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints of the e2m1 grid
TARGETS = {"fp8_static": 0.90, "fp8_per_token": 0.88, "fp8_per_group": 0.88, "nvfp4": 0.80}  # of copy bandwidth
DECODE_TARGET_US = {"fp8_static": 0.3, "fp8_per_token": 0.3, "fp8_per_group": 0.3, "nvfp4": 0.8}
# Wheels too large to carry to a device without network (64 MiB for everything), read from the
# package index on 2026-12-01: the reason no vLLM / sglang kernel is measured.
UNCARRIED = {"vllm": "vllm 0.33.0 wheel is 336.4 MB (rms_norm_dynamic_per_token_quant, rms_norm_static_fp8_quant)",
             "sglang": "sglang-kernel 0.4.10 wheel is 373.0 MB, sgl-kernel 0.3.21 535.6 MB"}


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


# ---- quantizers in torch (fp32 math, as an engine's unfused quant op) -----------------------

def torch_quant(kind: str, spec: Q.QuantSpec):
    """normed rows (M, H) -> (codes, scales) in `spec`'s layout, plain fp32 torch."""
    device = spec.scale.device if isinstance(spec.scale, torch.Tensor) else "cpu"
    bounds = torch.tensor(E2M1_BOUNDS, device=device)  # made here: no host copy inside a graph capture

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
        codes = (torch.bucketize(q.abs(), bounds.to(q.device)) + 8 * (q < 0)).to(torch.uint8).view(m, h)
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        mp, k = -(-m // 128) * 128, h // 16
        padded = torch.zeros(mp, -(-k // 4) * 4, dtype=torch.uint8, device=a.device)
        padded[:m, :k] = sf.view(m, k).view(torch.uint8)
        swz = padded.view(mp // 128, 4, 32, -1, 4).permute(0, 3, 2, 1, 4).contiguous()
        return packed, swz.view(mp, -1)

    return run


def reference_fused(kind: str, spec: Q.QuantSpec, eps: float):
    """The whole reference as one function (add, RMSNorm in fp32, quantize): what torch.compile
    is given. Returns (codes, scales, new residual)."""
    quantize = torch_quant(kind, spec)

    def fn(x, res, w):
        h = (x.float() + res.float()).to(x.dtype)
        hf = h.float()
        y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
        codes, scales = quantize(y)
        return codes, scales, h

    return fn


def providers(kind: str, spec: Q.QuantSpec, eps: float, configs=()):
    """(name -> factory(x, res, w) -> (zero-argument call, outputs() -> (codes, scales)), notes on
    what could not run, extra bytes a provider moves beyond `fused`'s). `configs`: `parse_config`
    tuples, each a `fused[w=..,r=..]` (`fused[w=..,r=..,s=..]`: the columns one program quantizes;
    `parts`: rows in two parts; `regs=..`: the registers a thread may use) provider launched with
    that configuration instead of `quant_launch_config`'s."""
    from tpfuse.kernels.device import hardware_fp4, hardware_fp8
    from tpfuse.kernels.epilogue import residual_rmsnorm
    from tpfuse.kernels.quant import quantize

    hw = dict(hw_fp8=hardware_fp8("cuda"), hw_fp4=hardware_fp4("cuda"))  # the fused kernel's conversions
    compiled = torch.compile(reference_fused(kind, spec, eps), dynamic=True)

    def fused(x, r, w):
        box = {}
        def call():
            box["out"] = residual_rmsnorm(x, r, w, eps, quant=spec)
        return call, lambda: (box["out"].out, box["out"].scale)

    def epilogue_only(x, r, w):
        out = (torch.empty_like(x), torch.empty_like(x))
        return (lambda: residual_rmsnorm(x, r, w, eps, out=out)), None

    def separate(x, r, w):
        out, box = (torch.empty_like(x), torch.empty_like(x)), {}
        def call():
            box["out"] = quantize(residual_rmsnorm(x, r, w, eps, out=out)[0], spec, **hw)
        return call, lambda: box["out"]

    def torch_compile(x, r, w):
        box = {}
        def call():
            box["out"] = compiled(x, r, w)
        return call, lambda: box["out"][:2]

    def fused_with(*parsed):
        def factory(x, r, w):
            box, config = {}, launch_tuple(parsed, x.shape[1], kind)
            def call():
                box["out"] = residual_rmsnorm(x, r, w, eps, quant=spec, config=config)
            return call, lambda: (box["out"].out, box["out"].scale)
        return factory

    table = {"fused": fused, "epilogue_only": epilogue_only, "torch_compile": torch_compile,
             "epilogue+tpfuse_quant": separate}
    table.update({config_name(c): fused_with(*c) for c in configs})
    notes, extra_bytes = dict(UNCARRIED), {}
    try:
        table["flashinfer"], extra_bytes["flashinfer"] = _flashinfer(kind, spec, eps)
    except Exception as exc:  # report why, keep benchmarking the rest
        notes["flashinfer"] = f"{type(exc).__name__}: {exc}"
    return table, notes, extra_bytes


def parse_config(text: str) -> tuple:
    """(warps, rows[, slice | "p"], regs) of one `--configs` value; ValueError or AssertionError
    for one that is not WARPS:ROWS[:SLICE|:p][:rREGS]."""
    fields = text.split(":")
    regs = 0
    if len(fields) > 2 and fields[-1].startswith("r"):
        regs = int(fields.pop()[1:])
        assert 24 <= regs <= 255
    config = tuple(v if v == "p" else int(v) for v in fields)
    assert len(config) in (2, 3) and config[0] in (1, 2, 4, 8, 16, 32) and config[1] >= 1
    if len(config) == 3:
        assert config[2] == "p" or (config[2] > 0 and config[2] & (config[2] - 1) == 0 and config[1] == 1)
    return (*config, regs)


def parse_configs(texts) -> list[tuple]:
    """`parse_config` of each `--configs` value; ValueError naming the accepted form otherwise."""
    try:
        return [parse_config(c) for c in texts]
    except (ValueError, AssertionError):
        raise ValueError(f"--configs takes WARPS:ROWS, WARPS:1:SLICE or WARPS:ROWS:p, each optionally followed by "
                         f":rREGS (warps a power of two up to 32, rows >= 1, slice a power of two; p: each row whole "
                         f"in two power-of-two parts; REGS 24-255), got {list(texts)}") from None


def launch_tuple(config: tuple, hidden: int, kind: str) -> tuple[int, int, int, int, int]:
    """`residual_rmsnorm`'s `config` (BLOCK_H, num_warps, rows, SLICE, REGS) for one `parse_config`
    tuple at `hidden` columns of format `kind`."""
    from tpfuse.kernels.quant import block_for

    warps, rows, *cut, regs = config
    block = max(triton.next_power_of_2(hidden), block_for(hidden, kind))
    if cut == ["p"]:  # the row whole in two parts: BLOCK_H half the masked block
        return block // 2, warps, rows, block // 2, regs
    return block, warps, rows, cut[0] if cut else block, regs


def config_name(config: tuple) -> str:
    """The provider name of a `--configs` launch configuration (`parse_config`'s tuple)."""
    *shape, regs = config
    return "fused[" + ",".join(["parts" if v == "p" else f"{k}={v}" for k, v in zip("wrs", shape)]
                               + ([f"regs={regs}"] if regs else [])) + "]"


def _flashinfer(kind: str, spec: Q.QuantSpec, eps: float):
    """(factory, bytes it moves beyond `fused` as a function of (tokens, hidden)) for FlashInfer's
    fused kernel of `kind`; raises with the reason where there is none."""
    import flashinfer
    from flashinfer import norm

    if kind == "fp8_static":
        def factory(x, r, w):
            out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
            return (lambda: norm.fused_add_rmsnorm_quant(out, x, r, w, spec.scale, eps)), (lambda: (out, spec.scale))
        return factory, lambda t, h: 0
    if kind == "fp8_per_group":
        def factory(x, r, w):
            m, h = x.shape
            out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
            storage = torch.empty(h // 128, -(-m // 4) * 4, dtype=torch.float32, device=x.device)
            normed = torch.empty_like(x)
            call = lambda: norm.fused_add_rmsnorm_fp8_block_quant(out, storage, normed, x, r, w, eps)  # noqa: E731
            return call, (lambda: (out, storage.t()[:m]))
        return factory, lambda t, h: 2 * t * h  # it also writes the bf16 normed rows
    if kind == "fp8_per_token":
        raise RuntimeError(f"flashinfer {flashinfer.__version__} has no fused add + RMSNorm + per-token FP8 kernel "
                           "(its per-token FP8 sits in the multi-GPU allreduce fusion)")
    raise RuntimeError(f"flashinfer {flashinfer.__version__}: its FP4 quantizers (fp4_quantize, add_rmsnorm_fp4quant) "
                       "convert only on sm_100 and newer (cvt.rn.satfinite.e2m1x2); this GPU is sm_"
                       + "".join(map(str, torch.cuda.get_device_capability())))


def agreement(kind: str, got, ref) -> dict:
    """How `got` (codes, scales) differs from `ref`'s (tpfuse's fused output, bit-exact to the
    reference): fraction of differing code bytes, largest difference in grid steps, largest
    relative scale difference."""
    (gc, gs), (rc, rs) = got, ref
    gb, rb = gc.contiguous().view(torch.uint8), rc.contiguous().view(torch.uint8)
    steps = (_ordinal(gb, kind == "nvfp4") - _ordinal(rb, kind == "nvfp4")).abs()
    gs = gs.contiguous().float() if gs.element_size() == 4 else gs.contiguous().view(torch.float8_e4m3fn).float()
    rs = rs.contiguous().float() if rs.element_size() == 4 else rs.contiguous().view(torch.float8_e4m3fn).float()
    rel = ((gs - rs).abs() / rs.abs().clamp_min(1e-30)).max().item() if gs.shape == rs.shape else None
    return {"codes_differ": (gb != rb).float().mean().item(), "max_steps": int(steps.max().item()),
            "scale_max_rel": rel}


def _ordinal(codes, nibbles: bool):
    c = codes.to(torch.int32)
    if nibbles:
        c = torch.stack([c & 0xF, c >> 4], dim=-1)
        return torch.where(c >= 8, -(c - 8), c)
    return torch.where(c >= 0x80, -(c - 0x80), c)


def check_providers(table: dict, kind: str, tokens: int, hidden: int, device="cuda") -> dict:
    """{provider: agreement with `fused`} on one fresh random input (every provider gets copies:
    the in-place ones overwrite theirs)."""
    gen = torch.Generator(device=device).manual_seed(tokens * 7 + hidden)
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    r = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, device=device, generator=gen)).to(torch.bfloat16)
    outs, failed = {}, {}
    for name, factory in table.items():
        try:
            call, outputs = factory(x.clone(), r.clone(), w)
            if outputs is None:
                continue
            call()
            outs[name] = outputs()
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    ref = outs.get("fused")
    result = {name: agreement(kind, got, ref) for name, got in outs.items() if name != "fused" and ref is not None}
    result.update({name: {"failed": why} for name, why in failed.items()})
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/quant.jsonl")
    p.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    p.add_argument("--hidden", type=int, nargs="*", default=list(HIDDENS))
    p.add_argument("--formats", nargs="*", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--configs", nargs="*", default=[], metavar="WARPS:ROWS[:SLICE|:p][:rREGS]",
                   help="also time the fused kernel with these launch configurations (warps, rows per program, "
                        "optionally the columns one program quantizes: a power of two, rows 1; or p: each row "
                        "whole in two power-of-two parts, where its columns are a power of two and a smaller one; "
                        "then optionally rREGS, the registers a thread may use, e.g. 4:1:p:r128)")
    args = p.parse_args(argv)
    try:
        configs = parse_configs(args.configs)
    except ValueError as exc:
        p.error(str(exc))
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
        table, notes, extra_bytes = providers(kind, spec, args.eps, configs)
        all_notes.update({f"{kind} {k}": v for k, v in notes.items()})
        for hidden in args.hidden:
            for tokens in args.tokens:
                shape_table = {k: v for k, v in table.items() if not (k == "torch_compile" and tokens == 1)}
                nbytes = 3 * tokens * hidden * 2 + hidden * 2 + out_bytes(kind, tokens, hidden)
                agree = check_providers(shape_table, kind, tokens, hidden)
                timed = {k: (lambda f: (lambda x, r, w: f(x, r, w)[0]))(v) for k, v in shape_table.items()}
                samples, failed, sets = time_providers(timed, tokens, hidden, nbytes, reps=args.reps,
                                                       trials=args.trials)
                medians = {}
                for name, s in samples.items():
                    row = make_row(f"residual_rmsnorm_quant:{kind}", name, {"tokens": tokens, "hidden": hidden},
                                   "bfloat16", 1, s, "us", input_sets=sets, quant=spec.key)
                    moved = nbytes + (extra_bytes[name](tokens, hidden) if name in extra_bytes else 0)
                    if name.startswith("fused") or name in ("flashinfer", "torch_compile"):
                        gbps = moved / (row.median * 1e-6) / 1e9
                        row.extra.update(gbps=gbps, copy_fraction=gbps / copy_gbps, copy_gbps=copy_gbps, bytes=moved)
                    if name in agree:
                        row.extra["agreement"] = agree[name]
                    rows.append(row)
                    medians[name] = row.median
                for name, why in failed.items():
                    rows.append(make_row(f"residual_rmsnorm_quant:{kind}", name, {"tokens": tokens, "hidden": hidden},
                                         "bfloat16", 1, [], "us", failed=why))
                summary.append((kind, tokens, hidden, medians, nbytes, extra_bytes, agree))
        append_rows(args.out, rows)  # format by format: a run stopped at its time limit keeps what it measured
        rows = []
    for name, why in all_notes.items():
        rows.append(make_row("residual_rmsnorm_quant", name, {}, "bfloat16", 1, [], "us", unavailable=why))
    append_rows(args.out, rows)
    _print_summary(summary, copy_gbps, all_notes)
    return 0


def _cell(value: float, width: int, spec: str) -> str:
    """`value` formatted to `width`, or "-" there for a figure that was not measured (NaN)."""
    return f"{'-' if value != value else format(value, spec):>{width}}"


def _print_summary(summary, copy_gbps, notes) -> None:
    nan = float("nan")
    print(f"\ndevice copy bandwidth: {copy_gbps:,.0f} GB/s (read + write)")
    print(f"{'format':>13} {'tokens':>6} {'hidden':>6} | {'fused us':>8} {'%copy':>6} {'tgt':>4} | {'epi us':>7} "
          f"{'+us':>6} | {'compile':>8} {'%copy':>6} | {'flashinf':>8} {'%copy':>6} {'differ':>7} | {'sep.':>7}")
    for kind, tokens, hidden, med, nbytes, extra_bytes, agree in summary:
        fused, epi = med.get("fused", nan), med.get("epilogue_only", nan)
        frac = nbytes / (fused * 1e-6) / 1e9 / copy_gbps

        def pct(name):
            us = med.get(name, nan)
            moved = nbytes + (extra_bytes[name](tokens, hidden) if name in extra_bytes else 0)
            return us, moved / (us * 1e-6) / 1e9 / copy_gbps

        cu, cf = pct("torch_compile")
        fu, ff = pct("flashinfer")
        differ = agree.get("flashinfer", {}).get("codes_differ", nan)
        target = f"{TARGETS[kind]:.0%}" if tokens >= 4096 else f"+{DECODE_TARGET_US[kind]}"
        print(f"{kind:>13} {tokens:>6} {hidden:>6} | {_cell(fused, 8, '.2f')} {_cell(frac, 6, '.1%')} {target:>4} | "
              f"{_cell(epi, 7, '.2f')} {_cell(fused - epi, 6, '+.2f')} | {_cell(cu, 8, '.2f')} {_cell(cf, 6, '.1%')} | "
              f"{_cell(fu, 8, '.2f')} {_cell(ff, 6, '.1%')} {_cell(differ, 7, '.1e')} | "
              f"{_cell(med.get('epilogue+tpfuse_quant', nan), 7, '.2f')}")
    variants = [(kind, tokens, hidden, name, us, nbytes, med.get("epilogue_only", nan))
                for kind, tokens, hidden, med, nbytes, _, _ in summary for name, us in med.items()
                if name.startswith("fused[")]
    if variants:
        print(f"\n{'format':>13} {'tokens':>6} {'hidden':>6} | {'launch':>20} {'us':>8} {'%copy':>6} {'+us':>6}")
    for kind, tokens, hidden, name, us, nbytes, epi in variants:
        frac = nbytes / (us * 1e-6) / 1e9 / copy_gbps
        print(f"{kind:>13} {tokens:>6} {hidden:>6} | {name[5:]:>20} {us:>8.2f} {frac:>6.1%} {us - epi:>+6.2f}")
    for name, why in notes.items():
        print(f"{name} not run: {why}")
    variants = compiled_registers()
    if variants:
        print(f"\ncompiled quantized epilogues: {'KIND':>4} {'BLOCK_H':>7} {'P1':>5} {'SLICE':>5} {'warps':>5} "
              f"{'maxnreg':>7} {'regs':>4} {'spills':>6}")
    for v in variants:
        print(f"{'':29}{v['KIND']:>4} {v['BLOCK_H']:>7} {v['P1']:>5} {v['SLICE']:>5} {v['num_warps']:>5} "
              f"{v['maxnreg']:>7} {v['regs']:>4} {v['spills']:>6}")


def compiled_registers() -> list:
    """Registers and spilled bytes a thread of every compiled variant of the quantized epilogue
    kernel, from Triton's caches ([] where this Triton keeps its compiled kernels elsewhere)."""
    from tpfuse.kernels.epilogue import residual_rmsnorm_quant_kernel as kernel

    found = []
    try:
        for caches in kernel.device_caches.values():
            for compiled in caches[0].values():
                compiled._init_handles()
                names = compiled.src.fn.arg_names
                consts = {names[k[0]]: v for k, v in compiled.src.constants.items() if len(k) == 1}
                found.append({**{k: consts.get(k, 0) for k in ("KIND", "BLOCK_H", "P1", "SLICE")},
                              "num_warps": compiled.metadata.num_warps, "maxnreg": compiled.metadata.maxnreg or 0,
                              "regs": compiled.n_regs, "spills": compiled.n_spills})
    except (AttributeError, IndexError, KeyError, TypeError):
        return []
    return sorted(found, key=lambda v: tuple(v.values()))


if __name__ == "__main__":
    sys.exit(main())
