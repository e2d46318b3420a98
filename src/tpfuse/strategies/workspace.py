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
- The epoch travels with the data (a tag word per item and source), so ranks whose call counts
  differ never mix calls.
- Device state (int32, local): one epoch word per program, advanced by each program itself, so
  CUDA graphs replay correctly. Split rows exchange their norm partials through `partials`
  (int64, local), tagged with the epoch.
- Bounded waits, fail-stop: a wait gives up at a deadline (TPFUSE_TIMEOUT_S, or `timeout_s`),
  records err = [code, ranks, row, call], sets every rank's abort word and writes NaN. From then on
  this rank's kernels push nothing and wait for nothing, and every peer's wait ends as soon as it
  sees the abort word (recording which rank gave up), so a rank that was only slow cannot sum data
  of different calls: it gets NaN and an error. The error is sticky: the workspace is unusable.

When an error surfaces: the kernel that records it also writes its code into host-mapped memory
(`errmap`), which every eager call reads before it launches (no copy kernel, no sync). So an eager
call raises PeerTimeoutError once the failure has been recorded on the device: the next call
after the failed kernel finished its wait (a call issued while that kernel still spins raises at
a later call). `check()` synchronises and always raises; under CUDA graph replay call it yourself.

Concurrency: calls on one workspace never overlap: an eager call from a stream other than the
last one used first waits for that stream's work (`_bind_stream`). Calls being captured into a
CUDA graph cannot wait on work outside the capture, so graph replays must be ordered with the
workspace's other calls by the caller (replay on the stream that makes the eager calls). Every
rank must issue the same calls in the same order (a collective). Allocation, rendezvous and the
sentinel fill happen outside graph capture. `close()` is collective and explicit; nothing is
released in `__del__`.
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
    ERR_EPOCH,
    ERR_RANKS,
    ERR_ROW,
    ERR_STALL,
    ERR_WORDS,
    SENTINEL_BITS,
    STATE_WORDS,
    buffer_layout,
    partials_len,
    round_region,
    round_tags,
)


class PeerTimeoutError(RuntimeError):
    """A call could not complete: peers never delivered, a peer gave up first, or this rank stalled.

    `ranks` are the peers waited on (ERR_TIMEOUT), the rank that gave up (ERR_ABORTED) or the
    peers that delivered another call's data (ERR_EPOCH).
    """

    def __init__(self, where: str, rank: int, code: int, ranks: list[int], row: int, call: int,
                 timeout_s: float) -> None:
        self.ranks, self.code = ranks, code
        names = ", ".join(str(r) for r in ranks)
        if code == ERR_ABORTED:
            what = (f"rank {rank} stopped at call {call}: rank(s) {names} gave up waiting first (a peer of theirs "
                    f"was late by more than {timeout_s:g} s or dead), so this call cannot complete")
        elif code == ERR_STALL:
            what = (f"rank {rank}'s own programs did not all run within {timeout_s:g} s (row {row}, call {call}): "
                    "other work held the GPU")
        elif code == ERR_EPOCH:
            what = (f"rank {rank} received data of another call from rank(s) {names} at its call {call} (row {row}): "
                    "their call counts differ from this rank's; every rank must make the same calls in the same order")
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


def open_peer_buffers(numel: int, dtype: torch.dtype, *, group, rank: int, world_size: int,
                      device: torch.device) -> PeerBuffers:
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
    views = tuple(local if r == rank else torch.from_file(names[r], shared=True, size=numel, dtype=dtype)
                  for r in range(world_size))
    dist.barrier(group=group)
    os.unlink(names[rank])  # the mappings stay valid; nothing is left behind if a rank dies later
    return PeerBuffers(views, rank, lambda: None)


def fill_buffer(buf: torch.Tensor, layout) -> None:
    """Arm a fresh buffer: the sentinel in every slot, the abort word 0, every tag and row word -1
    (no call count: counts are >= 0)."""
    bits = torch.int16 if buf.element_size() == 2 else torch.int32
    buf[: layout.tags_elems].view(bits).fill_(SENTINEL_BITS[buf.element_size()])
    buf[: layout.header_elems].view(torch.int32).zero_()
    buf[layout.tags_elems:].view(torch.int32).fill_(-1)


class LamportWorkspace:
    """Peer buffers + device state for one (stream, dtype); see the module docstring.

    `region_elems` bounds the elements one rank contributes per region per call (tokens x hidden),
    `tag_words` the items (and rows) of one call. `ranks_per_device`: how many ranks of the group
    share this rank's GPU (the launcher's co-residency check).
    """

    def __init__(self, *, group, rank: int, world_size: int, device: torch.device, dtype: torch.dtype,
                 region_elems: int, num_regions: int, tag_words: int, timeout_s: float, where: str,
                 ranks_per_device: int = 1, peers: PeerBuffers | None = None) -> None:
        if dtype.itemsize not in SENTINEL_BITS:
            raise TypeError(f"{where}: dtype {dtype} has no sentinel; use bfloat16, float16 or float32")
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        self.dtype, self.timeout_s, self.where = dtype, float(timeout_s), where
        self.region_elems = round_region(region_elems)
        self.num_regions = num_regions
        self.tag_words = round_tags(tag_words)
        self.ranks_per_device = ranks_per_device
        layout = buffer_layout(self.region_elems, num_regions, self.tag_words, dtype.itemsize)
        self.header_elems = layout.header_elems
        if device.type == "cuda" and ranks_per_device > 1:
            # symmetric memory refuses two ranks on one GPU unless told that it is intended
            os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
        if peers is None:
            peers = open_peer_buffers(layout.total_elems, dtype, group=group, rank=rank, world_size=world_size,
                                      device=device)
        self.peers = peers
        fill_buffer(self.peers.local, layout)
        # norm partials of split rows, one int64 per item, tagged with no epoch yet (-1)
        self.partials = torch.full((partials_len(self.region_elems, dtype.itemsize),), -1, dtype=torch.int64,
                                   device=device)
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int32, device=device)
        self.err = torch.zeros(ERR_WORDS, dtype=torch.int32, device=device)
        # the error words' host-mapped mirror (pinned memory, which the GPU addresses directly);
        # on CPU the words themselves
        self.errmap = torch.zeros(ERR_WORDS, dtype=torch.int32, pin_memory=True) if device.type == "cuda" else self.err
        self._errmap_words = self.errmap.numpy()  # host reads without a torch op
        self._stream = None  # the raw handle of the stream of the last eager call
        # The device index each call reads its current stream on (one attribute read, not two)
        self._cuda_index = None if device.type != "cuda" else (
            device.index if device.index is not None else torch.cuda.current_device())
        self._closed = False
        self._barrier()

    @property
    def sentinel(self) -> int:
        return SENTINEL_BITS[self.dtype.itemsize]

    def fits(self, elems: int, items: int = 0) -> bool:
        return elems <= self.region_elems and items <= self.tag_words

    def before_call(self) -> None:
        """Raise PeerTimeoutError if an earlier call on this rank failed (reads host memory only),
        and order this call after the workspace's earlier eager calls on other streams."""
        if self._errmap_words[ERR_CODE] or self._closed:
            self._raise_recorded()
        if self._cuda_index is not None:
            stream = torch._C._cuda_getCurrentRawStream(self._cuda_index)
            if stream != self._stream and not torch.cuda.is_current_stream_capturing():
                self._bind_stream(stream)

    def _bind_stream(self, stream: int) -> None:
        """Order this call after every earlier call on the workspace, whatever stream issued those.

        Two kernels on one workspace at once would mix two calls' data, so when the caller's
        stream differs from the last one used, the new stream waits for the old one's work first
        (`wait_stream` records an event there now: it covers the last launch). Nothing is added
        while the stream stays the same. Calls being captured are not bound (a capture cannot wait
        on work outside it; see the module docstring).
        """
        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(torch.cuda.ExternalStream(self._stream, device=self.device))
        self._stream = stream

    def _raise_recorded(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.where}: workspace used after close(); create a new Communicator")
        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize(self.device)  # the failed kernel has finished: its record is complete
            self._raise_from(self.err)
        self._raise_from(self.errmap)

    def check(self) -> None:
        """Synchronise this rank's device and raise PeerTimeoutError if any call failed."""
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
        if self.group is not None:
            dist.barrier(group=self.group)

    def close(self) -> None:
        """Collective: wait until no rank's kernel can still touch the buffers, then release them."""
        if self._closed:
            return
        self._closed = True
        self._barrier()
        self.peers.release()
        self.peers = None  # type: ignore[assignment]



def emulated_workspaces(world_size: int, *, device, dtype: torch.dtype, region_elems: int, num_regions: int,
                        tag_words: int, timeout_s: float, where: str = "emulated") -> list[LamportWorkspace]:
    """The workspaces of `world_size` ranks emulated in one process on one device: every rank's
    buffer is a plain allocation there, mapped by all (no process group, no IPC), for W ranks run
    as W streams (benchmarks/bench_peer_kernels.py and the one-process GPU tests). Calls of all
    ranks must be issued so that they can run concurrently (one stream each)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    layout = buffer_layout(round_region(region_elems), num_regions, round_tags(tag_words), dtype.itemsize)
    views = tuple(torch.empty(layout.total_elems, dtype=dtype, device=device) for _ in range(world_size))
    return [LamportWorkspace(group=None, rank=r, world_size=world_size, device=device, dtype=dtype,
                             region_elems=region_elems, num_regions=num_regions, tag_words=tag_words,
                             timeout_s=timeout_s, where=where, ranks_per_device=world_size,
                             peers=PeerBuffers(views, r, lambda: None))
            for r in range(world_size)]
