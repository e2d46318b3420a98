"""Peer-visible workspace of the fused collectives, and the protocol that makes reuse safe.

Memory. Each rank allocates one buffer and maps every peer's: on CUDA through PyTorch symmetric
memory (`torch.distributed._symmetric_memory.empty` + `rendezvous`: a cuMem allocation whose
POSIX-FD handle is passed to the peers over a Unix socket and mapped into their contexts; works
between GPUs with peer access and between processes sharing one GPU), on CPU (Triton interpreter
tests) through a shared-memory file per rank whose name is exchanged over the process group. The
process group only carries handles and setup/teardown barriers; the data path is the mapped
pointers. Only this module's buffers and state are used (never torch's signal pads, which use
remote compare-and-swap).

Protocol (Lamport, "the data is the flag"; kernels in fusegate.kernels.{oneshot,twoshot,sync}):
- The buffer holds 3 slots; a slot holds `num_regions` regions of `region_elems` elements. Every
  element of every slot starts as the sentinel (-0.0). Writers canonicalise -0.0 to +0.0, then
  store data into peers' slots with plain remote stores; readers poll their *own* buffer with
  volatile loads until no element of the row is the sentinel. No flags, no remote atomics: only
  posted writes cross the fabric, which PCIe P2P supports.
- Call k uses slot k % 3 and re-arms (refills with the sentinel) this rank's slot (k-1) % 3,
  exactly the extent call k-1 wrote. A peer writes into that slot again only at call k+2, which it
  cannot start before it has read this rank's call-k+1 data, which is pushed after this rank's
  call k (re-arm included) finished on its stream. So no buffer is overwritten while it may be read.
- Device state (int32, local, advanced by the kernels so CUDA graphs replay correctly):
  [slot, extent A of the last call, extent B of the last call, arrival counter, call counter].
  The program that arrives last (atomic counter) advances it; no program waits for another
  program of its own launch. The call counter grows by one per call (monotonic epoch; modulo 2^31).
- Bounded waits: a poll gives up at a deadline (FUSEGATE_TIMEOUT_S, or the `timeout_s` option).
  It then records err = [1, bitmask of peers that never arrived, row, call], writes NaN into the
  rows it could not finish (never silently wrong data) and exits. The error is sticky: the
  workspace is unusable afterwards, and the next eager call (or `check()`, which synchronises)
  raises PeerTimeoutError naming the ranks. Under CUDA graph replay call `check()` yourself.

Concurrency: one workspace serves one stream; every rank must issue the same calls in the same
order (a collective). Allocation, rendezvous and the sentinel fill happen outside graph capture.
`close()` is collective and explicit; nothing is released in `__del__`.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

NUM_SLOTS = 3  # Lamport rotation: current, being re-armed, clean for the next call
STATE_SLOT, STATE_EXTENT_A, STATE_EXTENT_B, STATE_ARRIVE, STATE_CALLS = range(5)
STATE_WORDS = 8
ERR_WORDS = 4
SENTINEL_BITS = {2: -(1 << 15), 4: -(1 << 31)}  # -0.0 by element size; see fusegate.kernels.sync


class PeerTimeoutError(RuntimeError):
    """A peer's data never arrived within the spin timeout; `ranks` are the peers waited on."""

    def __init__(self, where: str, rank: int, ranks: list[int], row: int, call: int, timeout_s: float) -> None:
        self.ranks = ranks
        names = ", ".join(str(r) for r in ranks)
        super().__init__(
            f"{where}: rank {rank} waited {timeout_s:g} s for data from rank(s) {names} "
            f"(row {row}, call {call}) that never arrived; every rank must make the same calls in the "
            "same order. The workspace is now unusable: close the Communicator on every rank and "
            "create a new one (raise FUSEGATE_TIMEOUT_S if the peers are only slow)."
        )


@dataclass
class PeerBuffers:
    """One buffer per rank, each mapped in this process: `views[r]` aliases rank r's buffer."""

    views: tuple[torch.Tensor, ...]
    rank: int
    release: Callable[[], None]

    @property
    def local(self) -> torch.Tensor:
        return self.views[self.rank]


def open_peer_buffers(numel: int, dtype: torch.dtype, *, group, rank: int, world_size: int, device: torch.device) -> PeerBuffers:
    """Collective: allocate `numel` elements on this rank and map every rank's buffer."""
    if device.type == "cuda":
        return _symmetric_buffers(numel, dtype, group=group, rank=rank, world_size=world_size, device=device)
    return _shm_buffers(numel, dtype, group=group, rank=rank, world_size=world_size)


def _symmetric_buffers(numel, dtype, *, group, rank, world_size, device) -> PeerBuffers:
    import torch.distributed._symmetric_memory as symm_mem

    local = symm_mem.empty(numel, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(local, group)
    views = tuple(local if r == rank else handle.get_buffer(r, (numel,), dtype) for r in range(world_size))
    holder = [handle, local]

    def release() -> None:
        holder.clear()

    return PeerBuffers(views, rank, release)


def _shm_buffers(numel, dtype, *, group, rank, world_size) -> PeerBuffers:
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
    names = [os.path.join(shm_dir, f"fusegate-{token[0]}-{r}") for r in range(world_size)]
    local = torch.from_file(names[rank], shared=True, size=numel, dtype=dtype)
    dist.barrier(group=group)
    views = tuple(local if r == rank else torch.from_file(names[r], shared=True, size=numel, dtype=dtype) for r in range(world_size))
    dist.barrier(group=group)
    os.unlink(names[rank])  # the mappings stay valid; nothing is left behind if a rank dies later
    return PeerBuffers(views, rank, lambda: None)


class LamportWorkspace:
    """Peer buffers + device state for one (stream, dtype); see the module docstring.

    `region_elems` bounds the elements one rank contributes per region per call (tokens x hidden).
    """

    def __init__(self, *, group, rank: int, world_size: int, device: torch.device, dtype: torch.dtype,
                 region_elems: int, num_regions: int, timeout_s: float, where: str, shares_device: bool = False) -> None:
        if dtype.itemsize not in SENTINEL_BITS:
            raise TypeError(f"{where}: dtype {dtype} has no sentinel; use bfloat16, float16 or float32")
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        self.dtype, self.timeout_s, self.where = dtype, float(timeout_s), where
        align = 64  # elements: keeps every region 128-byte aligned for 16-byte vector accesses
        self.region_elems = -(-int(region_elems) // align) * align
        self.num_regions = num_regions
        if device.type == "cuda" and shares_device:
            # symmetric memory refuses two ranks on one GPU unless told that it is intended
            os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
        numel = NUM_SLOTS * num_regions * self.region_elems
        self.peers = open_peer_buffers(numel, dtype, group=group, rank=rank, world_size=world_size, device=device)
        bits = torch.int16 if dtype.itemsize == 2 else torch.int32
        self.peers.local.view(bits).fill_(SENTINEL_BITS[dtype.itemsize])
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int32, device=device)
        self.err = torch.zeros(ERR_WORDS, dtype=torch.int32, device=device)
        self._err_host = torch.zeros(ERR_WORDS, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._closed = False
        self._barrier()

    @property
    def sentinel(self) -> int:
        return SENTINEL_BITS[self.dtype.itemsize]

    def fits(self, elems: int) -> bool:
        return elems <= self.region_elems

    def before_call(self) -> None:
        """Raise PeerTimeoutError if an earlier call on this rank timed out (reads host memory only)."""
        if self._closed:
            raise RuntimeError(f"{self.where}: workspace used after close(); create a new Communicator")
        self._raise_from(self.err if self.device.type == "cpu" else self._err_host)

    def after_call(self) -> None:
        """Queue a copy of the error words to pinned host memory (eager calls; no host sync)."""
        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            self._err_host.copy_(self.err, non_blocking=True)

    def check(self) -> None:
        """Synchronise this rank's device and raise PeerTimeoutError if any call timed out."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._raise_from(self.err)

    def _raise_from(self, err: torch.Tensor) -> None:
        words = err.tolist()
        if words[0] != 0:
            ranks = [r for r in range(self.world_size) if words[1] >> r & 1]
            raise PeerTimeoutError(self.where, self.rank, ranks, words[2], words[3], self.timeout_s)

    def _barrier(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Collective: wait until no rank's kernel can still touch the buffers, then release them."""
        if self._closed:
            return
        self._closed = True
        self._barrier()
        self.peers.release()
        self.peers = None  # type: ignore[assignment]

