"""What bounds the quantized epilogue: one launch of each kernel variant under Nsight Compute, and
the counters that say why (memory and SM throughput, issue slots, registers, occupancy, the
warps' stall reasons), summarised as result rows.

    python benchmarks/device/quant_profile.py prepare --commit 38f0a72 --dir .cache/before   # here, with git
    ncu --clock-control none --target-processes all -k regex:residual_rmsnorm --page raw --csv \\
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \\
        --section SchedulerStats --print-units base --log-file ncu.csv \\
        python benchmarks/device/quant_profile.py launch --before .cache/before --labels labels.json
    python benchmarks/device/quant_profile.py summarize ncu.csv labels.json --out rows.jsonl

(`benchmarks/device/quant_profile.sh` runs the last two on the device.) Variants, each format
(`--formats`; default fp8_static, fp8_per_token, fp8_per_group 128 column-major, nvfp4 swizzled)
at one shape (`--tokens`, `--hidden`), bf16, with residual: `before` (the kernels of `--commit`,
loaded from the prepared copy, launched whole rows a program as kernels before slices were), `after`
(this tree's launcher, its own launch configuration), `after` + a `bench_quant.py --configs` name
for each `--configs` value (e.g. `8:1:2048`: 8 warps, slices of 2048 columns; `16:1:r40`: 16 warps
capped at 40 registers a thread); and `epilogue`, the unquantized kernel, for the bound a quantized
call should approach.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
FORMATS = ("fp8_static", "fp8_per_token", "fp8_per_group", "nvfp4")
METRICS = {  # ncu raw metric -> short name
    "gpu__time_duration.sum": "time",
    "dram__cycles_active.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "mem_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_pct",
    "launch__registers_per_thread": "regs",
    "sm__maximum_warps_per_active_cycle_pct": "occ_theory_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occ_achieved_pct",
    "launch__occupancy_limit_registers": "blocks_by_regs",
    "smsp__average_warp_latency_per_inst_issued.ratio": "cycles_per_issue",
    "smsp__inst_executed.sum": "inst",
}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")


def prepare(commit: str, out: Path) -> None:
    """Copy the kernels of `commit` to `out` as importable modules quant_before / epilogue_before."""
    out.mkdir(parents=True, exist_ok=True)
    show = lambda path: subprocess.run(["git", "show", f"{commit}:{path}"], check=True, capture_output=True,  # noqa: E731
                                       text=True, cwd=ROOT).stdout
    (out / "quant_before.py").write_text(show("src/tpfuse/kernels/quant.py"))
    epi = show("src/tpfuse/kernels/epilogue.py").replace("from tpfuse.kernels.quant import", "from quant_before import")
    (out / "epilogue_before.py").write_text(epi)
    (out / "COMMIT").write_text(commit + "\n")


def quant_launch(module, s, r, w, eps, spec):
    """`module`'s quantized epilogue kernel on (s, r, w), launched as its launcher did before rows
    were cut into slices (whole rows a program): the `before` variant, for trees whose launcher
    took no launch configuration."""
    import torch
    import triton

    m, h = s.shape
    buf = module.QuantBuffers(spec, m, h, s.device, module.hardware_fp8(s.device), module.hardware_fp4(s.device))
    try:
        block, num_warps, rows = module.launch_config(h, s.element_size(), m, quantized=True)
    except TypeError:  # a launcher from before quantized output had launch configurations of its own
        block, num_warps, rows = module.launch_config(h, s.element_size(), m)
    block = max(block, module.block_for(h, spec.kind))
    new_res = torch.empty_like(s)
    try:
        pad = module.pad_programs(m, h) if buf.swizzled else 0
    except TypeError:  # a tree from before the padding was zeroed in words: rows of 16 a program
        pad = module.pad_programs(m)
    grid = triton.cdiv(m, rows) + pad
    kw = buf.constexprs(block)
    del kw["BLOCK"]
    module.residual_rmsnorm_quant_kernel[(grid,)](
        s, r, w, s, new_res, m, h, float(eps), buf.codes, buf.codes.stride(0), buf.scales, *buf.s_strides, buf.param,
        buf.scale_ub, BLOCK_H=block, ROWS=rows, HAS_RES=True, SOFT_BF16=False, WITH_NORMED=False,
        num_warps=num_warps, **kw,
    )
    return buf.codes, buf.scales


def launch(args) -> int:
    """One launch of every variant (the first call of each compiles it; ncu sees launches only)."""
    import torch

    from bench_quant import config_name, launch_tuple, spec_for
    from tpfuse.kernels import epilogue

    configs = args.configs
    t, h = args.tokens, args.hidden
    dev = args.device
    gen = torch.Generator(device=dev).manual_seed(0)
    s, r = (torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(h, device=dev, generator=gen)).to(torch.bfloat16)
    labels = [{"variant": "epilogue", "format": None}]
    epilogue.residual_rmsnorm(s, r, w, 1e-6)
    before = None
    if args.before:
        sys.path.insert(0, str(Path(args.before).resolve()))
        before = importlib.import_module("epilogue_before")
    for kind in args.formats:
        spec = spec_for(kind, dev)
        variants = [("after", None)] + [("after" + config_name(c)[len("fused"):], launch_tuple(c, h, kind))
                                        for c in configs]
        if before is not None:
            variants.insert(0, ("before", None))
        ref = None
        for name, config in variants:
            if name == "before":
                got = quant_launch(before, s, r, w, 1e-6, spec)
            else:
                q = epilogue.residual_rmsnorm(s, r, w, 1e-6, quant=spec, config=config)
                got = (q.out, q.scale)
            labels.append({"variant": name, "format": kind})
            got = (got[0].clone(), got[1].clone())
            if ref is None:
                ref = (name, got)
            elif not (torch.equal(got[0], ref[1][0]) and torch.equal(_bytes(got[1]), _bytes(ref[1][1]))):
                labels[-1]["bits_differ_from"] = ref[0]
    from tpfuse.results import environment

    gpu, versions = environment()
    meta = {"tokens": t, "hidden": h, "gpu": gpu, "versions": versions, "launches": labels}
    Path(args.labels).write_text(json.dumps(meta))
    print(f"launched {len(labels)} kernels at {t} x {h}")
    return 0


def _bytes(t):
    """t's bytes (any layout; scales may be column-major)."""
    import torch

    return t.contiguous().view(-1).view(torch.uint8)


def summarize(args) -> int:
    """ncu's raw CSV + the launch labels -> a table and result rows (median = ncu's kernel time, us)."""
    from tpfuse.results import append_rows, make_row

    text = Path(args.csv).read_text().splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith('"ID"'))
    table = list(csv.reader(text[start:]))
    header, units = table[0], dict(zip(table[0], table[1]))
    data = [row for row in table[2:] if len(row) == len(header)]
    meta = json.loads(Path(args.labels).read_text())
    labels = meta["launches"]
    if "versions" not in meta and args.env_from:  # labels written before they carried the device's environment
        first = json.loads(Path(args.env_from).read_text().splitlines()[0])
        meta.update(gpu=first["gpu"], versions=first["versions"])
    if len(data) != len(labels):
        print(f"summarize: {len(data)} profiled kernels, {len(labels)} labels; matching in order", file=sys.stderr)
    rows, lines = [], []
    for label, values in zip(labels, data):
        record = dict(zip(header, values))
        m = {short: _num(record.get(name)) for name, short in METRICS.items()}
        stalls = {STALL.match(k).group(1): _num(v) for k, v in record.items() if STALL.match(k)}
        top = sorted(((v, k) for k, v in stalls.items() if v is not None), reverse=True)[:4]
        m["stalls_top"] = {k: round(v, 2) for v, k in top}
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(units.get("gpu__time_duration.sum"), 1e-3)
        time_us = m["time"] * scale if m["time"] is not None else None
        op = "ncu:residual_rmsnorm" + (f"_quant:{label['format']}" if label["format"] else "")
        rows.append(make_row(op, label["variant"], {"tokens": meta["tokens"], "hidden": meta["hidden"]}, "bfloat16", 1,
                             [time_us] if time_us is not None else [], "us", kernel=record.get("Kernel Name"),
                             clock_control="none", **{k: v for k, v in m.items() if k != "time"},
                             **{k: v for k, v in label.items() if k == "bits_differ_from"}))
        lines.append(f"{label['format'] or '-':>13} {label['variant']:>18} | {_fmt(time_us, 7, 2)} us | dram "
                     f"{_fmt(m['dram_pct'], 5, 1)}% sm {_fmt(m['sm_pct'], 5, 1)}% "
                     f"issue {_fmt(m['issue_pct'], 5, 1)}% | regs {_fmt(m['regs'], 4, 0)} "
                     f"occ {_fmt(m['occ_theory_pct'], 5, 1)}/{_fmt(m['occ_achieved_pct'], 5, 1)}%"
                     f" | {' '.join(f'{k}={v:.1f}' for k, v in m['stalls_top'].items())}"
                     + (" BITS DIFFER" if "bits_differ_from" in label else ""))
    if "versions" in meta:  # the device's, not this process's (summaries may be made elsewhere)
        rows = [dataclasses.replace(row, gpu=meta["gpu"], versions=meta["versions"]) for row in rows]
    if args.out:
        append_rows(args.out, rows)
    print(f"ncu --clock-control none, {meta['tokens']} tokens x {meta['hidden']}, bf16 (time: one launch, ncu's)")
    print("\n".join(lines))
    return 0


def _num(value):
    try:
        return float(str(value).replace(",", ""))
    except (TypeError, ValueError):
        return None


def _fmt(value, width, digits):
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'?':>{width}}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--commit", required=True)
    pp.add_argument("--dir", required=True)
    pl = sub.add_parser("launch")
    pl.add_argument("--before")
    pl.add_argument("--labels", required=True)
    pl.add_argument("--tokens", type=int, default=4096)
    pl.add_argument("--hidden", type=int, default=6144)
    pl.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    pl.add_argument("--configs", nargs="*", default=[], metavar="WARPS:ROWS[:SLICE|:p][:rREGS]",
                    help="launch configurations profiled beside the launcher's own, as bench_quant.py --configs")
    pl.add_argument("--device", default="cuda", help="cpu: a dry run in the Triton interpreter (TRITON_INTERPRET=1)")
    ps = sub.add_parser("summarize")
    ps.add_argument("csv")
    ps.add_argument("labels")
    ps.add_argument("--out")
    ps.add_argument("--env-from", help="a rows file of the same device run, for labels without its environment")
    args = p.parse_args(argv)
    if args.cmd == "launch":
        from bench_quant import parse_configs

        try:
            args.configs = parse_configs(args.configs)
        except ValueError as exc:
            pl.error(str(exc))
    if args.cmd == "prepare":
        prepare(args.commit, Path(args.dir))
        return 0
    return launch(args) if args.cmd == "launch" else summarize(args)


if __name__ == "__main__":
    sys.exit(main())
