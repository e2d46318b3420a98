"""End-to-end decode benchmark of the reference TP MoE decoder, fusion on and off.

`run_e2e(spec)` starts `spec.tp` ranks (NCCL on GPUs, gloo on CPU), builds the model once per
rank, and for every (fusion, batch) point: prefills B prompts, then times decode steps. On CUDA
each decode step (model + greedy token + position advance) is captured in one CUDA graph and the
timed steps are graph replays; on CPU steps run eagerly (CUDA graphs need CUDA) and the result
says so. Reported per point: step latency (median, p20, p80), decode tokens/s (B / median step),
joules per token from the NVML total-energy counter of every rank's GPU (summed), and the
allreduces per step counted by the model's CountingCommunicator (must be 2 x layers).

The timed loop runs at least `steps` steps and at least `min_seconds`, because the NVML energy
counter advances in coarse increments: a window of about a second keeps its step small.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

from tpfuse.results import ResultRow, make_row


@dataclass(frozen=True)
class E2ESpec:
    """One `bench e2e` run. `device="auto"` picks CUDA when torch sees a GPU."""

    preset: str = "glm5"
    layers: int | None = None
    experts: int | None = None
    dense_layers: int | None = None
    vocab: int | None = None
    batches: tuple[int, ...] = (1, 8, 64)
    fusion: tuple[bool, ...] = (True, False)
    tp: int = 1
    device: str = "auto"
    dtype: str | None = None  # default: bfloat16 on CUDA, float32 on CPU
    prompt_len: int = 16
    context: int = 64
    steps: int = 20
    min_seconds: float = 1.0
    warmup: int = 3
    strategy: str = "auto"
    moe_runner: str | None = None
    graphs: bool = True  # on CUDA; CPU is always eager
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"E2ESpec: batches must be positive integers, got {self.batches}")
        if self.tp < 1:
            raise ValueError(f"E2ESpec: tp must be >= 1, got {self.tp}")
        if not 1 <= self.prompt_len < self.context:
            raise ValueError(f"E2ESpec: need 1 <= prompt_len ({self.prompt_len}) < context ({self.context}); "
                             "raise --context")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"E2ESpec: steps must be >= 1 and warmup >= 0 (got {self.steps}, {self.warmup})")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"E2ESpec: device must be auto, cpu or cuda, got {self.device!r}")

    def config(self):
        from tpfuse.models.config import model_config

        return model_config(self.preset, layers=self.layers, experts=self.experts, dense_layers=self.dense_layers,
                            vocab=self.vocab)


def resolve_device(spec: E2ESpec) -> str:
    import torch

    if spec.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench e2e: --device cuda but torch sees no CUDA GPU; use --device cpu")
    return spec.device


class EnergyMeter:
    """This process's GPU energy counter from NVML (millijoules since driver load), or why not."""

    def __init__(self, device) -> None:
        self.reason, self._handle, self._nvml = None, None, None
        if device.type != "cuda":
            self.reason = "NVML energy needs a CUDA GPU; this run is on CPU"
            return
        try:
            import pynvml
            import torch

            pynvml.nvmlInit()
            uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except pynvml.NVMLError:
                handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            self._handle, self._nvml = handle, pynvml
        except Exception as exc:  # NVML missing, no permission, or an unsupported GPU: report, don't fail
            self.reason = f"NVML energy counter unavailable: {type(exc).__name__}: {exc}"

    def read_mj(self) -> float | None:
        return None if self._handle is None else float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))


def build_model(spec: E2ESpec, rank: int, world_size: int, *, fusion: bool = True):
    """(model, device, dtype) for this rank; a collective (Communicator construction)."""
    import torch
    import torch.distributed as dist

    import tpfuse
    from tpfuse.models.decoder import TPDecoder

    device = (torch.device("cuda", torch.cuda.current_device()) if resolve_device(spec) == "cuda"
              else torch.device("cpu"))
    dtype = getattr(torch, spec.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    comm = tpfuse.Communicator(strategy=spec.strategy, device=device.type)
    model = TPDecoder(spec.config(), comm, group=dist.group.WORLD, rank=rank, world_size=world_size, seed=spec.seed,
                      dtype=dtype, device=device, fusion=fusion, capture=device.type == "cuda" and spec.graphs,
                      moe_runner=spec.moe_runner, caps=comm.caps)
    return model, device, dtype


def prompts(spec: E2ESpec, batch: int, vocab: int, device):
    """Deterministic prompt token ids (B, P), identical on every rank."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed * 7919 + batch)
    return torch.randint(0, vocab, (batch, spec.prompt_len), generator=gen).to(device)


class DecodeStep:
    """One decode step with static buffers: ids (B,), pos (1,). `__call__` advances both in place.

    On CUDA with graphs the step is captured once (after warm-up on a side stream) and replayed;
    `allreduces` is the CountingCommunicator's count for one step (at capture, for a graph).
    Construction leaves ids and pos as given, so the first call decodes at position prompt_len
    (cache slots the warm-up wrote beyond it are masked out and overwritten in order).
    `logits` is the last step's (B, V) output buffer."""

    def __init__(self, model, cache, first_ids, *, prompt_len: int, graphs: bool) -> None:
        import torch

        self.model, self.cache, self.prompt_len = model, cache, prompt_len
        self.ids = first_ids.clone()
        self.pos = torch.tensor([prompt_len], dtype=torch.long, device=first_ids.device)
        self.graph = None
        if graphs:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside capture: allocator pools, lazy inits, autotuning
                    self._eager()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            model.comm.reset()
            with torch.cuda.graph(self.graph):
                self._eager()
        else:
            model.comm.reset()
            self._eager()
        self.allreduces = dict(model.comm.counts)
        self.ids.copy_(first_ids)
        self.pos.fill_(prompt_len)

    def _eager(self) -> None:
        import torch

        self.logits = self.model.decode(self.ids, self.cache, self.pos)
        self.ids.copy_(self.logits.argmax(dim=-1))
        # The KV window wraps: positions run prompt_len .. context-1, then start over (static shapes).
        nxt = self.pos + 1
        self.pos.copy_(torch.where(nxt >= self.cache.context, torch.full_like(nxt, self.prompt_len), nxt))

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._eager()


def _time_steps(step: DecodeStep, device, spec: E2ESpec, meter: EnergyMeter) -> tuple[list[float], float | None, int]:
    """(per-step microseconds, energy in joules or None, steps timed): `tpfuse.timing.time_calls`
    (CUDA events on GPU, perf_counter on CPU), the energy counter read around the timed steps only."""
    from tpfuse.timing import time_calls

    time_calls(step, reps=0, warmup=spec.warmup, device=device)  # warm-up only, then synchronized
    energy0 = meter.read_mj()
    samples = time_calls(step, reps=spec.steps, warmup=0, device=device, min_seconds=spec.min_seconds)
    energy1 = meter.read_mj()
    energy = None if energy0 is None or energy1 is None else (energy1 - energy0) / 1e3
    return samples, energy, len(samples)


def _progress(spec: E2ESpec, rank: int, total: int):
    import sys

    if not (spec.progress and rank == 0 and sys.stderr.isatty()):  # a bar only on a terminal
        return None
    from rich.console import Console
    from rich.progress import Progress

    progress = Progress(console=Console(stderr=True), transient=True)
    progress.start()
    progress.add_task("bench e2e", total=total)
    return progress


def _e2e_rank(rank: int, world_size: int, spec: E2ESpec) -> dict:
    import torch
    import torch.distributed as dist

    from tpfuse.spec import Op

    if resolve_device(spec) == "cpu":
        # gloo ranks share the CPU: one rank's intra-op threads beyond its share only contend.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    model, device, dtype = build_model(spec, rank, world_size)
    cfg = model.cfg
    graphs = device.type == "cuda" and spec.graphs
    model.prepare(max(spec.batches) * spec.prompt_len, token_counts=tuple(spec.batches))
    meter = EnergyMeter(device)
    progress = _progress(spec, rank, len(spec.fusion) * len(spec.batches))
    points = []
    try:
        for fusion in spec.fusion:
            model.fusion = fusion
            for batch in spec.batches:
                cache = model.new_cache(batch, spec.context)
                ids = prompts(spec, batch, cfg.vocab, device)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                first = model.prefill(ids, cache).argmax(dim=-1)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                prefill_ms = (time.perf_counter() - t0) * 1e3
                step = DecodeStep(model, cache, first, prompt_len=spec.prompt_len, graphs=graphs)
                samples, energy_j, steps = _time_steps(step, device, spec, meter)
                energies: list = [None] * world_size
                dist.all_gather_object(energies, energy_j)
                total_energy = None if any(e is None for e in energies) else sum(energies)
                op = Op.ALL_REDUCE_RESIDUAL_RMSNORM if fusion else Op.ALL_REDUCE
                choice = model.comm.comm.strategy_for(op, batch, cfg.hidden, dtype, has_residual=True)
                runner = model.selector.choices[batch] if model.selector is not None else None
                median_us = statistics.median(samples)
                points.append({
                    "fusion": fusion, "batch": batch, "step_us": samples, "steps": steps,
                    "median_us": median_us, "tok_per_s": batch / (median_us * 1e-6),
                    "energy_j": total_energy,
                    "j_per_token": None if total_energy is None else total_energy / (batch * steps),
                    "energy_note": meter.reason or f"NVML total energy, summed over {world_size} GPU(s)",
                    "allreduces_per_step": step.allreduces, "expected_allreduces_per_step": 2 * cfg.num_layers,
                    "strategy": choice.name, "strategy_source": choice.source,
                    "moe_runner": runner.name if runner else None, "moe_runner_why": runner.reason if runner else None,
                    "prefill_ms": prefill_ms, "cuda_graphs": graphs,
                })
                del step, cache
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if progress is not None:
                    progress.advance(progress.task_ids[0])
    finally:
        if progress is not None:
            progress.stop()
        model.comm.close()
    notes = [] if graphs else ["decode steps ran eagerly: " + ("CUDA graphs need CUDA" if device.type == "cpu"
                                                              else "--no-graphs")]
    return {
        "config": cfg.to_dict(), "device": device.type, "dtype": str(dtype).removeprefix("torch."),
        "world_size": world_size, "points": points, "notes": notes,
        "moe_runners": model.selector.report() if model.selector is not None else [],
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


def run_e2e(spec: E2ESpec, *, timeout_s: float = 1800.0, runner=None) -> dict:
    """Run the benchmark on `spec.tp` spawned ranks; rank 0's result dict (see `_e2e_rank`).
    `runner` replaces `tpfuse.spawn.run_ranks` (same signature; the CLI's adds its warning format)."""
    from tpfuse.spawn import run_ranks

    device = resolve_device(spec)
    spec.config().check_world_size(spec.tp)
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < spec.tp:
            raise RuntimeError(f"bench e2e: --tp {spec.tp} needs {spec.tp} GPUs, "
                               f"torch sees {torch.cuda.device_count()}")
    backend = "nccl" if device == "cuda" else "gloo"
    return (runner or run_ranks)(_e2e_rank, spec.tp, backend=backend, args=(spec,), timeout_s=timeout_s)[0]


def e2e_rows(spec: E2ESpec, result: dict) -> list[ResultRow]:
    """One result row per (fusion, batch) point: samples are decode-step microseconds."""
    cfg = result["config"]
    rows = []
    for p in result["points"]:
        shape = {"preset": spec.preset, "layers": cfg["num_layers"], "dense_layers": cfg["first_dense_layers"],
                 "experts": cfg["num_experts"], "top_k": cfg["top_k"], "hidden": cfg["hidden"], "batch": p["batch"],
                 "prompt_len": spec.prompt_len, "context": spec.context}
        extra = {k: p[k] for k in ("fusion", "tok_per_s", "j_per_token", "energy_j", "energy_note",
                                   "allreduces_per_step", "expected_allreduces_per_step", "moe_runner",
                                   "moe_runner_why", "prefill_ms", "cuda_graphs", "steps", "strategy_source")}
        extra.update(device=result["device"], notes=result["notes"])
        rows.append(make_row("e2e_decode_step", p["strategy"], shape, result["dtype"], result["world_size"],
                             p["step_us"], "us", **extra))
    return rows


__all__ = ["E2ESpec", "run_e2e", "e2e_rows", "build_model", "DecodeStep", "EnergyMeter"]
