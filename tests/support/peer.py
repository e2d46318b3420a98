"""What the tests of the peer kernels and strategies share: CPU strategy contexts for spawned
interpreter ranks, NaN-poisoned outputs, the reference of a call, and W ranks emulated as W CUDA
streams in one process (`tpfuse.strategies.workspace.emulated_workspaces`) for the one-process
GPU tests. Nothing here imports Triton at module import: interpreter ranks set TRITON_INTERPRET
before their first kernel import."""

from __future__ import annotations

import torch

from support.quant_output import pack, poisoned_empty
from tpfuse.reference import (
    TOLERANCE,
    all_reduce_ref,
    all_reduce_residual_rmsnorm_ref,
    random_inputs,
    relative_error,
    small_integer_inputs,
)

INTERP = {"TRITON_INTERPRET": "1"}
GPU_ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


def nan_pair(like):
    return torch.full_like(like, float("nan")), torch.full_like(like, float("nan"))


def cpu_strategy(name, rank, world_size, **options):
    """A peer strategy of a spawned CPU rank (gloo WORLD group), bound as the Communicator binds it."""
    import torch.distributed as dist

    from tpfuse.spec import GroupFacts
    from tpfuse.strategies import get_strategy
    from tpfuse.strategies.base import StrategyContext

    facts = GroupFacts(world_size=world_size, backend="gloo", device_type="cpu", devices=("cpu",) * world_size)
    ctx = StrategyContext(dist.group.WORLD, rank, world_size, facts, None, torch.device("cpu"), dict(options))
    return get_strategy(name)(ctx)


def make_inputs(kind, rank, i, m, h, dtype, device="cpu"):
    make = small_integer_inputs if kind == "int" else random_inputs
    return make(rank, m, h, dtype, seed=i, device=device)


def expected(world_size, dtype, h, i, m, kind, mode):
    """(reference, float64 reference) of call i: `mode` "res", "none" (no residual) or "ar"."""
    xs = [make_inputs(kind, r, i, m, h, dtype) for r in range(world_size)]
    res = make_inputs(kind, 100, i, m, h, dtype) if mode == "res" else None
    w = make_inputs(kind, 101, i, 1, h, dtype)[0]
    if mode == "ar":
        return (all_reduce_ref(xs),), (all_reduce_ref(xs, acc_dtype=torch.float64),)
    return all_reduce_residual_rmsnorm_ref(xs, res, w), all_reduce_residual_rmsnorm_ref(xs, res, w,
                                                                                        acc_dtype=torch.float64)


def check_outputs(name, outputs, world_size, dtype, h, calls):
    """outputs[rank][i]: call i's (normed, new_residual) or (sum,): identical bits on every rank;
    the sum and new_residual equal the rank-order fp32 reference, normed too on exact sums, else
    within the dtype's tolerance of the float64 reference."""
    for i, (m, kind, mode) in enumerate(calls):
        ref, ref64 = expected(world_size, dtype, h, i, m, kind, mode)
        for rank in range(world_size):
            got = [t.cpu() for t in outputs[rank][i][: len(ref)]]
            for g, g0 in zip(got, outputs[0][i]):
                assert torch.equal(g.view(torch.uint8), g0.cpu().view(torch.uint8)), \
                    f"{name}: rank {rank} bits differ from rank 0 (call {i})"
            for j, (g, r, r64) in enumerate(zip(got, ref, ref64)):
                if kind == "int" or mode == "ar" or j == 1:
                    assert torch.equal(g, r), f"{name} W={world_size} call {i} ({m}x{h} {kind} {mode}) output {j}"
                else:
                    assert relative_error(g, r64) <= TOLERANCE[dtype], (name, i, m)


class EmulatedRanks:
    """W ranks of one peer kernel emulated on one GPU, one stream each: `call(m, kind, mode, i)`
    launches every rank's call of the same shape and returns their outputs (poisoned with NaN first)."""

    def __init__(self, strategy: str, world: int, hidden: int, dtype, max_tokens: int, *, options=None,
                 timeout_s: float = 5.0, owns_rows=None, chunk: int | None = None) -> None:
        from tpfuse.kernels.protocol import Plan, make_plan, region_elems_for, tag_words_for
        from tpfuse.strategies.workspace import emulated_workspaces

        self.strategy, self.world, self.hidden, self.dtype = strategy, world, hidden, dtype
        self.twoshot = strategy == "twoshot"
        self.options, self.timeout_s, self.owns_rows = options, timeout_s, owns_rows
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.programs = max(1, sms // world)

        def plan_for(m):
            if chunk is None:
                return make_plan(m, hidden, dtype.itemsize, self.programs)
            nc = -(-hidden // chunk)
            return Plan(chunk, nc, m * nc, max(1, chunk * dtype.itemsize // 512), self.programs)

        self.plan_for = plan_for
        sizes = range(1, max_tokens + 1)
        need = max(region_elems_for(m, hidden, world, plan_for(m), twoshot=self.twoshot) for m in sizes)
        tags = max(tag_words_for(plan_for(m), m) for m in sizes)
        self.ws = emulated_workspaces(world, device="cuda", dtype=dtype, region_elems=need,
                                      num_regions=world + int(self.twoshot), tag_words=tags, timeout_s=timeout_s)
        self.streams = [torch.cuda.Stream() for _ in range(world)]
        self._launches = {}

    def launch_for(self, rank: int, m: int, has_res: bool, has_norm: bool, quant=None):
        from tpfuse.kernels.oneshot import oneshot_kernel
        from tpfuse.kernels.peer_launch import LaunchOptions, PeerLaunch
        from tpfuse.kernels.twoshot import twoshot_kernel

        key = (rank, m, has_res, has_norm, None if quant is None else quant.key)
        if key not in self._launches:
            kernel = twoshot_kernel if self.twoshot else oneshot_kernel
            self._launches[key] = PeerLaunch(
                kernel, self.strategy, self.ws[rank], m, self.hidden, self.dtype, has_res=has_res, has_norm=has_norm,
                quant=quant, plan=self.plan_for(m), max_programs=self.programs, timeout_s=self.timeout_s,
                twoshot=self.twoshot, options=self.options or LaunchOptions(), owns_rows=self.owns_rows)
            self._launches[key].compile()
        return self._launches[key]

    def inputs(self, m, kind, mode, i):
        xs = [make_inputs(kind, r, i, m, self.hidden, self.dtype, "cuda") for r in range(self.world)]
        res = make_inputs(kind, 100, i, m, self.hidden, self.dtype, "cuda") if mode == "res" else None
        w = make_inputs(kind, 101, i, 1, self.hidden, self.dtype, "cuda")[0]
        return xs, res, w

    def call(self, m, kind, mode, i, *, ranks=None, sync=True):
        """Every rank's call i (or only `ranks`'): [(normed, new_residual)] or [(sum,)] per rank."""
        xs, res, w = self.inputs(m, kind, mode, i)
        for rank in range(self.world):  # compile every rank's variant before any rank launches
            self.launch_for(rank, m, res is not None, mode != "ar")
        torch.cuda.synchronize()
        outs = []
        for rank in ranks if ranks is not None else range(self.world):
            launch = self.launch_for(rank, m, res is not None, mode != "ar")
            with torch.cuda.stream(self.streams[rank]):
                self.ws[rank].before_call()
                got = launch(xs[rank], res, w, 1e-6, out=nan_pair(xs[rank]))
            outs.append(got if mode != "ar" else got[:1])
        if sync:
            torch.cuda.synchronize()
        return outs


# ---- spawned interpreter ranks -----------------------------------------------------------------

def launch_of(strategy, ws, m, h, dtype, has_res, has_norm, quant=None, plan=None, owns_rows=None):
    """The PeerLaunch a strategy's route takes for this shape, or one with a forced plan (two-shot
    then with chunk owners, whose split rows exchange partials as one-shot's do) or a forced
    two-shot cut."""
    if plan is None and owns_rows is None:
        return strategy._route(ws, m, h, dtype, has_res, has_norm, quant, compile_now=False).launch
    if plan is None:
        plan = strategy._plan(m, h, dtype)
    elif owns_rows is None:
        owns_rows = False
    from tpfuse.kernels.peer_launch import PeerLaunch

    return PeerLaunch(strategy._kernel(), strategy.name, ws, m, h, dtype, has_res=has_res, has_norm=has_norm,
                      quant=quant, plan=plan, max_programs=strategy.max_programs, timeout_s=strategy.timeout_s,
                      twoshot=strategy.twoshot, options=strategy.launch_options,
                      owns_rows=owns_rows if strategy.twoshot else None)


def calls_rank(rank, world_size, name, dtype, h, calls, owns_rows=None):
    """Back-to-back calls through the launches the strategy's routes use, then the first call
    again through the torch.library op (which finds the strategy by handle)."""
    from tpfuse.kernels.custom_ops import all_reduce_residual_rmsnorm_op

    strategy = cpu_strategy(name, rank, world_size, timeout_s=5.0, max_programs=2)
    strategy.prepare(hidden=h, dtype=dtype, max_tokens=max(m for m, _, _ in calls))
    (ws,) = strategy._workspaces.values()
    out = []
    for i, (m, kind, mode) in enumerate(calls):
        x = make_inputs(kind, rank, i, m, h, dtype)
        res = make_inputs(kind, 100, i, m, h, dtype) if mode == "res" else None
        w = make_inputs(kind, 101, i, 1, h, dtype)[0]
        ws.before_call()
        launch = launch_of(strategy, ws, m, h, dtype, res is not None, mode != "ar", owns_rows=owns_rows)
        got = launch(x, res, w, 1e-6, out=nan_pair(x))
        out.append(got if mode != "ar" else got[:1])
    m, kind, mode = calls[0]
    x, res, w = (make_inputs(kind, rank, 0, m, h, dtype), make_inputs(kind, 100, 0, m, h, dtype),
                 make_inputs(kind, 101, 0, 1, h, dtype)[0])
    op_out = all_reduce_residual_rmsnorm_op(x, res if mode == "res" else None, w, 1e-6, strategy.handle)
    strategy.check()
    strategy.close()
    return out, op_out


def check_calls(name, world_size, dtype, h, calls, owns_rows=None):
    from tpfuse.spawn import run_ranks

    results = run_ranks(calls_rank, world_size, args=(name, dtype, h, calls, owns_rows), env=INTERP, timeout_s=300)
    for rank, (outs, op_out) in enumerate(results):  # the custom op served the first call again, identically
        if calls[0][2] != "ar":
            assert torch.equal(op_out[0], outs[0][0]) and torch.equal(op_out[1], outs[0][1])
    check_outputs(name, [outs for outs, _ in results], world_size, dtype, h, calls)


def forced_split(rank, world_size, name, h, chunk):
    """(strategy, its workspace, a plan of 3 rows cut into `chunk`-element items)."""
    from tpfuse.kernels.protocol import Plan

    strategy = cpu_strategy(name, rank, world_size, timeout_s=5.0, max_programs=4)
    strategy.prepare(hidden=h, dtype=torch.bfloat16, max_tokens=3)
    (ws,) = strategy._workspaces.values()
    num_chunks = -(-h // chunk)
    return strategy, ws, Plan(chunk=chunk, num_chunks=num_chunks, items=3 * num_chunks, num_warps=1)


def split_rank(rank, world_size, name, h, chunk):
    strategy, ws, plan = forced_split(rank, world_size, name, h, chunk)
    outs = []
    for i, kind in enumerate(("int", "rand", "int")):
        x, res, w = (make_inputs(kind, rank, i, 3, h, torch.bfloat16), make_inputs(kind, 100, i, 3, h, torch.bfloat16),
                     make_inputs(kind, 101, i, 1, h, torch.bfloat16)[0])
        launch = launch_of(strategy, ws, 3, h, torch.bfloat16, True, True, plan=plan)
        outs.append(launch(x, res, w, 1e-6, out=nan_pair(x)))
    strategy.check()
    strategy.close()
    return outs


def check_split(name, h, chunk):
    from tpfuse.spawn import run_ranks

    results = run_ranks(split_rank, 2, args=(name, h, chunk), env=INTERP, timeout_s=300)
    calls = [(3, kind, "res") for kind in ("int", "rand", "int")]
    check_outputs(name, results, 2, torch.bfloat16, h, calls)


def split_quant_specs():
    from tpfuse import quant as Q

    return [Q.fp8_static(0.125), Q.fp8_per_token(with_normed=True), Q.fp8_per_token(scale_ub=0.004),
            Q.fp8_per_group(16, layout="col"), Q.fp8_per_group(32), Q.nvfp4(40.0, swizzled=True), Q.nvfp4(3.0)]


def split_quant_rank(rank, world_size, name, h, chunk):
    from tpfuse import quant as Q
    from tpfuse.kernels.protocol import Plan

    strategy, ws, plan = forced_split(rank, world_size, name, h, chunk)
    x = small_integer_inputs(rank, 3, h, torch.bfloat16, seed=7)
    res, w = small_integer_inputs(100, 3, h, torch.bfloat16, seed=7), small_integer_inputs(101, 1, h, torch.bfloat16,
                                                                                           seed=7)[0]
    outs = []
    inputs = [t.clone() for t in (x, res, w)]
    for spec in split_quant_specs():
        normed = torch.full_like(x, float("nan"))  # poisoned: the kernel must write every element it returns
        launch = launch_of(strategy, ws, 3, h, torch.bfloat16, True, True, quant=spec, plan=plan)
        with poisoned_empty():  # and every byte of the codes and scales it allocates (swizzled padding too)
            outs.append(pack(launch(x, res, w, 1e-6, quant=spec, out=(normed, None))))
        assert all(torch.equal(a, b) for a, b in zip(inputs, (x, res, w))), f"{spec.key} wrote into its inputs"
    try:  # a plan whose chunks cut NVFP4's scale blocks is refused before any launch, with the fix
        nc = -(-h // 32)
        launch_of(strategy, ws, 3, h, torch.bfloat16, True, True, quant=Q.nvfp4(1.0), plan=Plan(32, nc, 3 * nc, 1))
        outs.append("launched")
    except ValueError as exc:
        outs.append(str(exc))
    strategy.check()
    strategy.close()
    return outs


def check_quantized(name, results, xs, res, w, specs):
    """Every rank's packed QuantOutputs (`support.quant_output.pack`) equal the reference's, byte for byte."""
    from tpfuse.reference import all_reduce_residual_rmsnorm_quant_ref

    for i, spec in enumerate(specs):
        ref = pack(all_reduce_residual_rmsnorm_quant_ref(xs, res, w, 1e-6, spec))
        for rank, result in enumerate(results):
            for part, g, r in zip(("out", "scale", "residual", "normed"), result[i], ref):
                assert (g is None) == (r is None), (spec.key, part)
                if g is not None:
                    assert g[:2] == r[:2] and torch.equal(g[3], r[3]), f"{name} rank {rank} {spec.key}: {part} differs"


def check_split_quant(name, h=192, chunk=64):
    from tpfuse.spawn import run_ranks

    results = run_ranks(split_quant_rank, 2, args=(name, h, chunk), env=INTERP, timeout_s=600)
    xs = [small_integer_inputs(r, 3, h, torch.bfloat16, seed=7) for r in range(2)]
    res, w = small_integer_inputs(100, 3, h, torch.bfloat16, seed=7), small_integer_inputs(101, 1, h, torch.bfloat16,
                                                                                           seed=7)[0]
    check_quantized(name, results, xs, res, w, split_quant_specs())
    for result in results:
        assert "do not hold whole nvfp4 scale blocks" in result[-1] and "residual_rmsnorm" in result[-1], result[-1]
