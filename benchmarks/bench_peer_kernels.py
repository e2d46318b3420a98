"""Intrinsic latency of the peer kernels on ONE GPU, with W ranks emulated as W CUDA streams.

    python benchmarks/bench_peer_kernels.py --out benchmarks/results/peer_kernels_emulated.jsonl --plot FILE.png

Every rank's buffer, state and error words live on the one GPU; rank r's calls run on stream r
through the real launchers (`oneshot_launch`, `twoshot_launch`), which take any object with the
workspace's fields. All streams' calls are captured in one CUDA graph and replayed, in two modes:
`steady` (each stream issues N calls back to back after one fork; per call = elapsed / N) and
`aligned` (a fork and a join around every call). The grid of each rank is at most SMs // W, so
all ranks' programs are resident together. Baselines in the same run: an empty kernel in the same
stream structure, the epilogue kernel alone on one stream, and a device copy of the input.
`alternating` issues 128 tokens then 1 token per pair of calls (the re-arm cost of a large call
falls on the next one) and is compared with the two steady calls.

What the emulation leaves out, and its bias: no fabric. Pushes to "peers" are stores to the same
GPU's memory, so fabric latency and bandwidth (NVLink about 1-2 us per hop; PCIe more) and the
system-scope visibility of remote stores are absent; polls see stores through the one L2. So these
figures are a floor for a real multi-GPU call: they measure the kernels' own instruction and
synchronisation cost. The W ranks also share one GPU's SMs and memory bandwidth, which biases
large calls (W x the traffic of one rank on one memory system) upwards.

After timing, the outputs of a final replay (poisoned with NaN before it) are checked against a
float64 reference, every rank's bits against rank 0's, and every error word must be zero: a
timed-out workspace runs fast and writes NaN, so such a row is marked invalid, never reported as
a time. Every row carries `"emulated": true` in `extra`.

The graph here forks W streams and joins them inside one capture, which `tpfuse.timing.capture`
(one stream) does not do, so the capture and its replay timer are this file's own; the statistics
of every row are `tpfuse.timing.summary`'s (through `tpfuse.results.make_row`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import torch

from tpfuse.results import append_rows, make_row

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WORLDS = (1, 2, 4, 8)


@dataclass
class Peers:
    views: tuple
    rank: int

    @property
    def local(self):
        return self.views[self.rank]


@dataclass
class EmulatedWorkspace:
    """The fields the launchers read, for rank `rank` of W ranks whose buffers share one GPU."""

    peers: Peers
    rank: int
    state: torch.Tensor
    err: torch.Tensor
    partials: torch.Tensor
    region_elems: int
    header_elems: int
    sentinel: int


def make_workspaces(world: int, dtype, region_elems: int, num_regions: int) -> list[EmulatedWorkspace]:
    from tpfuse.kernels.protocol import (
        ERR_WORDS,
        HEADER_BYTES,
        NUM_SLOTS,
        SENTINEL_BITS,
        STATE_WORDS,
        partials_len,
        round_region,
    )

    region = round_region(region_elems)
    header = HEADER_BYTES // dtype.itemsize
    bits = torch.int16 if dtype.itemsize == 2 else torch.int32
    bufs = []
    for _ in range(world):
        b = torch.empty(header + NUM_SLOTS * num_regions * region, dtype=dtype, device="cuda")
        b.view(bits).fill_(SENTINEL_BITS[dtype.itemsize])
        b[:header].view(torch.int32).zero_()
        bufs.append(b)
    return [EmulatedWorkspace(Peers(tuple(bufs), r), r, torch.zeros(STATE_WORDS, dtype=torch.int32, device="cuda"),
                              torch.zeros(ERR_WORDS, dtype=torch.int32, device="cuda"),
                              torch.full((partials_len(region, dtype.itemsize),), -1, dtype=torch.int64, device="cuda"),
                              region, header, SENTINEL_BITS[dtype.itemsize]) for r in range(world)]


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
    """One (strategy, W, tokens sequence, hidden, dtype) setup with its inputs and outputs."""

    def __init__(self, strategy: str, world: int, tokens_seq: tuple, hidden: int, dtype, *, chunk=None, quant=None,
                 path="in_kernel"):
        from tpfuse.kernels.oneshot import oneshot_launch
        from tpfuse.kernels.protocol import Plan, make_plan, region_elems_for
        from tpfuse.kernels.twoshot import twoshot_launch
        from tpfuse.reference import random_inputs

        self.launch = oneshot_launch if strategy == "oneshot" else twoshot_launch
        self.world, self.hidden, self.dtype, self.tokens_seq = world, hidden, dtype, tokens_seq
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.max_programs = max(1, sms // world)
        self.plan_programs = self.max_programs

        def plan_for(m):
            if chunk is None:
                return make_plan(m, hidden, dtype.itemsize, self.plan_programs)
            nc = -(-hidden // chunk)
            return Plan(chunk, nc, m * nc, max(1, chunk * dtype.itemsize // 512))

        self.plans = {m: plan_for(m) for m in set(tokens_seq)}
        need = max(region_elems_for(m, hidden, world, p, twoshot=strategy == "twoshot") for m, p in self.plans.items())
        self.ws = make_workspaces(world, dtype, need, world + (strategy == "twoshot"))
        mmax = max(tokens_seq)
        self.xs = [random_inputs(r, mmax, hidden, dtype, seed=hidden, device="cuda") for r in range(world)]
        self.res = random_inputs(100, mmax, hidden, dtype, seed=hidden, device="cuda")
        self.w = (1 + 0.1 * random_inputs(101, 1, hidden, torch.float32, seed=hidden)[0]).to(dtype).cuda()
        self.outs = [(torch.empty(mmax, hidden, dtype=dtype, device="cuda"), torch.empty(mmax, hidden, dtype=dtype, device="cuda"))
                     for _ in range(world)]
        self.quant, self.path = quant, path  # quantized output: in the peer kernel, or by the epilogue after it
        self.last = [None] * world  # each rank's latest QuantOutput (the captured call's, after capture)

    def call(self, rank: int, j: int) -> None:
        m = self.tokens_seq[j % len(self.tokens_seq)]
        out = self.outs[rank]
        if self.quant is not None:
            self.last[rank] = self.call_quantized(rank, m)
            return
        self.launch(self.xs[rank][:m], self.res[:m], self.w, 1e-6, self.ws[rank], timeout_s=5.0,
                    max_programs=self.max_programs, plan_programs=self.plan_programs,
                    out=(out[0][:m], out[1][:m]), plan=self.plans[m])

    def compile_epilogue(self) -> None:
        """Compile the quantizing epilogue before any peer call: a rank that compiled it between
        its peer kernels would keep its peers spinning past their timeout."""
        from tpfuse.kernels.epilogue import residual_rmsnorm

        if self.quant is not None and self.path == "two_kernels":
            for m in set(self.tokens_seq):
                residual_rmsnorm(self.xs[0][:m], self.res[:m], self.w, 1e-6, quant=self.quant)
        torch.cuda.synchronize()

    def call_quantized(self, rank: int, m: int):
        from tpfuse.kernels.epilogue import residual_rmsnorm

        kw = dict(timeout_s=5.0, max_programs=self.max_programs, plan_programs=self.plan_programs, plan=self.plans[m])
        x, ws = self.xs[rank][:m], self.ws[rank]
        if self.path == "in_kernel":
            return self.launch(x, self.res[:m], self.w, 1e-6, ws, quant=self.quant, **kw)
        s = self.launch(x, None, None, 0.0, ws, has_norm=False, out=(self.outs[rank][0][:m], None), **kw)[0]
        return residual_rmsnorm(s, self.res[:m], self.w, 1e-6, quant=self.quant)

    def check_quantized(self, m: int) -> tuple[bool, str]:
        """Every rank's bits equal rank 0's; rank 0 against the reference quantizer of the fp32
        rank-order sum (new residual exact; scales and codes within the one-step rule of
        tests/kernels/test_quant.py: the sum of squares is a tree in the kernel and
        sequential in torch, so a row's fp32 values may differ by an ulp)."""
        from tpfuse.reference import all_reduce_residual_rmsnorm_quant_ref

        got = [tuple(t.contiguous().view(torch.uint8).cpu() if t is not None else None for t in q) for q in self.last]
        for rank in range(1, self.world):
            if any((a is None) != (b is None) or (a is not None and not torch.equal(a, b)) for a, b in zip(got[rank], got[0])):
                return False, f"rank {rank} quantized bits differ from rank 0"
        q = self.last[0]
        ref = all_reduce_residual_rmsnorm_quant_ref([x[:m].cpu() for x in self.xs], self.res[:m].cpu(), self.w.cpu(), 1e-6,
                                                    self.quant)
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
        for rank, (normed, new_res) in enumerate(self.outs):
            if not torch.equal(normed[:m].view(torch.int16 if self.dtype.itemsize == 2 else torch.int32),
                               self.outs[0][0][:m].view(torch.int16 if self.dtype.itemsize == 2 else torch.int32)):
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
                    t.fill_(float("nan")) if t.is_floating_point() and t.element_size() > 1 else t.view(torch.uint8).fill_(0x7F)


def ordinal(codes, nibbles: bool):
    """Signed grid positions of e4m3 codes (or of packed e2m1 nibbles): adjacent values differ by one."""
    c = codes.contiguous().view(torch.uint8).to(torch.int32)
    if nibbles:
        c = torch.stack([c & 0xF, c >> 4], dim=-1)
        return torch.where(c >= 8, -(c - 8), c)
    return torch.where(c >= 0x80, -(c - 0x80), c)


def run_case(strategy, world, tokens_seq, hidden, dtype, mode, n, reps, chunk=None, quant=None, path="in_kernel"):
    case = Case(strategy, world, tokens_seq, hidden, dtype, chunk=chunk, quant=quant, path=path)
    case.compile_epilogue()
    streams = [torch.cuda.Stream() for _ in range(world)]
    calls = [lambda j, r=r: case.call(r, j) for r in range(world)]
    for j in range(len(tokens_seq)):  # eager warm-up: compiles every size, runs the protocol once
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
    plan = case.plans[tokens_seq[-1]]
    return samples, ok, why, plan, min(plan.items, case.max_programs)


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON-lines file for the result rows")
    parser.add_argument("--plot", help="PNG of per-call latency against tokens (steady, bf16, hidden 6144)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new cases after this long")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="hidden 6144 bf16, W in 1/2/8, tokens 1/16/64 only")
    parser.add_argument("--quant-first", action="store_true",
                        help="run the quantized-output cases before the unquantized grid (they run last otherwise)")
    args = parser.parse_args(argv)
    t0 = time.time()
    rows, table = [], []
    bf16 = torch.bfloat16

    def emit(op, strategy, shape, dtype, world, samples, **extra):
        row = make_row(op, strategy, shape, str(dtype).replace("torch.", ""), world, samples, "us", emulated=True, **extra)
        rows.append(row)
        append_rows(args.out, [row])
        label = op if "quant" not in extra else f"quant {extra['quant']} {extra['path']}"
        table.append((label, strategy, world, shape, dtype, row.median, extra.get("valid", True)))

    def peer(strategy, world, tokens_seq, hidden, dtype, mode="steady", chunk=None, label=None, quant=None,
             path="in_kernel"):
        if time.time() - t0 > args.budget_s:
            return None
        n = 40 if max(tokens_seq) <= 64 else 16
        try:
            samples, ok, why, plan, programs = run_case(strategy, world, tokens_seq, hidden, dtype, mode, n, args.reps,
                                                        chunk, quant, path)
        except Exception as exc:  # a case that cannot run is a finding, not the end of the run
            print(f"FAILED {strategy} W={world} T={tokens_seq} H={hidden} {dtype} {mode} {quant}: {exc!r}", flush=True)
            return None
        shape = {"tokens": tokens_seq[-1] if label is None else label, "hidden": hidden}
        op = "all_reduce_residual_rmsnorm" if quant is None else "all_reduce_residual_rmsnorm_quant"
        qextra = {} if quant is None else {"quant": quant.key, "path": path}
        if quant is not None and quant.kind in ("fp8_static", "nvfp4"):
            qextra["scale_arg"] = "tensor" if isinstance(quant.scale, torch.Tensor) else "float"
        emit(op, strategy, shape, dtype, world, samples, mode=mode, valid=ok, check=why,
             chunk=plan.chunk, num_chunks=plan.num_chunks, programs=programs, calls_per_stream=n,
             chunk_forced=chunk is not None, **qextra)
        if not ok:
            print(f"INVALID {strategy} W={world} T={tokens_seq} H={hidden}: {why}", flush=True)
        return rows[-1].median

    tokens = (1, 16, 64) if args.quick else TOKENS
    worlds = (1, 2, 8) if args.quick else WORLDS

    def quantized():
        """Quantized output: in the peer kernel against the peer allreduce + quantizing epilogue,
        beside the unquantized call: hidden 6144 at W = 8 and 2, hidden 7168 at W = 8."""
        from tpfuse import quant as Q

        # static and global scales as device tensors, as engines hold them (a float scale costs a
        # fill kernel per call to become the returned fp32 tensor)
        scale = torch.full((1,), 0.05, device="cuda")
        global_scale = torch.full((1,), 40.0, device="cuda")
        specs = (Q.fp8_static(scale), Q.fp8_per_token(), Q.fp8_per_group(128, layout="col"), Q.nvfp4(global_scale))
        for hidden, worlds_q in ((6144, (8, 2)), (7168, (8,))):
            for world in worlds_q:
                for t in (1, 16, 64):
                    peer("oneshot", world, (t,), hidden, bf16)
                    for spec in specs:
                        for path in ("in_kernel", "two_kernels"):
                            peer("oneshot", world, (t,), hidden, bf16, quant=spec, path=path)
                if world == 8:  # what a float scale costs: its fill kernel on every call
                    peer("oneshot", world, (1,), hidden, bf16, quant=Q.fp8_static(0.05))
                for spec in specs[1:2]:
                    for t in (1, 16):
                        for path in ("in_kernel", "two_kernels"):
                            peer("twoshot", world, (t,), hidden, bf16, quant=spec, path=path)

    if args.quant_first:
        quantized()
    # 1. the main grid: hidden 6144, bf16, steady
    for world in worlds:
        for strategy in ("oneshot", "twoshot"):
            if strategy == "twoshot" and world == 1:
                continue
            for t in tokens:
                peer(strategy, world, (t,), 6144, bf16)
    # 2. baselines in the same structure
    from tpfuse.kernels.epilogue import residual_rmsnorm
    from tpfuse.reference import random_inputs

    for world in worlds:
        emit("empty_kernel", "triton", {"tokens": 0, "hidden": 0}, bf16, world, baseline_empty(world, 40, args.reps))
    for t in (1, 16, 64):
        s, r = (random_inputs(i, t, 6144, bf16, device="cuda") for i in (0, 1))
        w = torch.ones(6144, dtype=bf16, device="cuda")
        outs = (torch.empty_like(s), torch.empty_like(s))
        emit("residual_rmsnorm", "epilogue", {"tokens": t, "hidden": 6144}, bf16, 1,
             baseline_single(lambda: residual_rmsnorm(s, r, w, 1e-6, out=outs), 40, args.reps))
        dst = torch.empty_like(s)
        emit("device_copy", "torch_copy", {"tokens": t, "hidden": 6144}, bf16, 1,
             baseline_single(lambda: dst.copy_(s), 40, args.reps))
    # 3. aligned mode and the alternating-size case
    for world in (2, 8):
        for strategy in ("oneshot", "twoshot"):
            for t in (1, 16, 64):
                peer(strategy, world, (t,), 6144, bf16, mode="aligned")
            peer(strategy, world, (128, 1), 6144, bf16, label="128,1")
            peer(strategy, world, (128,), 6144, bf16)
    # 4. chunk sizes against the plan at W=8
    for t in (1, 16, 64):
        for chunk in (256, 512, 1024, 2048):
            peer("oneshot", 8, (t,), 6144, bf16, chunk=chunk)
    # 5. other hidden sizes and fp16
    for hidden in (4096, 7168, 8192):
        for strategy in ("oneshot", "twoshot"):
            for t in (1, 16, 64):
                peer(strategy, 8, (t,), hidden, bf16)
    for strategy in ("oneshot", "twoshot"):
        for t in (1, 16, 64):
            peer(strategy, 8, (t,), 6144, torch.float16)
    for world in (2, 4):
        for hidden in (4096, 7168, 8192):
            for t in (1, 64):
                peer("oneshot", world, (t,), hidden, bf16)

    if not args.quant_first:
        quantized()
    if args.plot:
        plot(rows, args.plot)
    print(f"\n{len(rows)} rows in {time.time() - t0:.0f} s -> {args.out} (one GPU, W ranks emulated as W streams: no fabric)")
    print(f"{'op':<44} {'strategy':<9} {'W':>2} {'shape':<30} {'dtype':<9} {'median us':>9}")
    for op, strategy, world, shape, dtype, med, ok in table:
        flag = "" if ok else "  INVALID"
        print(f"{op:<44} {strategy:<9} {world:>2} {json.dumps(shape):<30} {str(dtype)[6:]:<9} {med:>9.2f}{flag}")
    return 0


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strategy, style in (("oneshot", "-o"), ("twoshot", "--s")):
        for world in WORLDS:
            pts = sorted((r.shape["tokens"], r.median) for r in rows
                         if r.strategy == strategy and r.world_size == world and r.dtype == "bfloat16"
                         and r.shape.get("hidden") == 6144 and r.extra.get("mode") == "steady"
                         and isinstance(r.shape["tokens"], int) and not r.extra.get("chunk_forced") and r.extra.get("valid"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{strategy} W={world}")
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
