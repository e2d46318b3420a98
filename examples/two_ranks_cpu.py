"""Two ranks on the CPU: tpfuse's fused allreduce + residual-add + RMSNorm, checked against tpfuse.reference.

    python examples/two_ranks_cpu.py
"""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tpfuse
from tpfuse.reference import TOLERANCE, all_reduce_ref, all_reduce_residual_rmsnorm_ref, relative_error

TOKENS, HIDDEN, EPS = 4, 1024, 1e-6


def partial_sum(rank: int) -> torch.Tensor:
    """What rank `rank` holds before the allreduce: its partial sum of a row-parallel layer."""
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)


def run(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    comm = tpfuse.Communicator()  # the world group; strategy="auto": the tuned table, else the default
    torch.manual_seed(1234)  # the residual and the norm weight are the same on every rank
    residual = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(HIDDEN)).to(torch.bfloat16)
    x = partial_sum(rank)

    normed, new_residual = comm.all_reduce_residual_rmsnorm(x, residual, weight, eps=EPS)
    total = comm.all_reduce(x)  # the sum alone, out of place
    comm.close()

    # The same ops in float64 from every rank's input, as tpfuse.reference defines them.
    xs = [partial_sum(r).double() for r in range(world_size)]
    want_normed, want_residual = all_reduce_residual_rmsnorm_ref(xs, residual.double(), weight.double(), EPS)
    for name, got, want in (("normed", normed, want_normed), ("new residual", new_residual, want_residual),
                            ("sum", total, all_reduce_ref(xs))):
        error = relative_error(got, want)
        assert error <= TOLERANCE[torch.bfloat16], f"rank {rank}: {name} is off by {error:.1e}"
    if rank == 0:
        print(f"ok: {world_size} ranks, {TOKENS}x{HIDDEN} bfloat16, within {TOLERANCE[torch.bfloat16]:.1e} of float64")
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:  # a free port on this machine for the ranks to meet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(2, port), nprocs=2)
