"""Peer-visible workspace of the fused collectives, and the protocol that makes reuse safe.

Memory. Each rank allocates one buffer and maps every peer's: on CUDA through PyTorch symmetric
memory (`torch.distributed._symmetric_memory.empty` + `rendezvous`: a cuMem allocation whose
POSIX-FD handle is passed to the peers over a Unix socket and mapped into their contexts; works
between GPUs with peer access and between processes sharing one GPU), on CPU (Triton interpreter
tests) through a shared-memory file per rank whose name is exchanged over the process group. The
process group only carries handles and setup/teardown barriers; the data path is the mapped
pointers. Only this module's buffers and state are used (never torch's signal pads, which use
remote compare-and-swap).

Protocol (Lamport, "the data is the flag"; kernels in tpfuse.kernels.{oneshot,twoshot,sync},
constants, layout and the argument for two slots in tpfuse.kernels.protocol):
- Every element of both slots starts as the sentinel (-0.0). Writers canonicalise -0.0 to +0.0,
  then store data into peers' slots with plain remote stores; readers poll their *own* buffer with
  volatile loads until no element is the sentinel, then re-arm exactly what they read. No flags,
  no remote atomics: only posted writes cross the fabric, which PCIe P2P supports.
- Device state (int32, local): [epoch (calls), arrivals]; the last program to arrive advances
  the epoch, so CUDA graphs replay correctly. Split rows exchange their norm partials through
  `partials` (int64, local), tagged with the epoch.
- Bounded waits, fail-stop: a wait gives up at a deadline (TPFUSE_TIMEOUT_S, or `timeout_s`),
  records err = [code, ranks, row, call], sets every rank's abort word and writes NaN. From then on
  this rank's kernels push nothing and wait for nothing, and every peer's wait ends as soon as it
  sees the abort word (recording which rank gave up), so a rank that was only slow cannot sum data
  of different calls: it gets NaN and an error. The error is sticky: the workspace is unusable,
  and the next eager call (or `check()`, which synchronises) raises PeerTimeoutError. Under CUDA
  graph replay call `check()` yourself.

Concurrency: calls on one workspace never overlap: an eager call from a stream other than the
last one used first waits for that stream's work (`_bind_stream`). Calls being captured into a
CUDA graph cannot wait on work outside the capture, so graph replays must be ordered with the
workspace's other calls by the caller (replay on the stream that makes the eager calls). Every
rank must issue the same calls in the same order (a collective). Allocation, rendezvous and the sentinel fill happen outside graph capture.
`close()` is collective and explicit; nothing is released in `__del__`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpfuse.kernels.protocol import (
    ERR_ABORTED,
    ERR_CALL,
    ERR_CODE,
    ERR_RANKS,
    ERR_ROW,
    ERR_STALL,
    ERR_WORDS,
    HEADER_BYTES,
    NUM_SLOTS,
    SENTINEL_BITS,
    STATE_WORDS,
    partials_len,
    round_region,
)


class PeerTimeoutError(RuntimeError):
    """A call could not complete: peers never delivered, a peer gave up first, or this rank stalled.

    `ranks` are the peers waited on (ERR_TIMEOUT) or the rank that gave up (ERR_ABORTED).
    """

    def __init__(self, where: str, rank: int, code: int, ranks: list[int], row: int, call: int, timeout_s: float) -> None:
        self.ranks, self.code = ranks, code
        names = ", ".join(str(r) for r in ranks)
        if code == ERR_ABORTED:
            what = (f"rank {rank} stopped at call {call}: rank(s) {names} gave up waiting first (a peer of theirs "
                    f"was late by more than {timeout_s:g} s or dead), so this call cannot complete")
        elif code == ERR_STALL:
            what = (f"rank {rank}'s own programs did not all run within {timeout_s:g} s (row {row}, call {call}): "
                    "other work held the GPU")
        else:
            what = (f"rank {rank} waited {timeout_s:g} s for data from rank(s) {names} (row {row}, call {call}) "
                    "that never arrived; every rank must make the same calls in the same order")
        super().__init__(
            f"{where}: {what}. The outputs of that call and of every later call on this workspace are NaN. "
            "Close the Communicator on every rank and create a new one (raise TPFUSE_TIMEOUT_S if the "
            "peers are only slow)."
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
    names = [os.path.join(shm_dir, f"tpfuse-{token[0]}-{r}") for r in range(world_size)]
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
        self.region_elems = round_region(region_elems)
        self.num_regions = num_regions
        self.header_elems = HEADER_BYTES // dtype.itemsize
        if device.type == "cuda" and shares_device:
            # symmetric memory refuses two ranks on one GPU unless told that it is intended
            os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
        numel = self.header_elems + NUM_SLOTS * num_regions * self.region_elems
        self.peers = open_peer_buffers(numel, dtype, group=group, rank=rank, world_size=world_size, device=device)
        bits = torch.int16 if dtype.itemsize == 2 else torch.int32
        self.peers.local.view(bits).fill_(SENTINEL_BITS[dtype.itemsize])
        self.peers.local[: self.header_elems].view(torch.int32).zero_()  # the abort word
        # norm partials of split rows, one int64 per item, tagged with no epoch yet (-1)
        self.partials = torch.full((partials_len(self.region_elems, dtype.itemsize),), -1, dtype=torch.int64, device=device)
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int32, device=device)
        self.err = torch.zeros(ERR_WORDS, dtype=torch.int32, device=device)
        self._err_host = torch.zeros(ERR_WORDS, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._stream = None
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
        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            self._bind_stream(torch.cuda.current_stream(self.device))

    def _bind_stream(self, stream) -> None:
        """Order this call after every earlier call on the workspace, whatever stream issued those.

        Two kernels on one workspace at once would mix two calls' data, so when the caller's
        stream differs from the last one used, the new stream waits for the old one's work first
        (`wait_stream` records an event there now: it covers the last launch). Nothing is added
        while the stream stays the same.
        """
        if self._stream is not None and stream != self._stream:
            stream.wait_stream(self._stream)
        self._stream = stream

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
        if words[ERR_CODE] != 0:
            ranks = [r for r in range(self.world_size) if words[ERR_RANKS] >> r & 1]
            raise PeerTimeoutError(self.where, self.rank, words[ERR_CODE], ranks, words[ERR_ROW], words[ERR_CALL],
                                   self.timeout_s)

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

