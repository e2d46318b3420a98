"""`tpfuse profile`: where a decode step's time goes, by stage, under torch.profiler.

Stages: attention, MoE GEMMs, other GEMMs, allreduce/communication, norm, other. Each profiled
record (a GPU kernel on CUDA; an operator's self CPU time on CPU) is attributed by `classify`:

1. anything inside `tpfuse::attention_core` (decode attention's two matmuls): attention;
2. by name, the kernel's own first and then its launching operator's: NCCL / gloo / allreduce /
   all-gather / one-shot / two-shot / Lamport -> communication; flash / fmha / attention / SDPA
   -> attention (checked before GEMMs: fused attention kernels carry "cutlass"); gemm, gemv,
   matmul, cutlass, cuBLAS, nvjet, xmma, aten::mm, grouped_mm ... -> MoE GEMMs inside
   `tpfuse::moe_experts`, other GEMMs elsewhere; rms / norm -> norm;
3. by the model's `tpfuse::*` record_function scopes: `attention` (rotary, KV-cache writes) ->
   attention; `norm` (the unfused add + RMSNorm) -> norm; `allreduce` (the unfused collective)
   -> communication; inside the fused call `allreduce_norm`, copies and casts -> communication
   (staging for the collective) and the rest -> norm (the epilogue);
4. other: the rest (router, SwiGLU, sort/scatter, embedding, argmax, ...).

Decode steps are profiled eagerly, not as graph replays, so every kernel has its launching
operator and scope; kernel durations are the same either way, launch gaps are not. Byte counts
are estimates from the model config (`stage_bytes`), not measurements.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

STAGES = ("attention", "moe_gemm", "other_gemm", "communication", "norm", "other")
STAGE_TITLES = {"attention": "attention", "moe_gemm": "MoE GEMMs", "other_gemm": "other GEMMs",
                "communication": "allreduce/comm", "norm": "norm", "other": "other"}

_COMM = ("nccl", "gloo", "allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "reducescatter",
         "oneshot", "one_shot", "twoshot", "two_shot", "lamport", "c10d::", "cross_device")
_GEMM = ("gemm", "gemv", "matmul", "cutlass", "cublas", "nvjet", "xmma", "wgmma", "grouped_mm", "aten::mm",
         "aten::addmm", "aten::bmm", "aten::linear", "splitk")
_ATTENTION = ("flash", "fmha", "attention", "sdpa", "scaled_dot_product")
_NORM = ("rms", "norm")


@dataclass(frozen=True)
class Record:
    """One profiled item: a kernel (CUDA) or an operator's self time (CPU), with its enclosing scopes."""

    name: str
    scopes: tuple[str, ...]
    time_us: float


def classify(name: str, scopes: tuple[str, ...]) -> str:
    """The stage of one record (see the module docstring for the rules and their order).

    `scopes` runs innermost first: for a kernel, its launching operator, then the enclosing ones."""
    if "tpfuse::attention_core" in scopes:
        return "attention"
    launcher = scopes[0].lower() if scopes else ""
    for text in (name.lower(), launcher):  # the kernel's own name decides first, then its operator's
        if any(k in text for k in _COMM):
            return "communication"
        if any(k in text for k in _ATTENTION):  # before GEMMs: fused attention kernels are named fmha_cutlass...
            return "attention"
        if any(k in text for k in _GEMM):
            return "moe_gemm" if "tpfuse::moe_experts" in scopes else "other_gemm"
        if any(k in text for k in _NORM):
            return "norm"
    if "tpfuse::attention" in scopes:
        return "attention"
    if "tpfuse::norm" in scopes:
        return "norm"
    if "tpfuse::allreduce" in scopes:
        return "communication"
    if "tpfuse::allreduce_norm" in scopes:
        return "communication" if "copy" in name.lower() or "copy" in launcher else "norm"
    return "other"


def records_from_profiler(prof, *, device_type: str) -> list[Record]:
    """Records of a finished torch.profiler run: kernels with their operator's scopes on CUDA,
    operators' self CPU time on CPU."""
    records = []
    for event in prof.events():
        if getattr(event, "device_type", None) is not None and "CPU" not in str(event.device_type):
            continue
        scopes, parent = [], event
        while parent is not None:
            scopes.append(parent.name)
            parent = parent.cpu_parent
        if device_type == "cuda":
            for kernel in event.kernels:
                if kernel.name.startswith("tpfuse::"):
                    continue  # a GPU-side range of a record_function scope, not a kernel
                records.append(Record(kernel.name, tuple(scopes), float(kernel.duration)))
        elif not getattr(event, "is_user_annotation", False) and event.self_cpu_time_total > 0:
            records.append(Record(event.name, tuple(scopes), float(event.self_cpu_time_total)))
    return records


def attribute(records: list[Record], *, steps: int) -> dict[str, dict]:
    """Per stage: time per step (us), share of the total, records (kernel launches or ops) per step."""
    table = {s: {"time_us": 0.0, "launches": 0} for s in STAGES}
    for r in records:
        row = table[classify(r.name, r.scopes)]
        row["time_us"] += r.time_us
        row["launches"] += 1
    total = sum(row["time_us"] for row in table.values()) or 1.0
    return {s: {"time_us_per_step": row["time_us"] / steps, "share": row["time_us"] / total,
                "launches_per_step": row["launches"] / steps} for s, row in table.items()}


def stage_bytes(cfg, *, batch: int, context: int, world_size: int, itemsize: int) -> dict[str, float]:
    """Estimated bytes one rank moves through memory per decode step, by stage (None: no estimate).

    Weights read once per step (this rank's shards); MoE experts: the expected number of distinct
    local experts hit by `batch` tokens under uniform top-k routing, E_local * (1 - (1 - k/E)^B);
    attention: the whole KV window read (static shapes) plus one slot written; communication:
    the allreduce input, 2 per layer; norm: read x, residual, weight and write residual, normed."""
    h, w, layers = cfg.hidden, world_size, cfg.num_layers
    d, heads, kv = cfg.head_dim, cfg.num_heads // w, cfg.num_kv_heads // w
    attn_weights = (h * (heads + 2 * kv) * d + heads * d * h) * layers
    dense_weights = 3 * h * (cfg.dense_inter // w) * cfg.first_dense_layers
    moe_layers = cfg.num_moe_layers
    other = attn_weights + dense_weights + h * cfg.vocab // w
    moe = 0.0
    if moe_layers:
        shared = 3 * h * (cfg.expert_inter * cfg.num_shared_experts // w)
        other += (shared + h * cfg.num_experts) * moe_layers  # shared experts and the router
        local = cfg.num_experts // w
        hit = local * (1.0 - (1.0 - cfg.top_k / cfg.num_experts) ** batch)
        moe = hit * 3 * h * cfg.expert_inter * moe_layers
    tokens_bytes = batch * h * itemsize
    return {
        "attention": float(layers * batch * kv * d * itemsize * 2 * (context + 1)),
        "moe_gemm": moe * itemsize,
        "other_gemm": float(other * itemsize),
        "communication": float(2 * layers * tokens_bytes),
        "norm": float((2 * layers + 1) * (4 * tokens_bytes + h * itemsize)),
        "other": None,
    }


# Kineto writes its own start/stop lines to fd 2 at every profiler start, whatever KINETO_LOG_LEVEL
# says, e.g. "USDT:2026-12-01 11:26:20 20773:20773 SyncActivityProfilerHandler.cpp:52] profiler_start".
_KINETO_LINE = re.compile(r"^(USDT|STAGE):\d{4}-\d\d-\d\d \S+ \d+:\d+ \w+\.cpp:\d+\] ")


@contextlib.contextmanager
def quiet_profiler_log():
    """Run the body with fd 2 captured, then write back every line that is not a Kineto status line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if not _KINETO_LINE.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def trace_paths(path: str, fusion: tuple[bool, ...]) -> dict[bool, str]:
    """Where `--trace PATH` writes each fusion mode's Chrome trace: PATH itself for one mode, else
    `<stem>.fusion-on<suffix>` and `<stem>.fusion-off<suffix>` beside it (suffix .json if none)."""
    if len(fusion) == 1:
        return {fusion[0]: path}
    p = Path(path)
    stem, suffix = (p.stem, p.suffix) if p.suffix else (p.name, ".json")
    return {f: str(p.with_name(f"{stem}.fusion-{'on' if f else 'off'}{suffix}")) for f in fusion}


def profile_rank(rank: int, world_size: int, spec, batch: int, steps: int, traces: dict[bool, str] | None,
                 keep_records: bool = False) -> dict:
    """Collective: build the model, prefill, warm up, then profile `steps` eager decode steps per fusion mode.

    `traces` (fusion mode -> path, `trace_paths`): rank 0 writes each mode's Chrome trace there,
    and raises if the file did not appear. `keep_records=True` also returns every attributed
    Record (for tests of the attribution)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tpfuse.e2e.decode import DecodeStep, build_model, prompts

    model, device, dtype = build_model(spec, rank, world_size)
    model.prepare(batch * spec.prompt_len, token_counts=(batch,))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out = {"config": model.cfg.to_dict(), "device": device.type, "dtype": str(dtype).removeprefix("torch."),
           "world_size": world_size, "batch": batch, "steps": steps, "modes": []}
    try:
        for fusion in spec.fusion:
            model.fusion = fusion
            cache = model.new_cache(batch, spec.context)
            first = model.prefill(prompts(spec, batch, model.cfg.vocab, device), cache).argmax(dim=-1)
            step = DecodeStep(model, cache, first, prompt_len=spec.prompt_len, graphs=False)
            for _ in range(max(spec.warmup, 1)):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            with quiet_profiler_log(), profile(activities=activities) as prof:
                for _ in range(steps):
                    step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
            if traces and rank == 0:
                prof.export_chrome_trace(traces[fusion])
                if not os.path.isfile(traces[fusion]) or not os.path.getsize(traces[fusion]):
                    raise RuntimeError(f"profile: the Chrome trace was not written to {traces[fusion]}")
            records = records_from_profiler(prof, device_type=device.type)
            stages = attribute(records, steps=steps)
            est = stage_bytes(model.cfg, batch=batch, context=spec.context, world_size=world_size,
                              itemsize=torch.finfo(dtype).bits // 8)
            for name, row in stages.items():
                row["bytes_per_step"] = est[name]
                t = row["time_us_per_step"]
                row["gbps"] = None if est[name] is None or t <= 0 else est[name] / (t * 1e3)
            op_name = "all_reduce_residual_rmsnorm" if fusion else "all_reduce"
            from tpfuse.spec import Op

            strategy = model.comm.comm.strategy_for(Op(op_name), batch, model.cfg.hidden, dtype).name
            out["modes"].append({"fusion": fusion, "stages": stages, "allreduces_per_step": step.allreduces,
                                 "strategy": strategy,
                                 "moe_runner": model.selector.choices[batch].name if model.selector else None,
                                 **({"records": records} if keep_records else {})})
            del step, cache
    finally:
        model.comm.close()
    return out


def plot_stages(result: dict, path: str) -> str:
    """A PNG bar chart of time per step by stage, one bar per fusion mode (needs matplotlib:
    `pip install 'tpfuse[plot]'`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    modes = result["modes"]
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        values = [mode["stages"][s]["time_us_per_step"] for s in STAGES]
        xs = [j + i * width for j in range(len(STAGES))]
        ax.bar(xs, values, width, label=f"fusion {'on' if mode['fusion'] else 'off'} ({mode['strategy']})")
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(STAGES))])
    ax.set_xticklabels([STAGE_TITLES[s] for s in STAGES])
    cfg = result["config"]
    unit = "GPU" if result["device"] == "cuda" else "CPU"
    ax.set_ylabel(f"{unit} time per decode step (us)")
    ax.set_title(f"{cfg['name']} cut to {cfg['num_layers']} layers, {cfg['num_experts']} experts, "
                 f"batch {result['batch']}, TP{result['world_size']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def profile_rows(spec, result: dict) -> list:
    """One result row per (fusion mode, stage): the sample is that stage's time per step."""
    from tpfuse.results import make_row

    cfg = result["config"]
    rows = []
    for mode in result["modes"]:
        for stage, row in mode["stages"].items():
            shape = {"preset": spec.preset, "layers": cfg["num_layers"], "experts": cfg["num_experts"],
                     "hidden": cfg["hidden"], "batch": result["batch"], "stage": stage, "context": spec.context}
            rows.append(make_row("profile_stage", mode["strategy"], shape, result["dtype"], result["world_size"],
                                 [row["time_us_per_step"]], "us", fusion=mode["fusion"], share=row["share"],
                                 launches_per_step=row["launches_per_step"], bytes_per_step_est=row["bytes_per_step"],
                                 steps=result["steps"], device=result["device"], moe_runner=mode["moe_runner"],
                                 allreduces_per_step=mode["allreduces_per_step"],
                                 time_basis="GPU kernel time" if result["device"] == "cuda" else "CPU self time"))
    return rows
