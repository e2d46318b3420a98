"""MoE runners: who multiplies the routed tokens by this rank's experts.

Chosen the way collectives are, in the strategies' words: each runner declares its `needs`,
`admits` a problem with a `Verdict` (and its reason), `admission` gives every runner's verdict, and
`choose` picks by measurement (which admitted runner is fastest on the model's expert shapes at
this token count?), returning the name, its source and a reason. Nothing is decided from an
architecture name. The needs are `RunnerNeeds`, not `spec.Needs`, and the problem `RunnerProblem`,
not `spec.Problem`, because a runner is a local GEMM schedule inside one rank: it needs facts about
this device, dtype and capture mode (a torch op, no host sync, a probe call that matches the
reference), none of the process-group facts (NCCL, peer access, hosts) a collective needs.

Runners (all compute `moe_experts_ref` up to rounding; outputs are partial sums, accumulated in
tpfuse.reference.accumulation_dtype (fp32; float64 for float64 models), over the rank's local
experts, weighted by the routing weights):
- `loop`: per-expert gather / SwiGLU / scatter over the tokens routed to it. Reads the per-expert
  token counts on the host (one sync per call), so it cannot be captured in a CUDA graph.
- `dense`: every local expert on every token, weighted by a dense (T, E) combine matrix. No host
  sync, so capturable; reads every local expert's weights whatever the routing.
- `grouped_mm`: tokens sorted by expert, two `torch._grouped_mm` calls with device-side group
  offsets. Admitted only where torch has the op and a probe call on this device and dtype matches
  the reference; when the model captures CUDA graphs, the probe call is itself captured and
  replayed (torch falls back to a host-synchronising path for some dtypes).

Shape legend: T tokens, K top-k, H hidden, I expert width, E local experts.
Weights: w13 (E, 2I, H) = [gate; up] per expert, w2 (E, H, I), like nn.Linear weights.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tpfuse.reference import accumulation_dtype
from tpfuse.spec import Verdict
from tpfuse.timing import capture, time_calls

if TYPE_CHECKING:
    from tpfuse.probe.capabilities import Capabilities

ALL_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class RunnerProblem:
    """What a runner is asked to do: device, dtype, expert shapes, and whether steps are graph-captured."""

    device_type: str
    dtype: str
    hidden: int
    expert_inter: int
    num_local_experts: int
    capture: bool


@dataclass(frozen=True)
class RunnerNeeds:
    """What a runner needs; checked against the problem and probed facts, never an architecture."""

    cuda: bool = False
    torch_op: str | None = None  # an attribute of `torch` that must exist
    dtypes: tuple[str, ...] = ALL_DTYPES
    host_sync: bool = False  # True: reads device values on the host, so not CUDA-graph capturable
    probe_call: bool = False  # True: admission also runs a small call and compares with the reference


@dataclass(frozen=True)
class RunnerChoice:
    """The chosen runner, like `dispatch.Choice`: `source` is "measured", "requested" or "default"."""

    name: str
    source: str
    reason: str
    timings_us: dict


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def _local_pairs(ids_TK: torch.Tensor, first_expert: int, num_local: int):
    """Per (token, k) pair: local expert index (num_local for pairs routed to other ranks) and token index."""
    local = ids_TK.flatten() - first_expert
    key = torch.where((local >= 0) & (local < num_local), local, num_local)
    # arange // K rather than repeat_interleave: the latter sizes its output on the host (a sync).
    tokens = torch.arange(ids_TK.numel(), device=ids_TK.device) // ids_TK.shape[1]
    return key, tokens


def run_loop(x, ids, weights, w13, w2, first_expert):
    num_local = w13.shape[0]
    key, tokens = _local_pairs(ids, first_expert, num_local)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_local + 1)[:num_local].tolist()  # the host sync
    rows, w = tokens[order], weights.flatten()[order]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=accumulation_dtype(x.dtype), device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count:
            r = rows[start:start + count]
            weighted = _expert(x[r], w13[e], w2[e]).to(out.dtype) * w[start:start + count, None].to(out.dtype)
            out.index_add_(0, r, weighted)
            start += count
    return out


def run_dense(x, ids, weights, w13, w2, first_expert):
    num_local = w13.shape[0]
    key, _ = _local_pairs(ids, first_expert, num_local)
    key = key.view(ids.shape)
    combine = torch.zeros(x.shape[0], num_local + 1, dtype=accumulation_dtype(x.dtype), device=x.device)
    combine.scatter_add_(1, key, weights.to(combine.dtype))
    out = torch.zeros(x.shape[0], x.shape[1], dtype=accumulation_dtype(x.dtype), device=x.device)
    for e in range(num_local):
        out += _expert(x, w13[e], w2[e]).to(out.dtype) * combine[:, e:e + 1]
    return out


def run_grouped_mm(x, ids, weights, w13, w2, first_expert):
    num_local = w13.shape[0]
    key, tokens = _local_pairs(ids, first_expert, num_local)
    order = torch.argsort(key, stable=True)
    # Counts by scatter_add, not bincount: CUDA bincount sizes its output on the host (a sync).
    counts = torch.zeros(num_local + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts[:num_local], dim=0, dtype=torch.int32)
    rows, key_sorted = tokens[order], key[order]
    h = torch._grouped_mm(x[rows], w13.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm((F.silu(gate) * up).contiguous(), w2.transpose(1, 2), offs=offs)
    # Rows past offs[-1] (pairs owned by other ranks) are never written by _grouped_mm: mask, don't multiply.
    out = torch.zeros(x.shape[0], x.shape[1], dtype=accumulation_dtype(x.dtype), device=x.device)
    contrib = torch.where((key_sorted < num_local)[:, None],
                          y.to(out.dtype) * weights.flatten()[order, None].to(out.dtype), 0.0)
    out.index_add_(0, rows, contrib)
    return out


def moe_experts_ref(x, ids, weights, w13, w2, first_expert) -> torch.Tensor:
    """The meaning of every runner, token by token in float64: sum_k w_k * expert_{id_k}(x) over local ids."""
    x64, w13_64, w2_64 = x.double().cpu(), w13.double().cpu(), w2.double().cpu()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k]) - first_expert
            if 0 <= e < w13.shape[0]:
                out[t] += float(weights[t, k]) * _expert(x64[t:t + 1], w13_64[e], w2_64[e])[0]
    return out


@dataclass(frozen=True)
class MoERunner:
    name: str
    description: str
    needs: RunnerNeeds
    fn: Callable

    def __call__(self, x, ids, weights, w13, w2, first_expert):
        return self.fn(x, ids, weights, w13, w2, first_expert)

    def admits(self, problem: RunnerProblem, caps: Capabilities | None = None, *, device=None) -> Verdict:
        """May this runner run `problem` here? Its declared needs, then (if declared) a probe call."""
        verdict = check_runner_needs(self.needs, problem, caps)
        if verdict.ok and self.needs.probe_call:
            return _probe_call(self, problem, device if device is not None else problem.device_type)
        return verdict


RUNNERS: dict[str, MoERunner] = {
    r.name: r
    for r in (
        MoERunner("loop", "per-expert gather, SwiGLU, scatter (host reads token counts)",
                  RunnerNeeds(host_sync=True), run_loop),
        MoERunner("dense", "every local expert on every token, dense combine weights",
                  RunnerNeeds(), run_dense),
        MoERunner("grouped_mm", "tokens sorted by expert, torch._grouped_mm with device offsets",
                  RunnerNeeds(torch_op="_grouped_mm", probe_call=True), run_grouped_mm),
    )
}

# Used only when nothing was measured (runner_report without timings); the model always measures.
DEFAULT_ORDER = ("grouped_mm", "loop", "dense")

# Norm-wise relative error a probe call may have against the float64 reference: two GEMM roundings
# to the dtype plus the SwiGLU product, a few units of roundoff (bf16 u = 2^-9, fp16 2^-12).
_PROBE_TOLERANCE = {"bfloat16": 3e-2, "float16": 4e-3, "float32": 1e-4, "float64": 1e-10}
_probe_cache: dict[tuple, Verdict] = {}


def _probe_call(runner: MoERunner, problem: RunnerProblem, device) -> Verdict:
    key = (runner.name, problem.device_type, str(device), problem.dtype, problem.hidden, problem.expert_inter,
           problem.capture)
    if key in _probe_cache:
        return _probe_cache[key]
    dtype = getattr(torch, problem.dtype)
    gen = torch.Generator().manual_seed(1234)
    h, i = problem.hidden, problem.expert_inter
    x = torch.randn(6, h, generator=gen)
    w13 = torch.randn(3, 2 * i, h, generator=gen) * h**-0.5
    w2 = torch.randn(3, h, i, generator=gen) * i**-0.5
    ids = torch.tensor([[0, 2], [2, 5], [0, 2], [5, 0], [2, 0], [0, 5]])  # expert 1 gets no tokens
    weights = torch.rand(6, 2, generator=gen) + 0.5
    args = [t.to(device) for t in (x.to(dtype), ids, weights, w13.to(dtype), w2.to(dtype))]
    capture = problem.capture and args[0].device.type == "cuda"
    try:
        out = _captured_call(runner, args) if capture else runner(*args, 0)
        if args[0].device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # the probe exists to turn "cannot run here" into a reason
        how = "captured in a CUDA graph" if capture else "probe call"
        verdict = Verdict.no(f"{how} failed on {problem.device_type} {problem.dtype}: "
                             f"{type(exc).__name__}: {str(exc)[:160]}")
    else:
        ref = moe_experts_ref(*[t.cpu() for t in args], 0)
        err = float((out.double().cpu() - ref).norm() / ref.norm())
        tol = _PROBE_TOLERANCE[problem.dtype]
        verdict = (Verdict.yes(f"probe call matches the reference (rel. error {err:.1e} <= {tol:.0e})") if err <= tol
                   else Verdict.no(f"probe call disagrees with the reference: rel. error {err:.1e} > {tol:.0e}"))
    _probe_cache[key] = verdict
    return verdict


def _captured_call(runner: MoERunner, args: list) -> torch.Tensor:
    """The runner's output from a CUDA-graph replay (warm-up on a side stream, as capture requires).

    Capturability is a property of the op on this torch, device and dtype (torch._grouped_mm, for
    one, falls back to a host-synchronising path for some dtypes), so it is tried, not assumed."""
    outs = []
    graph = capture([lambda: outs.append(runner(*args, 0))], warmup=1)
    out = outs[-1]  # the captured call's output (the warm-up's comes first)
    out.fill_(float("nan"))  # poisoned: the replay must write every element again
    graph.replay()
    return out


def check_runner_needs(needs: RunnerNeeds, problem: RunnerProblem, caps: Capabilities | None = None) -> Verdict:
    """Check declared needs against the problem and the probed capabilities (`check_needs` for runners)."""
    if problem.dtype not in needs.dtypes:
        return Verdict.no(f"dtype {problem.dtype} not supported (supports {', '.join(needs.dtypes)})")
    if needs.cuda and problem.device_type != "cuda":
        return Verdict.no(f"needs CUDA tensors; the model runs on {problem.device_type}")
    if problem.device_type == "cuda" and caps is not None and not caps.has_gpu:
        return Verdict.no("the model runs on CUDA but the probe found no GPU")
    if problem.capture and needs.host_sync:
        return Verdict.no("reads per-expert token counts on the host (a sync), "
                          "so it cannot be captured in a CUDA graph")
    if needs.torch_op is not None and not hasattr(torch, needs.torch_op):
        return Verdict.no(f"torch {torch.__version__} has no torch.{needs.torch_op}")
    return Verdict.yes("all needs met")


def admission(problem: RunnerProblem, caps=None, *, device=None) -> dict[str, Verdict]:
    """Verdict of every runner for `problem` (`strategies.admission` for runners)."""
    return {name: r.admits(problem, caps, device=device) for name, r in RUNNERS.items()}


def time_runner(runner: MoERunner, args: tuple, *, reps: int = 5, give_up_us: float | None = None) -> float:
    """Median microseconds of `reps` calls after one timed warm-up (`tpfuse.timing.time_calls`:
    CUDA events on GPU, perf_counter on CPU).

    With `give_up_us`, a runner whose warm-up call already takes longer returns that time at once:
    it has lost, and timing it further (say the dense runner at prefill sizes) only costs time."""
    device = args[0].device

    def call():
        return runner(*args)

    (first,) = time_calls(call, reps=1, warmup=0, device=device)
    if give_up_us is not None and first > give_up_us:
        return first
    return statistics.median(time_calls(call, reps=reps, warmup=0, device=device))


def choose(verdicts: dict[str, Verdict], timings_us: dict[str, float]) -> RunnerChoice:
    """The fastest admitted runner by `timings_us` (ValueError listing every reason if none is admitted)."""
    admitted = [n for n, v in verdicts.items() if v.ok and n in timings_us]
    if not admitted:
        reasons = "; ".join(f"{n}: {v.reason}" for n, v in verdicts.items())
        raise ValueError(f"choose: no MoE runner is admitted ({reasons}); "
                         "run eagerly (no CUDA graphs) or use another dtype")
    best = min(admitted, key=lambda n: timings_us[n])
    others = ", ".join(f"{n} {timings_us[n]:.0f} us" for n in admitted if n != best)
    reason = (f"measured fastest: {timings_us[best]:.0f} us"
              + (f" (vs {others})" if others else " (only admitted runner)"))
    return RunnerChoice(best, "measured", reason, dict(timings_us))


def runner_report(caps: Capabilities, *, dtype: str = "bfloat16", device_type: str | None = None,
                  capture: bool | None = None, hidden: int = 6144, expert_inter: int = 2048,
                  timings_us: dict[str, float] | None = None) -> list[dict]:
    """One row per runner: name, admitted, reason, chosen, why. For `tpfuse doctor` and the bench.

    Defaults describe GLM-5's expert shapes (hidden 6144, width 2048) on this machine's device,
    graph-captured on CUDA. Without `timings_us` the choice is the unmeasured DEFAULT_ORDER, and
    `why` says so; the model itself always measures.
    """
    device_type = device_type or ("cuda" if caps.has_gpu else "cpu")
    capture = (device_type == "cuda") if capture is None else capture
    problem = RunnerProblem(device_type, dtype, hidden, expert_inter, 1, capture)
    verdicts = admission(problem, caps)
    if timings_us:
        choice = choose(verdicts, timings_us)
    else:
        first = next((n for n in DEFAULT_ORDER if verdicts[n].ok), None)
        choice = RunnerChoice(first or "", "default",
                              "default order (not measured here; the model measures at prepare)", {})
    return [
        {"name": name, "admitted": v.ok, "reason": v.reason, "chosen": name == choice.name,
         "why": choice.reason if name == choice.name else ""}
        for name, v in verdicts.items()
    ]
