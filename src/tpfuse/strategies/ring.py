"""The `ring` strategy: ring reduce-scatter + all-gather over point-to-point send/recv, in torch.

A genuinely different algorithm from `reference` (one library allreduce call): W-1 ring steps of
reduce-scatter, each rank sending one chunk to its right neighbour and adding the chunk from its
left neighbour, then W-1 steps of all-gather. For the fused op the chunks are whole rows
(tokens), so each rank applies the add + RMSNorm epilogue to the rows it owns after the
reduce-scatter and the all-gather moves finished rows: the epilogue work is split over the ranks.

Numerics: sums in fp32 (float64 for float64 inputs). Chunk c is summed in the fixed ring order
x_{c+1}, x_{c+2}, ..., x_c (indices mod W), rounded once to the input dtype by its owner, and
every other rank receives those bits, so all ranks return identical bits. The order differs from
the reference's 0..W-1, which changes nothing for exact sums (small integers) and may change the
last bit of random fp32 sums (within `reference.TOLERANCE`).

Runs wherever torch.distributed point-to-point runs: gloo on CPU, NCCL on GPUs. Gloo sends host
memory only, so CUDA tensors over a gloo group are staged through the host (no CUDA graph can
hold that: such a call refuses under capture, on every rank at the op's entry). Not fused
(`fused = False`): it is an unfused baseline that tune may choose on its own merits.

Peer failure: over gloo the exchanges run on a `HostGroup` (a private gloo group whose own timeout
is `timeout_s`: Communicator option, default TPFUSE_TIMEOUT_S) and each waits at most that long,
then raises `PeerLostError` naming the ranks that failed (the census of `tpfuse.strategies.host_wait`);
later calls refuse at once, and `close()` and process exit return within the bound. The bound is per
request, not "until the peer's socket closes": when a rank dies, only its two neighbours see the
closed socket; they raise and stop sending, and the ranks beyond them would otherwise wait for the
group's 30-minute timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.quant import KINDS
from tpfuse.reference import accumulation_dtype, residual_rmsnorm_quant_ref, residual_rmsnorm_ref
from tpfuse.spec import Needs
from tpfuse.strategies.base import Strategy
from tpfuse.strategies.host_wait import HostGroup, PeerGuard, goes_through_host, refuse_capture, strategy_timeout_s


class RingStrategy(Strategy):
    name = "ring"
    description = "ring reduce-scatter + all-gather over send/recv (fp32 sums, rows split for the epilogue)"
    fused = False
    needs = Needs(quant=KINDS)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._stage = ctx.device.type == "cuda" and "nccl" not in str(dist.get_backend(ctx.group)).lower()
        self._right = dist.get_global_rank(ctx.group, (ctx.rank + 1) % ctx.world_size)
        self._left = dist.get_global_rank(ctx.group, (ctx.rank - 1) % ctx.world_size)
        left, right = (ctx.rank - 1) % ctx.world_size, (ctx.rank + 1) % ctx.world_size
        self._peers = f"rank {left} (left neighbour) and rank {right} (right neighbour)"
        self._left_local, self._right_local = left, right
        timeout_s = strategy_timeout_s(ctx.options, self.name)
        bounded = goes_through_host(ctx.group, ctx.device)
        self._host = HostGroup(ctx.group, timeout_s, self.name) if bounded and ctx.world_size > 1 else None
        self._guard = PeerGuard(self.name, ctx.rank, timeout_s, bounded=bounded, host_group=self._host)

    def check(self) -> None:
        self._guard.check()

    def close(self) -> None:
        self._guard.close()
        self._host = None

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Send `send` to the right neighbour while receiving `recv` from the left one."""
        self._guard.check()
        if send.numel() == 0 and recv.numel() == 0:
            return  # both sides know the sizes, so both skip the empty exchange
        wire_send = send.cpu() if self._stage else send
        wire_recv = torch.empty_like(recv, device="cpu") if self._stage else recv
        requests = []
        if self._host is not None:  # the private gloo group, group-local ranks
            if wire_send.numel():
                requests.append(self._host.pg.send([wire_send.contiguous()], self._right_local, 0))
            if wire_recv.numel():
                requests.append(self._host.pg.recv([wire_recv], self._left_local, 0))
        else:
            ops = []
            if wire_send.numel():
                ops.append(dist.P2POp(dist.isend, wire_send.contiguous(), self._right, self.ctx.group))
            if wire_recv.numel():
                ops.append(dist.P2POp(dist.irecv, wire_recv, self._left, self.ctx.group))
            requests = dist.batch_isend_irecv(ops)
        self._guard.wait(requests, self._peers)
        if self._stage and recv.numel():
            recv.copy_(wire_recv)

    def _reduce_scatter(self, chunks: list[torch.Tensor]) -> int:
        """Sum chunks in place around the ring; returns the index of the chunk this rank owns."""
        w, r = self.ctx.world_size, self.ctx.rank
        for step in range(w - 1):
            send_idx = (r - step - 1) % w
            recv_idx = (r - step - 2) % w
            incoming = torch.empty_like(chunks[recv_idx])
            self._exchange(chunks[send_idx], incoming)
            chunks[recv_idx] = incoming + chunks[recv_idx]
        return r  # after W-1 steps chunk r holds x_{r+1} + ... + x_r

    def _all_gather(self, chunks: list[torch.Tensor]) -> None:
        w, r = self.ctx.world_size, self.ctx.rank
        for step in range(w - 1):
            send_idx = (r - step) % w
            recv_idx = (r - step - 1) % w
            incoming = torch.empty_like(chunks[recv_idx])
            self._exchange(chunks[send_idx], incoming)
            chunks[recv_idx] = incoming

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self._stage:
            refuse_capture(self.name)
        acc = x.to(accumulation_dtype(x.dtype)).reshape(-1)
        if self.ctx.world_size == 1:
            return acc.to(x.dtype).view(x.shape)
        chunks = [c.clone() for c in torch.tensor_split(acc, self.ctx.world_size)]
        own = self._reduce_scatter(chunks)
        chunks[own] = chunks[own].to(x.dtype)  # the owner rounds once; peers receive these bits
        for i in range(len(chunks)):
            if i != own:
                chunks[i] = torch.empty_like(chunks[i], dtype=x.dtype)
        self._all_gather(chunks)
        return torch.cat(chunks).view(x.shape)

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps, *, quant=None):
        if self._stage:
            refuse_capture(self.name)
        if quant is not None:
            # Quantized rows mix codes and scales of other shapes, so the ring all-gathers the sum
            # (the plain allreduce) and every rank quantizes all rows with the reference.
            return residual_rmsnorm_quant_ref(self.all_reduce(x), residual, weight, eps, quant)
        w = self.ctx.world_size
        acc = x.to(accumulation_dtype(x.dtype))
        if w == 1:
            return residual_rmsnorm_ref(acc.to(x.dtype), residual, weight, eps)
        rows = [c.clone() for c in torch.tensor_split(acc, w, dim=0)]
        own = self._reduce_scatter(rows)
        bounds = torch.tensor_split(torch.arange(x.shape[0]), w)
        mine = bounds[own]
        res_rows = residual[mine[0]: mine[-1] + 1] if residual is not None and mine.numel() else (
            residual[:0] if residual is not None else None)
        normed_own, new_res_own = residual_rmsnorm_ref(rows[own].to(x.dtype), res_rows, weight, eps)
        # Gather normed and new_residual together: one ring pass over [normed | new_residual] rows.
        hidden = x.shape[1]
        both = [torch.empty(len(b), 2 * hidden, dtype=x.dtype, device=x.device) for b in bounds]
        both[own] = torch.cat([normed_own, new_res_own], dim=1)
        self._all_gather(both)
        out = torch.cat(both)
        return out[:, :hidden].contiguous(), out[:, hidden:].contiguous()
