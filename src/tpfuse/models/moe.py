"""Feed-forward blocks: the dense SwiGLU MLP and the top-k routed MoE, both tensor-parallel.

Each returns this rank's partial sum of the block output (accumulated in fp32, or float64 for a
float64 model, and rounded once to the model dtype); the decoder reduces it with the Communicator.

MoE sharding: the router is replicated (every rank routes identically: same weights, same input
bits after the allreduce); routed experts are split across ranks by index (rank r owns experts
r*E/W .. (r+1)*E/W-1, whole); shared experts are width-sharded like the dense MLP. Routing is
sigmoid scores, top-k, weights renormalised to sum to 1 (GLM-5 / DeepSeek-V3 score with a sigmoid;
their bias correction and routed scaling factor are left out).

`RunnerSelector` picks the MoE runner per token count by measurement (see moe_runners), once,
identically on every rank, and before any CUDA-graph capture (`prepare`).

Shape legend: T tokens, H hidden, K top-k, E experts (local: this rank's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tpfuse.models import moe_runners
from tpfuse.models.config import ModelConfig
from tpfuse.models.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, random_tensor
from tpfuse.reference import accumulation_dtype
from tpfuse.timing import max_over_ranks


class DenseMLP(nn.Module):
    """SwiGLU MLP, gate/up column-parallel, down row-parallel (partial sums)."""

    def __init__(self, hidden: int, inter: int, *, prefix: str, rank: int, world_size: int, seed: int, layer: int,
                 dtype, device) -> None:
        super().__init__()
        self.gate_up = ColumnParallelLinear(hidden, {f"{prefix}.gate": inter, f"{prefix}.up": inter}, rank=rank,
                                            world_size=world_size, seed=seed, layer=layer, dtype=dtype, device=device)
        self.down = RowParallelLinear(inter, hidden, rank=rank, world_size=world_size, seed=seed, layer=layer,
                                      name=f"{prefix}.down", dtype=dtype, device=device)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x_TH).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class RunnerSelector:
    """Admission + measured choice of the MoE runner, per token count, shared by all MoE layers."""

    def __init__(self, problem: moe_runners.RunnerProblem, *, group, caps=None, device=None, only: str | None = None):
        self.problem, self.group, self.caps, self.device = problem, group, caps, device
        self.verdicts = moe_runners.admission(problem, caps, device=device)
        if only is not None:
            if only not in self.verdicts:
                raise ValueError(f"RunnerSelector: unknown MoE runner {only!r}; "
                                 f"choose one of {', '.join(self.verdicts)}")
            if not self.verdicts[only].ok:
                raise ValueError(f"RunnerSelector: MoE runner {only!r} is not admitted here: "
                                 f"{self.verdicts[only].reason}")
        self.only = only
        self.choices: dict[int, moe_runners.RunnerChoice] = {}

    def prepare(self, num_tokens: int, block: MoE) -> moe_runners.RunnerChoice:
        """Choose for `num_tokens` by timing every admitted runner on `block`'s weights (a collective)."""
        if num_tokens in self.choices:
            return self.choices[num_tokens]
        names = [self.only] if self.only else [n for n, v in self.verdicts.items() if v.ok]
        x = torch.randn(num_tokens, block.hidden, generator=torch.Generator().manual_seed(num_tokens)).to(block.w13)
        ids, weights = block.route(x)
        args = (x, ids, weights, block.w13, block.w2, block.first_expert)
        # Time the usual winner first, so a clearly slower runner stops after one call (give_up_us).
        mine, best = {}, float("inf")
        for n in sorted(self.verdicts, key=lambda n: moe_runners.DEFAULT_ORDER.index(n)):
            mine[n] = (moe_runners.time_runner(moe_runners.RUNNERS[n], args, give_up_us=4 * best)
                       if n in names else float("inf"))
            best = min(best, mine[n])
        slowest = [mine[n] for n in self.verdicts]
        if dist.get_world_size(self.group) > 1:
            # Every rank must pick the same runner: take each runner's slowest rank, then the minimum.
            (slowest,) = max_over_ranks([slowest], self.group, torch.device(self.device or "cpu"))
        timings = {n: float(t) for n, t in zip(self.verdicts, slowest) if n in names}
        choice = moe_runners.choose({n: self.verdicts[n] for n in names}, timings)
        if self.only:
            choice = moe_runners.RunnerChoice(choice.name, "requested", f"requested (--moe-runner); {choice.reason}",
                                              choice.timings_us)
        self.choices[num_tokens] = choice
        return choice

    def runner_for(self, num_tokens: int, block: MoE) -> moe_runners.MoERunner:
        choice = self.choices.get(num_tokens)
        if choice is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"RunnerSelector: no MoE runner chosen for {num_tokens} tokens "
                                   "before graph capture; call model.prepare(batch) first")
            choice = self.prepare(num_tokens, block)
        return moe_runners.RUNNERS[choice.name]

    def report(self) -> list[dict]:
        return [{"name": n, "admitted": v.ok, "reason": v.reason} for n, v in self.verdicts.items()]


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, selector: RunnerSelector, rank: int, world_size: int,
                 seed: int, dtype, device) -> None:
        super().__init__()
        self.hidden, self.top_k, self.selector = cfg.hidden, cfg.top_k, selector
        num_local = cfg.num_experts // world_size
        self.first_expert = rank * num_local
        self.router = ReplicatedLinear(cfg.hidden, cfg.num_experts, seed=seed, layer=layer, name="router",
                                       dtype=dtype, device=device)
        # Filled expert by expert (one generator call per matrix, so each rank draws only the
        # experts it owns) into preallocated stacks: no transient second copy of the weights.
        i, h = cfg.expert_inter, cfg.hidden
        w13 = torch.empty(num_local, 2 * i, h, dtype=dtype, device=device)
        w2 = torch.empty(num_local, h, i, dtype=dtype, device=device)

        def draw(expert: int, name: str, shape: tuple[int, int], fan_in: int) -> torch.Tensor:
            return random_tensor(shape, seed=seed, layer=layer, name=f"experts.{expert}.{name}", std=fan_in**-0.5,
                                 dtype=dtype, device=device)

        for local, e in enumerate(range(self.first_expert, self.first_expert + num_local)):
            w13[local, :i] = draw(e, "gate", (i, h), h)
            w13[local, i:] = draw(e, "up", (i, h), h)
            w2[local] = draw(e, "down", (h, i), i)
        self.w13 = nn.Parameter(w13, requires_grad=False)  # (E_local, 2I, H)
        self.w2 = nn.Parameter(w2, requires_grad=False)  # (E_local, H, I)
        self.shared = None
        if cfg.num_shared_experts:
            self.shared = DenseMLP(cfg.hidden, cfg.expert_inter * cfg.num_shared_experts, prefix="shared", rank=rank,
                                   world_size=world_size, seed=seed, layer=layer, dtype=dtype, device=device)

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids (T, K), weights (T, K) in the accumulation dtype, summing to 1 per token)."""
        acc = accumulation_dtype(x_TH.dtype)
        scores = torch.sigmoid(F.linear(x_TH.to(acc), self.router.weight.to(acc)))
        weights, ids = scores.topk(self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x_TH)
        runner = self.selector.runner_for(x_TH.shape[0], self)
        with torch.profiler.record_function("tpfuse::moe_experts"):
            out = runner(x_TH, ids, weights, self.w13, self.w2, self.first_expert)
        if self.shared is not None:
            out = out + self.shared(x_TH).to(out.dtype)
        return out.to(x_TH.dtype)


__all__ = ["DenseMLP", "MoE", "RunnerSelector"]
