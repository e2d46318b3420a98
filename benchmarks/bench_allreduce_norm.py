"""Allreduce + residual-add + RMSNorm over N ranks: every admitted tpfuse strategy against the
unfused and third-party baselines, per hidden size and token bucket, in one run.

    python benchmarks/bench_allreduce_norm.py                       # one NCCL rank per GPU (up to 8)
    python benchmarks/bench_allreduce_norm.py --peer-gbps 370 --plot sweep.png   # with the floor
    python benchmarks/bench_allreduce_norm.py --device cpu --out /tmp/sweep.jsonl # 2 gloo CPU ranks, tiny sizes
    python benchmarks/bench_allreduce_norm.py --shared-gpu --out /tmp/sweep.jsonl # 2 ranks on GPU 0

The rank flags (`--world-size`, `--device`, `--shared-gpu`) are those of `tpfuse tune`, resolved
by the same rule (`tpfuse.cli.ranks.resolve_ranks`).

Providers: `tpfuse/<strategy>` for every strategy the registry admits for the problem (one not
admitted is listed with its admission reason). The unfused baselines are the package's own
strategies under their names: `tpfuse/nccl_eager` (NCCL all_reduce, then add + RMSNorm in eager
torch), `tpfuse/nccl_epilogue` (NCCL, then the epilogue kernel) and `tpfuse/reference`.
Third-party baselines: `symm_mem_{oneshot,twoshot}+epilogue` (PyTorch symmetric-memory
all_reduce, then tpfuse's epilogue kernel) and `flashinfer_trtllm` (trtllm_allreduce_fusion),
where they set up and run; otherwise the reason is recorded. Never multicast: every rank runs with NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1.

Method, per (hidden, tokens): (1) correctness first (`tpfuse.correctness`'s exact case:
rank-tagged small-integer inputs, outputs poisoned with NaN): tpfuse strategies must equal
`reference.all_reduce_residual_rmsnorm_ref` bit for bit, other providers too or else stay within
`reference.TOLERANCE` of the float64 reference (the row's `check` says which); a provider failing
on any rank is timed on none. (2) each passing call is captured in a CUDA graph
(`tpfuse.timing.capture`), replayed `--reps` times per sample. (3)
`tpfuse.timing.time_interleaved`: providers visited in an order rotated every round, device
sync and a barrier before each sample, CUDA events around it, each sample the maximum over ranks
(a collective ends when its slowest rank does); median, p20, p80 in us per call. `--device cpu`
times eager calls with perf_counter, `--shared-gpu` eager calls with CUDA events (gloo cannot be
captured), rows marked functional only. Ratios are median / the ratio baseline's median (below 1
is faster): `tpfuse/nccl_eager`, or `tpfuse/reference` where nccl_eager is not timed (gloo
runs); the row's `ratio_baseline` names it. `--peer-gbps B` (`tpfuse doctor --measure`) adds
the floor 2.5 us + 2(W-1)/W x T x H x itemsize / B and each provider's ratio to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings

OP = "all_reduce_residual_rmsnorm"
# The unfused path ratios are taken against: the first of these timed in a bucket.
RATIO_BASELINES = ("tpfuse/nccl_eager", "tpfuse/reference")
RANK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FLOOR_LATENCY_US = 2.5  # one peer round trip plus a kernel launch: the floor's fixed term, as specified
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """What every rank sweeps. mode: "nccl" (one GPU per rank), "cpu-smoke" or "shared-gpu"."""

    mode: str
    device: str  # "cpu" or "cuda"
    hiddens: tuple[int, ...]
    buckets: tuple[int, ...]
    dtype: str
    trials: int
    reps: int
    warmup: int


def floor_us(tokens: int, hidden: int, itemsize: int, world_size: int, peer_gbps: float) -> float:
    """The bandwidth floor of one allreduce: fixed latency plus 2(W-1)/W of the bytes over a peer link."""
    return FLOOR_LATENCY_US + 2 * (world_size - 1) / world_size * tokens * hidden * itemsize / (peer_gbps * 1e3)


def tpfuse_factory(comm):
    """A factory of calls through the public API, on the Communicator bound to one strategy."""
    def factory(x, residual, weight):
        return lambda: comm.all_reduce_residual_rmsnorm(x, residual, weight, EPS)
    return factory


def symm_mem_factories(group, hidden: int, dtype, max_tokens: int, eps: float, device) -> dict:
    """{name: factory}: one-shot and two-shot symmetric-memory all_reduce, then tpfuse's epilogue.

    Collective (rendezvous); raises where symmetric memory cannot be set up. The input is copied
    into one symmetric buffer per call, as engines do, and reduced there.
    """
    import torch
    import torch.distributed._symmetric_memory as symm_mem

    from tpfuse.kernels.epilogue import residual_rmsnorm

    name = group.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required before torch 2.9, deprecated since
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(name)
    buf = symm_mem.empty(max_tokens * hidden, dtype=dtype, device=device)
    symm_mem.rendezvous(buf, name)

    def make(op):
        def factory(x, residual, weight):
            view = buf[: x.numel()]
            def call():
                view.copy_(x.view(-1))
                s = op(view, "sum", name)  # two_shot_all_reduce_ works in place and returns `view`
                return residual_rmsnorm(s.view(x.shape), residual, weight, eps)
            return call
        return factory
    return {"symm_mem_oneshot+epilogue": make(torch.ops.symm_mem.one_shot_all_reduce),
            "symm_mem_twoshot+epilogue": make(torch.ops.symm_mem.two_shot_all_reduce_)}


def flashinfer_factory(group, rank: int, world_size: int, hidden: int, max_tokens: int, eps: float):
    """(factory, cleanup) for FlashInfer's trtllm_allreduce_fusion, residual + RMSNorm pattern."""
    import flashinfer.comm as fc
    import torch

    handles, workspace = fc.trtllm_create_ipc_workspace_for_all_reduce_fusion(rank, world_size, max_tokens, hidden, group=group)

    def factory(x, residual, weight):
        normed, new_res = torch.empty_like(x), torch.empty_like(x)
        def call():
            fc.trtllm_allreduce_fusion(
                allreduce_in=x, world_size=world_size, world_rank=rank, token_num=x.shape[0], hidden_dim=hidden,
                workspace_ptrs=workspace, launch_with_pdl=False, trigger_completion_at_end=True, fp32_acc=True,
                pattern_code=fc.AllReduceFusionPattern.kARResidualRMSNorm, use_oneshot=None, allreduce_out=None,
                residual_in=residual, residual_out=new_res, norm_out=normed, quant_out=None, scale_out=None,
                rms_gamma=weight, rms_eps=eps, scale_factor=None, layout_code=None)
            return normed, new_res
        return call
    return factory, lambda: fc.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(handles, group)


class CheckFailed(Exception):
    """A provider computed a wrong answer (as opposed to raising on its own)."""


def attempt(fn, group, world_size: int, what: str):
    """Collective: (fn(), "") when fn succeeds on every rank, else (None, reasons by rank) on all.

    Every rank must reach the same verdict: a rank that goes on into a collective its peers skip hangs.
    """
    import torch.distributed as dist

    try:
        value, why = fn(), ""
    except Exception as exc:  # a failure is a recorded reason; the sweep goes on
        detail = str(exc)[:300] if isinstance(exc, CheckFailed) else f"{type(exc).__name__}: {str(exc)[:200]}"
        value, why = None, f"{what}: {detail}"
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, why, group=group)
    reasons = "; ".join(f"rank {r}: {w}" for r, w in enumerate(everyone) if w)
    return (None, reasons) if reasons else (value, "")


def third_party(spec: SweepSpec, group, rank: int, world_size: int, hidden: int, device):
    """Collective: ({name: factory}, {name: why not run}, cleanups) of the symmetric-memory and FlashInfer baselines."""
    import torch

    names = ("symm_mem_oneshot+epilogue", "symm_mem_twoshot+epilogue", "flashinfer_trtllm")
    if spec.mode != "nccl":
        return {}, {n: f"needs one GPU per rank over NCCL; this is the {spec.mode} run" for n in names}, []
    dtype, max_tokens = getattr(torch, spec.dtype), max(spec.buckets)
    made, why = attempt(lambda: symm_mem_factories(group, hidden, dtype, max_tokens, EPS, device), group, world_size,
                        "symmetric memory setup failed")
    factories, notes = dict(made or {}), {n: why for n in names[:2] if why}
    # flashinfer is imported inside the attempt: "not importable" is recorded like any set-up failure.
    made, why = attempt(lambda: flashinfer_factory(group, rank, world_size, hidden, max_tokens, EPS), group, world_size,
                        "flashinfer not available or its workspace set-up failed")
    if why:
        notes[names[2]] = why
        return factories, notes, []
    factories[names[2]] = made[0]
    return factories, notes, [made[1]]


def check_provider(factory, case, ctx, *, exact_only: bool) -> str:
    """The check note of one provider (`tpfuse.correctness.run_case` on poisoned outputs);
    CheckFailed when wrong."""
    from tpfuse.correctness import run_case

    group, rank, world_size, device = ctx
    check = run_case(lambda x, residual, weight: factory(x, residual, weight)(), case, rank=rank,
                     world_size=world_size, device=device, tolerance_fallback=not exact_only)
    if not check.passed:
        raise CheckFailed(check.reason)
    return check.reason


def graph_replays(call, reps: int):
    """A no-argument function replaying a CUDA graph of `call` `reps` times (`tpfuse.timing.capture`,
    after two calls outside capture: JIT, NCCL and workspace set-up)."""
    from tpfuse.timing import capture

    graph = capture([call], warmup=2)
    return lambda: [graph.replay() for _ in range(reps)]


def sweep_bucket(spec, ctx, hidden: int, tokens: int, factories: dict, not_timed: dict) -> dict:
    """Collective: check then time every provider at (hidden, tokens); this rank's view of the result."""
    import torch

    from tpfuse.correctness import Case
    from tpfuse.reference import random_inputs
    from tpfuse.timing import time_interleaved

    group, rank, world_size, device = ctx
    dtype = getattr(torch, spec.dtype)
    case = Case("exact", OP, tokens, hidden, spec.dtype)
    not_timed, checks, calls = dict(not_timed), {}, {}
    for name, factory in factories.items():
        run_check = lambda: check_provider(factory, case, ctx, exact_only=name.startswith("tpfuse/"))  # noqa: E731
        checks[name], why = attempt(run_check, group, world_size, "failed the correctness check")
        if why:
            not_timed[name] = why
            del checks[name]
    x = random_inputs(rank, tokens, hidden, dtype, seed=21, device=device)
    res = random_inputs(10_000, tokens, hidden, dtype, seed=22, device=device)
    w = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(23))).to(dtype).to(device)
    graphs = spec.mode == "nccl"  # gloo collectives (CPU smoke, shared GPU) cannot be captured: eager calls
    for name in list(checks):
        call = factories[name](x, res, w)
        if not graphs:
            calls[name] = call
            continue
        calls[name], why = attempt(lambda: graph_replays(call, spec.reps), group, world_size, "CUDA graph capture failed")
        if why:
            not_timed[name] = why
            del checks[name], calls[name]
    per_call = spec.reps if graphs else 1
    samples = {}
    if calls:
        raw = time_interleaved(calls, group=group, device=torch.device(device), rounds=spec.trials, warmup=spec.warmup)
        samples = {name: [t / per_call for t in s] for name, s in raw.items()}
    return {"hidden": hidden, "tokens": tokens, "samples": samples, "checks": checks, "not_timed": not_timed}


def rank_main(rank: int, world_size: int, spec: SweepSpec):
    """One rank of the sweep (collective over WORLD); rank 0 returns the list of bucket results."""
    import torch
    import torch.distributed as dist

    from tpfuse import Communicator
    from tpfuse.rank_setup import share_cpu_threads
    from tpfuse.spec import Op, Problem
    from tpfuse.strategies import admission, strategy_names

    share_cpu_threads(world_size, spec.device)
    group = dist.group.WORLD
    base = Communicator(group, strategy="reference", device=spec.device)
    device = base.device
    ctx = (group, rank, world_size, device)
    comms, results = {}, []

    def setup(name: str, hidden: int, max_tokens: int):
        """This strategy's Communicator (one per strategy for the whole run), prepared for `hidden`."""
        if name not in comms:
            comms[name] = Communicator(group, strategy=name, device=spec.device)
        comms[name].prepare(hidden=hidden, dtype=getattr(torch, spec.dtype), max_tokens=max_tokens)
        return comms[name]

    try:
        for hidden in spec.hiddens:
            verdicts = {t: admission(Problem(Op.ALL_REDUCE_RESIDUAL_RMSNORM, t, hidden, spec.dtype, base.facts), base.caps)
                        for t in spec.buckets}
            ready = {}
            for name in strategy_names():  # same order on every rank: construction and prepare are collective
                admitted = [t for t in spec.buckets if verdicts[t][name].ok]
                if admitted:
                    ready[name] = attempt(lambda: setup(name, hidden, max(admitted)), group, world_size, "set-up failed")
            extra, extra_notes, cleanups = third_party(spec, group, rank, world_size, hidden, device)
            for tokens in spec.buckets:
                factories, not_timed = {}, dict(extra_notes)
                for name, verdict in verdicts[tokens].items():
                    provider = f"tpfuse/{name}"
                    if not verdict.ok:
                        not_timed[provider] = f"not admitted: {verdict.reason}"
                    elif ready[name][1]:
                        not_timed[provider] = ready[name][1]
                    else:
                        factories[provider] = tpfuse_factory(ready[name][0])
                factories.update(extra)
                results.append(sweep_bucket(spec, ctx, hidden, tokens, factories, not_timed))
                for comm in comms.values():
                    comm.check()  # a device-side failure during graph replays surfaces here
            for cleanup in cleanups:
                cleanup()
    finally:
        for comm in comms.values():
            comm.close()
        base.close()
    return results if rank == 0 else None


def build_rows(results: list[dict], spec: SweepSpec, world_size: int, peer_gbps: float | None) -> list:
    """Result rows (tpfuse.results) of every timed provider, with ratios and the floor."""
    from tpfuse.results import make_row
    from tpfuse.spec import DTYPE_BYTES

    timing = {"nccl": f"CUDA graph replayed {spec.reps}x per sample, CUDA events", "cpu-smoke": "eager, perf_counter",
              "shared-gpu": "eager, CUDA events"}[spec.mode]
    rows = []
    for b in results:
        shape = {"tokens": b["tokens"], "hidden": b["hidden"]}
        made = {name: make_row(OP, name, shape, spec.dtype, world_size, s, "us") for name, s in b["samples"].items()}
        baseline = next((n for n in RATIO_BASELINES if n in made), None)
        base_us = made[baseline].median if baseline else None
        floor = floor_us(b["tokens"], b["hidden"], DTYPE_BYTES[spec.dtype], world_size, peer_gbps) if peer_gbps else None
        for name, row in made.items():
            row.extra.update(mode=spec.mode, functional_only=spec.mode != "nccl", timing=timing, max_over_ranks=True,
                             check=b["checks"][name], ratio_baseline=baseline,
                             ratio_vs_baseline=row.median / base_us if base_us else None, not_timed=b["not_timed"])
            if floor is not None:
                row.extra.update(floor_us=floor, peer_gbps=peer_gbps, ratio_vs_floor=row.median / floor)
            rows.append(row)
    return rows


def print_table(rows: list, results: list[dict]) -> None:
    """Per (hidden, tokens): each provider's median us and its ratio to the ratio baseline (and the floor)."""
    providers = list(dict.fromkeys(r.strategy for r in rows))
    has_floor = any("floor_us" in r.extra for r in rows)
    width = max([14] + [len(p) for p in providers])
    print(f"\n{'hidden':>6} {'tokens':>6}" + (f" {'floor us':>9}" if has_floor else "") +
          "".join(f" | {p:>{width}}" for p in providers))
    cells = {(r.shape["hidden"], r.shape["tokens"], r.strategy): r for r in rows}
    floors = {(r.shape["hidden"], r.shape["tokens"]): r.extra.get("floor_us") for r in rows}
    for b in results:
        key = (b["hidden"], b["tokens"])
        line = f"{key[0]:>6} {key[1]:>6}" + (f" {floors.get(key) or float('nan'):>9.2f}" if has_floor else "")
        for p in providers:
            r, cell = cells.get(key + (p,)), "-"
            if r:
                ratio = r.extra["ratio_vs_baseline"]
                cell = f"{r.median:.1f}" + (f" x{ratio:.2f}" if ratio else "") + (f" f{r.extra['ratio_vs_floor']:.1f}" if has_floor else "")
            line += f" | {cell:>{width}}"
        print(line)
    baselines = ", ".join(dict.fromkeys(r.extra["ratio_baseline"] for r in rows if r.extra["ratio_baseline"])) or "none timed"
    print(f"cells: median us per call, x = ratio to {baselines}" + (", f = ratio to the floor" if has_floor else ""))
    notes: dict = {}  # (provider, reason) -> buckets, so a reason shared by every bucket prints once
    for b in results:
        for name, why in b["not_timed"].items():
            notes[(name, why)] = notes.get((name, why), 0) + 1
    for (name, why), count in notes.items():
        print(f"not timed: {name} ({count} of {len(results)} buckets): {why}")


def plot(rows: list, path: str) -> None:
    """PNG: median us vs tokens, log-log, one line per provider, one panel per hidden size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hiddens = sorted({r.shape["hidden"] for r in rows})
    fig, axes = plt.subplots(1, len(hiddens), figsize=(6 * len(hiddens), 4.5), squeeze=False)
    for ax, hidden in zip(axes[0], hiddens):
        mine = [r for r in rows if r.shape["hidden"] == hidden]
        for name in dict.fromkeys(r.strategy for r in mine):
            pts = sorted((r.shape["tokens"], r.median) for r in mine if r.strategy == name)
            ax.plot(*zip(*pts), marker="o", label=name)
        floors = sorted({(r.shape["tokens"], r.extra["floor_us"]) for r in mine if "floor_us" in r.extra})
        if floors:
            ax.plot(*zip(*floors), "k--", label="floor")
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="median us per call", title=f"hidden {hidden}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv):
    """The command line; defaults that depend on the mode stay None here."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from tpfuse.cli.args import add_rank_args

    p.add_argument("--hidden", default=None, help="comma-separated hidden sizes (default 6144,7168; 64 with --device cpu)")
    p.add_argument("--max-tokens", type=int, default=None, help="largest bucket (default 16384; 4 with --device cpu)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--trials", type=int, default=None, help="interleaved samples per provider (default 30; 5 on CPU or a shared GPU)")
    p.add_argument("--reps", type=int, default=20, help="calls per timed graph replay batch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peer-gbps", type=float, default=None, help="measured peer bandwidth, GB/s (tpfuse doctor --measure)")
    p.add_argument("--out", default="benchmarks/results/allreduce_norm.jsonl")
    p.add_argument("--plot", default=None, metavar="PNG")
    add_rank_args(p, default_timeout_s=3600.0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tpfuse.cli.exits import UsageError
    from tpfuse.cli.ranks import resolve_ranks
    from tpfuse.dispatch.table import token_buckets
    from tpfuse.results import append_rows
    from tpfuse.spawn import run_ranks

    try:
        ranks = resolve_ranks(args.world_size, args.device, shared_gpu=args.shared_gpu)
    except UsageError as exc:
        print(f"bench_allreduce_norm: {exc}", file=sys.stderr)
        return 2
    world_size = ranks.world_size
    smoke = ranks.device == "cpu"
    mode = "cpu-smoke" if smoke else "shared-gpu" if ranks.shared_gpu else "nccl"
    spec = SweepSpec(
        mode=mode, device=ranks.device, dtype=args.dtype, reps=args.reps, warmup=args.warmup,
        hiddens=tuple(int(h) for h in (args.hidden or ("64" if smoke else "6144,7168")).split(",")),
        buckets=tuple(token_buckets(args.max_tokens or (4 if smoke else 16384))),
        trials=args.trials or (5 if mode != "nccl" else 30))
    results = run_ranks(rank_main, world_size, backend=ranks.backend, args=(spec,),
                        env=RANK_ENV, timeout_s=args.timeout)[0]
    rows = build_rows(results, spec, world_size, args.peer_gbps)
    append_rows(args.out, rows)
    if args.plot:
        plot(rows, args.plot)
    print(f"{len(rows)} rows appended to {args.out} ({mode}, {world_size} ranks, {spec.dtype})")
    print_table(rows, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
