"""Host cost of the ways to enter NCCL for `nccl_epilogue`'s allreduce, beside a bare epilogue launch.

One process, an NCCL group of one rank on GPU 0 (no peer, no fabric: the host path only), bf16
rows of 6144, eager us/call (`bench_host_path.py`'s sampler: back-to-back calls, synchronised per
sample, rounds interleaved). Variants, each followed by the pre-bound epilogue launch
(`tpfuse.kernels.epilogue.launch_residual_rmsnorm`) unless named "alone":
- `dist.all_reduce`: clone, then torch.distributed's all_reduce (what nccl_epilogue does);
- `backend.allreduce`: clone, then the process group's allreduce with options built once;
- `functional`: c10d's out-of-place functional all_reduce and its wait;
- `ctypes`: out-of-place ncclAllReduce on a communicator of this process, through ctypes.
Every variant's output is checked against the bare epilogue's on the same inputs (one rank: the
sum is the input, so the bits must be equal).

    python benchmarks/device/nccl_entry_probe.py --out $OUT/nccl_entry.jsonl
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_host_path import _eager_sampler, _inputs  # noqa: E402
from tpfuse.results import append_rows, make_row  # noqa: E402
from tpfuse.timing import sample_rounds  # noqa: E402

NCCL_BF16, NCCL_SUM = 9, 0


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def _nccl():
    lib = ctypes.CDLL("libnccl.so.2")  # the one torch loaded
    lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_void_p]
    lib.ncclAllReduce.restype = ctypes.c_int
    uid = _UniqueId()
    assert lib.ncclGetUniqueId(ctypes.byref(uid)) == 0
    comm = ctypes.c_void_p()
    assert lib.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0) == 0
    return lib, comm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    from tpfuse.kernels.epilogue import launch_residual_rmsnorm

    group = dist.group.WORLD
    backend = group._get_backend(torch.device("cuda", 0))
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    opts.asyncOp = False
    lib, comm = _nccl()
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    functional = torch.ops._c10d_functional
    name = group.group_name
    rows = []
    for tokens in args.tokens:
        x, residual, weight = _inputs(tokens, torch.device("cuda", 0))
        n = x.numel()

        def via_dist():
            y = x.clone()
            dist.all_reduce(y, group=group)
            return y

        def via_backend():
            y = x.clone()
            backend.allreduce([y], opts)
            return y

        def via_functional():
            return functional.wait_tensor(functional.all_reduce(x, "sum", name))

        def via_ctypes():
            y = torch.empty_like(x)
            lib.ncclAllReduce(x.data_ptr(), y.data_ptr(), n, NCCL_BF16, NCCL_SUM, comm, raw_stream(0))
            return y

        entries = {"dist.all_reduce": via_dist, "backend.allreduce": via_backend, "functional": via_functional,
                   "ctypes": via_ctypes}
        variants = {"bare_epilogue_launch": lambda: launch_residual_rmsnorm(x, residual, weight, 1e-6)}
        for label, entry in entries.items():
            variants[f"{label}+epilogue"] = lambda e=entry: launch_residual_rmsnorm(e(), residual, weight, 1e-6)
            variants[f"{label} alone"] = entry
        variants["torch.add"] = lambda: torch.add(x, residual)
        want = launch_residual_rmsnorm(x, residual, weight, 1e-6)
        checked = {}
        for label, call in variants.items():
            if label.endswith("+epilogue"):
                got = call()
                checked[label] = bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
        samplers = {}
        for label, call in variants.items():
            for _ in range(20):
                call()
            samplers[label], _ = _eager_sampler(call, args.calls, x.device, lambda: 0)
        eager = sample_rounds(samplers, args.rounds)
        bare = sorted(eager["bare_epilogue_launch"])[len(eager["bare_epilogue_launch"]) // 2]
        for label, samples in eager.items():
            median = sorted(samples)[len(samples) // 2]
            rows.append(make_row("nccl_entry", label, {"tokens": tokens, "hidden": x.shape[1]}, "bfloat16", 1,
                                 samples, "us", mode="eager", ratio_to_bare=median / bare,
                                 checked=checked.get(label), calls_per_sample=args.calls,
                                 note="one rank, one GPU: host path only, no peer or fabric"))
            print(f"{tokens:>4} {label:28} {median:8.2f} us  x{median / bare:5.2f}  {checked.get(label, '')}")
    append_rows(args.out, rows)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
