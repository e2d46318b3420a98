"""Intrinsic latency of the peer kernels on ONE GPU, with W ranks emulated as W CUDA streams.

    python benchmarks/bench_peer_kernels.py --suite report --out benchmarks/results/peer_kernels_emulated.jsonl

Every rank's buffer, state and error words live on the one GPU
(`tpfuse.strategies.workspace.emulated_workspaces`); rank r's calls run on stream r through the
real launches (`tpfuse.kernels.peer_launch.PeerLaunch`, the route a strategy takes). All streams'
calls are captured in one CUDA graph and replayed, in two modes: `steady` (each stream issues N
calls back to back after one fork; per call = elapsed / N) and `aligned` (a fork and a join around
every call). The grid of each rank is at most SMs // W, so all ranks' programs are resident
together. Baselines in the same run: an empty kernel in the same stream structure, the epilogue
kernel alone on one stream, and a device copy of the input. `alternating` issues 128 tokens then
1 token per pair of calls (the re-arm cost of a large call falls on the next one) and is compared
with the two steady calls.

Launch options (`extra.pdl`, `extra.spin`, `extra.cooperative`): rows say which. A deployment
with one rank per GPU triggers the next launch at a kernel's entry (pdl 2); ranks sharing a GPU,
as here, trigger at the end (pdl 1). The emulation runs the entry trigger only where two launches
of every rank fit the GPU at once (the launcher checks; otherwise it falls back to 1 and the row
says so): the figure a one-rank-per-GPU deployment's kernel gives, without its fabric.

What the emulation leaves out, and its bias: no fabric. Pushes to "peers" are stores to the same
GPU's memory, so fabric latency and bandwidth (NVLink about 1-2 us per hop; PCIe more) and the
system-scope visibility of remote stores are absent; polls see stores through the one L2. So these
figures are a floor for a real multi-GPU call: they measure the kernels' own instruction and
synchronisation cost. The W ranks also share one GPU's SMs and memory bandwidth, which biases
large calls (W x the traffic of one rank on one memory system) upwards, and W streams' launches
are serialised by one GPU's front end (the empty-kernel rows measure it). `estimate` rows combine
these parts into a real TP8 call on NVLink and on PCIe (see `estimates`).

After timing, the outputs of a final replay (poisoned with NaN before it) are checked against a
float64 reference, every rank's bits against rank 0's, and every error word must be zero: a
timed-out workspace runs fast and writes NaN, so such a row is marked invalid, never reported as
a time. Every row carries `"emulated": true` in `extra` and a strategy name ending in `_emulated`.

Compiles run first, in parallel processes sharing Triton's cache (`--compile-workers`), so the
timed process only loads them. The graph here forks W streams and joins them inside one capture,
which `tpfuse.timing.capture` (one stream) does not do, so the capture and its replay timer are this
file's own; the statistics of every row are `tpfuse.timing.summary`'s (through
`tpfuse.results.make_row`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time

import torch

from tpfuse.results import append_rows, make_row

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WORLDS = (1, 2, 4, 8)
H = 6144
# Fabric parts of the TP8 estimates (research anchors, not measured here): one-way latency of a
# remote store until a poll sees it, and per-direction bandwidth of one GPU's links. NVLink 4
# (H100/H200): 371-377 GB/s measured unidirectional P2P writes (nccl#1264), 0.6 us per hop in
# NCCL's LL cost model, 1-2 us quoted; PCIe 5.0 x16: 53-56 GB/s, 0.36-0.45 us write latency
# measured with p2pBandwidthLatencyTest (RTX PRO 6000 boxes).
FABRIC = {"nvlink": {"latency_us": (1.2, 1.8), "gbps": 370.0}, "pcie": {"latency_us": (0.9, 2.0), "gbps": 54.0}}


def launch_options(pdl: int, spin: int, cooperative: bool = False):
    from tpfuse.kernels.peer_launch import LaunchOptions

    return LaunchOptions(pdl=pdl, spin=spin, cooperative=cooperative)


def capture(per_stream_calls, streams, mode: str, n: int):
    """A CUDA graph in which stream r makes `n` calls of per_stream_calls[r] (steady or aligned)."""
    main = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=main):
        rounds = [n] if mode == "steady" else [1] * n
        for k in rounds:
            for s in streams:
                s.wait_stream(main)
            for s, call in zip(streams, per_stream_calls):
                with torch.cuda.stream(s):
                    for j in range(k):
                        call(j)
            for s in streams:
                main.wait_stream(s)
    return graph


def time_graph(graph, reps: int) -> list[float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1000.0)
    return out


def reference(xs, res, w):
    from tpfuse.reference import all_reduce_residual_rmsnorm_ref

    cpu = [x.cpu() for x in xs]
    return (all_reduce_residual_rmsnorm_ref(cpu, res.cpu(), w.cpu()),
            all_reduce_residual_rmsnorm_ref(cpu, res.cpu(), w.cpu(), acc_dtype=torch.float64))


class Case:
    """One (strategy, W, tokens sequence, hidden, dtype, launch options) setup with its inputs and outputs."""

    def __init__(self, strategy: str, world: int, tokens_seq: tuple, hidden: int, dtype, *, chunk=None, quant=None,
                 path="in_kernel", options=None, owns_rows=None, per_push=None):
        from tpfuse.kernels.oneshot import oneshot_kernel
        from tpfuse.kernels.peer_launch import PeerLaunch
        from tpfuse.kernels.protocol import Plan, make_plan, region_elems_for, tag_words_for, twoshot_plan
        from tpfuse.kernels.twoshot import twoshot_kernel
        from tpfuse.reference import random_inputs
        from tpfuse.strategies.workspace import emulated_workspaces

        twoshot = strategy == "twoshot"
        self.world, self.hidden, self.dtype, self.tokens_seq = world, hidden, dtype, tokens_seq
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.max_programs = max(1, sms // world)
        self.plan_programs = self.max_programs

        def plan_for(m):
            if chunk is None:
                if twoshot:  # the strategy's plan (twoshot_plan: wide chunks where owners hold several items)
                    return twoshot_plan(m, hidden, dtype.itemsize, self.plan_programs, world)
                return make_plan(m, hidden, dtype.itemsize, self.plan_programs)
            nc = -(-hidden // chunk)
            return Plan(chunk, nc, m * nc, max(1, chunk * dtype.itemsize // 512), self.plan_programs)

        self.plans = {m: plan_for(m) for m in set(tokens_seq)}
        need = max(region_elems_for(m, hidden, world, p, twoshot=twoshot) for m, p in self.plans.items())
        tags = max(tag_words_for(p, m) for m, p in self.plans.items())
        self.ws = emulated_workspaces(world, device="cuda", dtype=dtype, region_elems=need,
                                      num_regions=world + int(twoshot), tag_words=tags, timeout_s=5.0)
        kernel = twoshot_kernel if twoshot else oneshot_kernel
        options = options or launch_options(1, True)
        self.launches = [{m: PeerLaunch(kernel, f"{strategy}_emulated", ws, m, hidden, dtype, has_res=True,
                                        has_norm=path == "in_kernel" or quant is None,
                                        quant=quant if path == "in_kernel" else None, plan=self.plans[m],
                                        max_programs=self.max_programs, timeout_s=5.0, twoshot=twoshot,
                                        options=options, owns_rows=owns_rows, per_push=per_push)
                          for m in set(tokens_seq)} for ws in self.ws]
        mmax = max(tokens_seq)
        self.xs = [random_inputs(r, mmax, hidden, dtype, seed=hidden, device="cuda") for r in range(world)]
        self.res = random_inputs(100, mmax, hidden, dtype, seed=hidden, device="cuda")
        self.w = (1 + 0.1 * random_inputs(101, 1, hidden, torch.float32, seed=hidden)[0]).to(dtype).cuda()
        self.outs = [(torch.empty(mmax, hidden, dtype=dtype, device="cuda"), torch.empty(mmax, hidden, dtype=dtype,
                                                                                         device="cuda"))
                     for _ in range(world)]
        self.quant, self.path = quant, path  # quantized output: in the peer kernel, or by the epilogue after it
        self.last = [None] * world  # each rank's latest QuantOutput (the captured call's, after capture)

    def compile(self) -> None:
        for launches in self.launches[:1]:  # every rank's variant is the same
            for launch in launches.values():
                launch.compile()

    def config(self):
        """The last size's PeerConfig (after the first launch, which may fall back from pdl 2)."""
        return self.launches[0][self.tokens_seq[-1]].C

    def call(self, rank: int, j: int) -> None:
        m = self.tokens_seq[j % len(self.tokens_seq)]
        out = self.outs[rank]
        launch = self.launches[rank][m]
        self.ws[rank].before_call()
        if self.quant is None:
            launch(self.xs[rank][:m], self.res[:m], self.w, 1e-6, out=(out[0][:m], out[1][:m]))
        elif self.path == "in_kernel":
            self.last[rank] = launch(self.xs[rank][:m], self.res[:m], self.w, 1e-6, quant=self.quant)
        else:
            from tpfuse.kernels.epilogue import residual_rmsnorm

            s = launch(self.xs[rank][:m], None, None, 0.0, out=(out[0][:m], None))[0]
            self.last[rank] = residual_rmsnorm(s, self.res[:m], self.w, 1e-6, quant=self.quant)

    def compile_epilogue(self) -> None:
        """Compile the quantizing epilogue before any peer call: a rank that compiled it between
        its peer kernels would keep its peers spinning past their timeout."""
        from tpfuse.kernels.epilogue import residual_rmsnorm

        if self.quant is not None and self.path == "two_kernels":
            for m in set(self.tokens_seq):
                residual_rmsnorm(self.xs[0][:m], self.res[:m], self.w, 1e-6, quant=self.quant)
        torch.cuda.synchronize()

    def check_quantized(self, m: int) -> tuple[bool, str]:
        """Every rank's bits equal rank 0's; rank 0 against the reference quantizer of the fp32
        rank-order sum (new residual exact; scales and codes within the one-step rule of
        tests/kernels/test_quant.py: the sum of squares is a tree in the kernel and
        sequential in torch, so a row's fp32 values may differ by an ulp)."""
        from tpfuse.reference import all_reduce_residual_rmsnorm_quant_ref

        got = [tuple(t.contiguous().view(torch.uint8).cpu() if t is not None else None for t in q) for q in self.last]
        for rank in range(1, self.world):
            if any((a is None) != (b is None) or (a is not None and not torch.equal(a, b))
                   for a, b in zip(got[rank], got[0])):
                return False, f"rank {rank} quantized bits differ from rank 0"
        q = self.last[0]
        ref = all_reduce_residual_rmsnorm_quant_ref([x[:m].cpu() for x in self.xs], self.res[:m].cpu(), self.w.cpu(),
                                                    1e-6, self.quant)
        if not torch.equal(q.residual.cpu(), ref.residual):
            return False, "new residual differs from the reference"
        nib = self.quant.kind == "nvfp4"
        if nib:
            step = (ordinal(q.scale.cpu(), False) - ordinal(ref.scale, False)).abs().max().item()
        elif self.quant.kind != "fp8_static":
            step = ((q.scale.cpu() - ref.scale).abs() / ref.scale.abs().clamp_min(1e-30)).max().item() / 2.0**-23 / 4
        else:
            step = 0
        if not step <= 1:
            return False, f"scales off by {step:g} steps"
        if not nib or torch.equal(q.scale.cpu().view(torch.uint8), ref.scale.view(torch.uint8)):
            codes = (ordinal(q.out.cpu(), nib) - ordinal(ref.out, nib)).abs().max().item()
            if codes > 1:
                return False, f"codes off by {codes} steps"
        return True, "ok"

    def check(self) -> tuple[bool, str]:
        """Errors zero, bits identical on every rank, results right for the last call's size."""
        from tpfuse.reference import TOLERANCE, relative_error

        errs = [ws.err.tolist() for ws in self.ws]
        if any(e[0] for e in errs):
            return False, f"error words {errs}"
        m = self.tokens_seq[-1]
        if self.quant is not None:
            return self.check_quantized(m)
        ref, ref64 = reference([x[:m] for x in self.xs], self.res[:m], self.w)
        bits = torch.int16 if self.dtype.itemsize == 2 else torch.int32
        for rank, (normed, new_res) in enumerate(self.outs):
            if not torch.equal(normed[:m].view(bits), self.outs[0][0][:m].view(bits)):
                return False, f"rank {rank} normed bits differ from rank 0"
            if not torch.equal(new_res[:m].cpu(), ref[1]):
                return False, f"rank {rank} new_residual differs from the fp32 rank-order reference"
            rel = relative_error(normed[:m].cpu(), ref64[0])
            if not rel <= TOLERANCE[self.dtype]:
                return False, f"rank {rank} normed relative error {rel:.3g}"
        return True, "ok"

    def poison(self) -> None:
        for normed, new_res in self.outs:
            normed.fill_(float("nan"))
            new_res.fill_(float("nan"))
        for q in self.last:
            for t in q or ():
                if t is not None:  # NaN: e4m3 0x7F (codes, NVFP4 scales), fp32 / bf16 NaN
                    if t.is_floating_point() and t.element_size() > 1:
                        t.fill_(float("nan"))
                    else:
                        t.view(torch.uint8).fill_(0x7F)


def ordinal(codes, nibbles: bool):
    """Signed grid positions of e4m3 codes (or of packed e2m1 nibbles): adjacent values differ by one."""
    c = codes.contiguous().view(torch.uint8).to(torch.int32)
    if nibbles:
        c = torch.stack([c & 0xF, c >> 4], dim=-1)
        return torch.where(c >= 8, -(c - 8), c)
    return torch.where(c >= 0x80, -(c - 0x80), c)


def run_case(spec: dict, mode: str, n: int, reps: int):
    case = Case(**spec)
    case.compile_epilogue()
    streams = [torch.cuda.Stream() for _ in range(case.world)]
    calls = [lambda j, r=r: case.call(r, j) for r in range(case.world)]
    for j in range(len(case.tokens_seq)):  # eager warm-up: binds every size, runs the protocol once
        for s, call in zip(streams, calls):
            with torch.cuda.stream(s):
                call(j)
    torch.cuda.synchronize()
    graph = capture(calls, streams, mode, n)
    graph.replay()
    torch.cuda.synchronize()
    samples = [t / n for t in time_graph(graph, reps)]
    case.poison()
    graph.replay()
    torch.cuda.synchronize()
    ok, why = case.check()
    plan = case.plans[case.tokens_seq[-1]]
    return samples, ok, why, plan, min(plan.items, case.max_programs), case.config()


def _compile_worker(specs: list[dict]) -> int:
    torch.cuda.set_device(0)
    done = 0
    for spec in specs:
        try:
            Case(**spec).compile()
            done += 1
        except Exception as exc:  # the timed run reports it
            print(f"compile failed for {spec}: {exc!r}", flush=True)
    return done


def precompile(specs: list[dict], workers: int) -> float:
    """Compile every case's variants in `workers` processes (Triton's on-disk cache is shared);
    the scales of quantized formats travel as floats (data, not part of a variant)."""
    import dataclasses

    specs = [dict(s, quant=dataclasses.replace(s["quant"], scale=1.0))
             if s.get("quant") is not None and s["quant"].kind in ("fp8_static", "nvfp4") else s for s in specs]
    t0 = time.time()
    if workers <= 1 or not specs:
        _compile_worker(specs)
        return time.time() - t0
    ctx = multiprocessing.get_context("spawn")
    chunks = [specs[i::workers] for i in range(workers)]
    with ctx.Pool(workers) as pool:
        pool.map(_compile_worker, [c for c in chunks if c])
    return time.time() - t0


def baseline_empty(world, n, reps):
    import triton

    @triton.jit
    def empty_kernel(p):
        pass

    dummy = torch.zeros(1, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(world)]
    calls = [lambda j: empty_kernel[(1,)](dummy) for _ in range(world)]
    for s, c in zip(streams, calls):
        with torch.cuda.stream(s):
            c(0)
    torch.cuda.synchronize()
    graph = capture(calls, streams, "steady", n)
    return [t / n for t in time_graph(graph, reps)]


def baseline_single(fn, n, reps):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    graph = capture([lambda j: fn()], [s], "steady", n)
    return [t / n for t in time_graph(graph, reps)]


def bytes_per_rank(strategy: str, world: int, tokens: int, hidden: int, itemsize: int) -> int:
    """Bytes one rank sends over the fabric in one call (one-shot: its input to W - 1 peers;
    two-shot: (W - 1) / W of its input to owners, then its owned sums to W - 1 peers)."""
    payload = tokens * hidden * itemsize
    if strategy == "oneshot":
        return (world - 1) * payload
    return 2 * (world - 1) * payload // world


def estimates(emulated_us: float, empty_w: float, empty_1: float, strategy: str, world: int, tokens: int,
              hidden: int, itemsize: int) -> dict:
    """A real call from the emulated one, per fabric: minus the launch serialisation of W streams
    on one GPU's front end (empty kernel on W streams minus on one), plus the fabric's one-way
    latency (a push until the peer's poll sees it: one trip for one-shot, two for two-shot) and the
    bytes one rank sends at the link's bandwidth. (low, high) in us, from FABRIC's ranges."""
    trips = 1 if strategy == "oneshot" else 2
    base = emulated_us - max(0.0, empty_w - empty_1)
    out = {}
    for fabric, f in FABRIC.items():
        wire = bytes_per_rank(strategy, world, tokens, hidden, itemsize) / (f["gbps"] * 1e3)  # us
        out[fabric] = tuple(round(base + trips * lat + wire, 2) for lat in f["latency_us"])
    return out


def suites(args) -> dict[str, list[tuple]]:
    """Named lists of (label, spec, mode) to run, in order."""
    from tpfuse import quant as Q

    bf16 = torch.bfloat16
    best = launch_options(args.pdl, args.spin)

    def spec(strategy, world, tokens_seq, hidden=H, dtype=bf16, options=None, **kw):
        return dict(strategy=strategy, world=world, tokens_seq=tuple(tokens_seq), hidden=hidden, dtype=dtype,
                    options=options or best, **kw)

    variants = []
    for world in (8, 1, 4, 2):  # decode: launch options
        for pdl in (0, 1, 2):
            for spin in (0, 1, 2):
                if (pdl, spin) in ((0, 0), (1, 1), (1, 2), (2, 1), (2, 2)) and (world in (8, 1) or spin == 2):
                    variants.append((f"pdl{pdl}_spin{spin}", spec("oneshot", world, (1,),
                                                                  options=launch_options(pdl, spin)), "steady"))
    variants.append(("cooperative", spec("oneshot", 8, (1,), options=launch_options(args.pdl, args.spin, True)),
                     "steady"))
    for t in (16, 64, 256):  # two-shot: whole-row owners against chunk owners, and one-shot beside them
        for rows in (True, False):
            for spin in (1, 2):
                variants.append((f"rows{int(rows)}", spec("twoshot", 8, (t,), owns_rows=rows,
                                                          options=launch_options(1, spin)), "steady"))
        variants.append(("oneshot", spec("oneshot", 8, (t,)), "steady"))
    scale, global_scale = torch.full((1,), 0.05, device="cuda"), torch.full((1,), 40.0, device="cuda")
    for q in (Q.fp8_per_token(), Q.nvfp4(global_scale), Q.fp8_static(scale)):
        variants.append(("quant", spec("oneshot", 8, (1,), quant=q), "steady"))
    # sizes alternating on a shared GPU: the end trigger (an entry trigger lets a fast rank's next
    # large launch take the SMs a slower rank's current one needs)
    variants.append(("alternating", spec("oneshot", 8, (128, 1), options=launch_options(1, args.spin)), "steady"))
    variants.append(("alternating", spec("oneshot", 8, (128,), options=launch_options(1, args.spin)), "steady"))

    final = []
    for world in WORLDS:
        for strategy in ("oneshot", "twoshot"):
            if strategy == "twoshot" and world == 1:
                continue
            for t in ((1, 16, 64, 256) if args.quick else TOKENS):
                final.append(("grid", spec(strategy, world, (t,)), "steady"))
    shared = launch_options(1, args.spin)  # what ranks sharing a GPU run (see the module docstring)
    for strategy in ("oneshot", "twoshot"):
        final.append(("alternating", spec(strategy, 8, (128, 1), options=shared), "steady"))
        final.append(("alternating", spec(strategy, 8, (128,), options=shared), "steady"))
        final.append(("alternating", spec(strategy, 8, (1,), options=shared), "steady"))
        final.append(("aligned", spec(strategy, 8, (1,)), "aligned"))
    for world in WORLDS:
        final.append(("pdl_shared", spec("oneshot", world, (1,), options=shared), "steady"))
    for q in (Q.fp8_per_token(), Q.nvfp4(global_scale), Q.fp8_static(scale), Q.fp8_per_group(128, layout="col")):
        for t in ((1, 16) if q.kind in ("fp8_per_token", "nvfp4") else (1,)):
            for path in ("in_kernel", "two_kernels"):
                final.append(("quant", spec("oneshot", 8, (t,), quant=q, path=path), "steady"))
    for strategy in ("oneshot", "twoshot"):
        for t in (1, 64):
            final.append(("hidden", spec(strategy, 8, (t,), hidden=7168), "steady"))
    report = []  # the cases the results README reports, in one run
    for world in WORLDS:
        for pdl, spin in ((2, 2), (2, 1), (1, 2)):
            report.append((f"pdl{pdl}_spin{spin}", spec("oneshot", world, (1,), options=launch_options(pdl, spin)),
                           "steady"))
    for t in (16, 64, 256):
        for rows in (True, False):
            report.append((f"rows{int(rows)}", spec("twoshot", 8, (t,), owns_rows=rows), "steady"))
        report.append(("grid", spec("oneshot", 8, (t,)), "steady"))
    for world in (1, 2, 4):
        for t in (16, 64):
            report.append(("grid", spec("oneshot", world, (t,)), "steady"))
    for world in (2, 4, 8):
        for t in ((1, 16, 64) if world < 8 else (1,)):
            report.append(("grid", spec("twoshot", world, (t,)), "steady"))
    for strategy in ("oneshot", "twoshot"):
        for tokens in ((128, 1), (128,), (1,)):
            report.append(("alternating", spec(strategy, 8, tokens, options=shared), "steady"))
    for q in (Q.fp8_per_token(), Q.nvfp4(global_scale), Q.fp8_static(scale)):
        for path in ("in_kernel", "two_kernels"):
            report.append(("quant", spec("oneshot", 8, (1,), quant=q, path=path), "steady"))
    for path in ("in_kernel", "two_kernels"):
        report.append(("quant", spec("oneshot", 8, (16,), quant=Q.fp8_per_token(), path=path), "steady"))
    spins = []  # the tag wait before a decode poll (spin 3) against the vector spin alone (spin 2)
    for world in WORLDS:
        for pdl, spin in ((2, 2), (2, 3), (2, 4), (1, 2), (1, 4)):
            spins.append((f"pdl{pdl}_spin{spin}", spec("oneshot", world, (1,), options=launch_options(pdl, spin)),
                          "steady"))
    for q in (Q.fp8_per_token(), Q.fp8_static(scale)):
        for spin in (2, 4):
            spins.append((f"quant_spin{spin}", spec("oneshot", 8, (1,), quant=q, options=launch_options(2, spin)),
                          "steady"))
    for spin in (2, 4):  # several items a program: spins 3 and 4 change nothing there
        spins.append((f"pdl1_spin{spin}", spec("oneshot", 8, (16,), options=launch_options(1, spin)), "steady"))
    twoshot_poll = []  # two-shot chunk owners: an owner's reduce polling source after source (2) or all at once (4)
    for t in (1, 16, 64):
        for world in ((8,) if t == 1 else (8, 4, 2)):
            for spin in (2, 4):
                twoshot_poll.append((f"pdl{args.pdl}_spin{spin}",
                                     spec("twoshot", world, (t,), owns_rows=False,
                                          options=launch_options(args.pdl, spin)), "steady"))
    chunks = []  # the plan's chunk size forced, against make_plan's choice (the `grid` rows of the same run)
    for world in WORLDS:
        for chunk in (512, 1024, 2048):
            chunks.append((f"chunk{chunk}", spec("oneshot", world, (1,), chunk=chunk), "steady"))
        chunks.append(("grid", spec("oneshot", world, (1,)), "steady"))
    for t in (16, 64):
        for chunk in (512, 1024, 2048):
            chunks.append((f"chunk{chunk}", spec("twoshot", 8, (t,), chunk=chunk, owns_rows=False), "steady"))
        chunks.append(("grid", spec("twoshot", 8, (t,)), "steady"))
    scatter = []  # two-shot's scatter: items a program pushes per step, 1 (a chain of reads) against 4 and 8
    for world, tokens in ((8, 16), (8, 64), (8, 256), (4, 64), (4, 256), (2, 256)):
        for per_push in (1, 4, 8):
            scatter.append((f"push{per_push}", spec("twoshot", world, (tokens,), per_push=per_push), "steady"))
    whole_rows = []  # items of a whole row (chunks of 4096 or 8192 elements, 16 or 32 warps) against the plan's
    for world in (8, 4, 2):
        for t in (16, 64):
            for chunk in (None, 4096, 8192):
                whole_rows.append((f"chunk{chunk or 'plan'}",
                                   spec("twoshot", world, (t,), chunk=chunk, owns_rows=False), "steady"))
        for chunk in (None, 4096, 8192):
            whole_rows.append((f"chunk{chunk or 'plan'}", spec("oneshot", world, (16,), chunk=chunk), "steady"))
    wide_chunks = []  # two-shot chunk owners from 32 tokens, and one-shot at W = 4: chunks of 2048 against 4096
    for world in (8, 4, 2):
        for t in (32, 48, 64, 96, 128):
            for chunk in (2048, 4096):
                wide_chunks.append((f"chunk{chunk}", spec("twoshot", world, (t,), chunk=chunk, owns_rows=False),
                                    "steady"))
    for t in (8, 16, 32):
        for chunk in (2048, 4096):
            wide_chunks.append((f"chunk{chunk}", spec("oneshot", 4, (t,), chunk=chunk), "steady"))
    quant = []  # quantized output in the kernel against the unquantized call of the same run
    for world, strategy, tokens in ((8, "oneshot", (1, 16)), (4, "oneshot", (1,)), (8, "twoshot", (16, 64))):
        for t in tokens:
            quant.append(("grid", spec(strategy, world, (t,)), "steady"))
            for q in (Q.fp8_per_token(), Q.fp8_static(scale), Q.nvfp4(global_scale)):
                if strategy == "oneshot" or q.kind == "fp8_per_token":
                    quant.append(("quant", spec(strategy, world, (t,), quant=q, path="in_kernel"), "steady"))
    quant_route = []  # each format in the kernel against two kernels (peer allreduce, then the epilogue)
    formats = (Q.fp8_per_token(), Q.fp8_static(scale), Q.fp8_per_group(128, layout="col"), Q.nvfp4(global_scale),
               Q.nvfp4(global_scale, swizzled=False))
    for world, tokens in ((8, (1, 4, 16)), (4, (1, 16))):
        for t in tokens:
            quant_route.append(("grid", spec("oneshot", world, (t,)), "steady"))
            for q in formats:
                for path in ("in_kernel", "two_kernels"):
                    quant_route.append(("quant", spec("oneshot", world, (t,), quant=q, path=path), "steady"))
    twoshot_plans = []  # two-shot with the strategy's plan (twoshot_plan) where its chunks are wide or just not
    for world in (8, 4, 2):
        for t in (32, 48, 64, 96):
            twoshot_plans.append(("grid", spec("twoshot", world, (t,)), "steady"))
    return {"variants": variants, "final": final, "report": report, "chunks": chunks, "spin": spins,
            "twoshot_poll": twoshot_poll, "scatter": scatter, "whole_rows": whole_rows, "wide_chunks": wide_chunks,
            "quant": quant, "quant_route": quant_route, "twoshot_plan": twoshot_plans}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON-lines file for the result rows")
    parser.add_argument("--suite", choices=("variants", "final", "report", "chunks", "spin", "twoshot_poll", "scatter",
                                            "whole_rows", "wide_chunks", "quant", "quant_route", "twoshot_plan", "all"),
                        default="report",
                        help="variants: launch options and two-shot cuts compared; final: the whole grid; report: "
                             "what benchmarks/results/README.md reports, in one run; chunks: the plan's chunk size "
                             "forced at decode sizes beside make_plan's choice; spin: the decode poll's levels "
                             "(spin 2, 3, 4) at 1 token; twoshot_poll: two-shot chunk owners at spin 2 and 4; "
                             "scatter: two-shot's items scattered per step (1, 4, 8) at 16-256 tokens; whole_rows: "
                             "chunks of 4096 and 8192 elements (a whole row of 6144 an item) against the plan's, at "
                             "16-64 tokens; wide_chunks: chunks of 2048 against 4096 for two-shot's chunk owners "
                             "at 32-128 tokens and one-shot at W = 4; quant: each quantized format in the kernel "
                             "beside the unquantized call (one-shot W = 8 at 1 and 16 tokens, W = 4 at 1; "
                             "two-shot per-token FP8 at 16 and 64); quant_route: each format (NVFP4 in both scale "
                             "layouts) in the kernel against two kernels, one-shot W = 8 at 1, 4, 16 tokens and W = 4 "
                             "at 1, 16; twoshot_plan: two-shot with the strategy's plan "
                             "at 32-96 tokens, W = 2, 4, 8")
    parser.add_argument("--plot", help="PNG of per-call latency against tokens (steady, bf16, hidden 6144)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new cases after this long")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="the final grid at tokens 1/16/64 only")
    parser.add_argument("--pdl", type=int, default=2, choices=(0, 1, 2), help="launch trigger of the reported rows")
    parser.add_argument("--spin", type=int, default=4, choices=(0, 1, 2, 3, 4),
                        help="per-thread spins in the reported rows (default: the peer strategies' own, 4)")
    parser.add_argument("--compile-workers", type=int, default=12, help="processes that compile before timing")
    args = parser.parse_args(argv)
    t0 = time.time()
    rows, table = [], []
    bf16 = torch.bfloat16
    plan = suites(args)
    todo = plan["variants"] + plan["final"] if args.suite == "all" else plan[args.suite]
    compile_s = precompile([s for _, s, _ in todo], args.compile_workers)
    print(f"compiled {len(todo)} cases' variants in {compile_s:.0f} s", flush=True)

    def emit(op, strategy, shape, dtype, world, samples, **extra):
        row = make_row(op, strategy, shape, str(dtype).replace("torch.", ""), world, samples, "us", emulated=True,
                       **extra)
        rows.append(row)
        append_rows(args.out, [row])
        table.append((op, strategy, world, shape, dtype, row.median, extra))
        return row

    results = {}
    for label, spec, mode in todo:
        if time.time() - t0 > args.budget_s:
            print(f"budget: skipped {label} {spec['strategy']} W={spec['world']} T={spec['tokens_seq']}", flush=True)
            continue
        n = 40 if max(spec["tokens_seq"]) <= 64 else 16
        try:
            samples, ok, why, pl, programs, cfg = run_case(spec, mode, n, args.reps)
        except Exception as exc:  # a case that cannot run is a finding, not the end of the run
            print(f"FAILED {label} {spec['strategy']} W={spec['world']} T={spec['tokens_seq']}: {exc!r}", flush=True)
            continue
        quant, path = spec.get("quant"), spec.get("path", "in_kernel")
        tokens = spec["tokens_seq"]
        shape = {"tokens": tokens[-1] if len(tokens) == 1 else ",".join(map(str, tokens)), "hidden": spec["hidden"]}
        op = "all_reduce_residual_rmsnorm" if quant is None else "all_reduce_residual_rmsnorm_quant"
        extra = dict(suite_case=label, mode=mode, valid=ok, check=why, chunk=pl.chunk, num_chunks=pl.num_chunks,
                     chunk_forced=spec.get("chunk") is not None,
                     programs=programs, calls_per_stream=n, pdl=int(cfg.pdl), spin=int(cfg.spin),
                     cooperative=spec["options"].cooperative, rows_owned=bool(cfg.rows_owned),
                     per_poll=int(cfg.per_poll), per_push=int(cfg.per_push), single=bool(cfg.single))
        if quant is not None:
            extra.update(quant=quant.key, path=path)
        row = emit(op, f"{spec['strategy']}_emulated", shape, spec["dtype"], spec["world"], samples, **extra)
        results[(label, spec["strategy"], spec["world"], shape["tokens"], spec["hidden"], mode,
                 extra["pdl"], extra["spin"], quant.key if quant else None, path)] = row.median
        if not ok:
            print(f"INVALID {label} {spec['strategy']} W={spec['world']} T={tokens}: {why}", flush=True)

    # baselines in the same structure, and the parts of the TP8 estimates
    from tpfuse.kernels.epilogue import residual_rmsnorm
    from tpfuse.reference import random_inputs

    empty = {}
    for world in WORLDS:
        empty[world] = emit("empty_kernel", "triton_emulated", {"tokens": 0, "hidden": 0}, bf16, world,
                            baseline_empty(world, 40, args.reps)).median
    for t in (1, 16, 64):
        s, r = (random_inputs(i, t, H, bf16, device="cuda") for i in (0, 1))
        w = torch.ones(H, dtype=bf16, device="cuda")
        outs = (torch.empty_like(s), torch.empty_like(s))
        emit("residual_rmsnorm", "epilogue_emulated", {"tokens": t, "hidden": H}, bf16, 1,
             baseline_single(lambda: residual_rmsnorm(s, r, w, 1e-6, out=outs), 40, args.reps))
        dst = torch.empty_like(s)
        emit("device_copy", "torch_copy_emulated", {"tokens": t, "hidden": H}, bf16, 1,
             baseline_single(lambda: dst.copy_(s), 40, args.reps))
    for key, median in list(results.items()):
        label, strategy, world, tokens, hidden, mode, pdl, spin, qkey, _ = key
        decode_variant = label.startswith("pdl") or label in ("grid", "rows1", "rows0")
        if world == 8 and mode == "steady" and qkey is None and hidden == H and isinstance(tokens, int) \
                and decode_variant:
            for fabric, (lo, hi) in estimates(median, empty[8], empty[1], strategy, 8, tokens, hidden, 2).items():
                emit("estimate_tp8", f"{strategy}_{fabric}_estimated", {"tokens": tokens, "hidden": hidden}, bf16, 8,
                     [lo, hi], from_emulated_us=median, fabric=fabric, pdl=pdl, spin=spin, case=label,
                     how="emulated - (empty W=8 - empty W=1) + trips x one-way latency + bytes/bandwidth")

    if args.plot:
        plot(rows, args.plot)
    print(f"\n{len(rows)} rows in {time.time() - t0:.0f} s -> {args.out} (one GPU, W ranks emulated as W streams: "
          "no fabric)")
    print(f"{'op':<34} {'strategy':<26} {'W':>2} {'shape':<32} {'median us':>9}  case")
    for op, strategy, world, shape, dtype, med, extra in table:
        flag = "" if extra.get("valid", True) else "  INVALID"
        what = " ".join(f"{k}={extra[k]}" for k in ("suite_case", "pdl", "spin", "rows_owned", "quant", "path")
                        if k in extra)
        print(f"{op:<34} {strategy:<26} {world:>2} {json.dumps(shape):<32} {med:>9.2f}  {what}{flag}")
    return 0


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strategy, style in (("oneshot_emulated", "-o"), ("twoshot_emulated", "--s")):
        for world in WORLDS:
            pts = sorted((r.shape["tokens"], r.median) for r in rows
                         if r.strategy == strategy and r.world_size == world and r.dtype == "bfloat16"
                         and r.shape.get("hidden") == H and r.extra.get("mode") == "steady"
                         and r.extra.get("suite_case") == "grid" and r.extra.get("valid"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{strategy[:7]} W={world}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("us per call (steady, CUDA graph)")
    ax.set_title("Peer kernels, bf16 6144, one H200, W ranks as streams (no fabric)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
