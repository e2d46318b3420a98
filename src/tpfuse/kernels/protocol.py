"""The peer protocol's constants and its work plan, in one place (imports neither torch nor Triton).

Kernels (`oneshot`, `twoshot`, `sync`), the workspace (`tpfuse.strategies.workspace`) and
admission (`tpfuse.strategies.peer`) import these names; nothing else may restate them.

Buffer of one rank (`buffer_layout`; elements of the data dtype unless said otherwise):

    [header: HEADER_BYTES] [slot 0: num_regions x region] [slot 1: num_regions x region]
    [tags: NUM_SLOTS x num_regions x tag_words int32] [row words: NUM_SLOTS x tag_words int64]

- header: int32 word ABORT_WORD is the abort word: 0, or 1 + the rank that gave up. Peers set it
  with a plain remote store (never an atomic), and every poll reads it, so one rank's failure stops
  every rank's waits within one poll.
- slots: call k uses slot k % NUM_SLOTS. A reader re-arms (refills with the sentinel) exactly
  the elements it has just read, in the same call. Two slots are enough: a peer writes slot
  k % 2 again only in call k + 2, which it can start only after it has read data this rank pushed
  in call k + 1, after this rank's call k (its reads and re-arms included) finished on its stream.
  Every rank of a call depends on every other through that call's data (one-shot directly;
  two-shot through the owner of row 0, which needs every rank's scatter and feeds every rank).
- tags: after each item's data a source stores its call count into the item's tag word of the
  region it wrote; a reader takes the item only when its tag equals the reader's own count (the
  epoch travels with the data, so ranks whose counts differ never mix calls). Never re-armed: a
  stale tag is an older count.
- row words: epoch-tagged int64 scalars one per row ((calls << 32) | fp32 bits), which two-shot's
  whole-row owners push with a row's sum of squares; self-cleaning like the partials.

Device state (int32, local): STATE_WORDS epoch words, one per program: program p of a launch
reads word p at entry (its call count: slot = calls % 2, tags and partials carry it) and writes
calls + 1 into words p, p + G, p + 2G, ... (G the grid) before it exits, so every word holds the
next count whatever the next grid. No atomic, and no program waits for another to advance it.

Error words (int32, local): [code, ranks bitmask, row, call]. Codes: ERR_TIMEOUT (the ranks in the
mask never delivered), ERR_ABORTED (the rank in the mask gave up first, so this call cannot
complete), ERR_STALL (this rank's own programs did not all run within the timeout: the GPU was
held by other work), ERR_EPOCH (the ranks in the mask delivered data of another call: their call
counts differ from this rank's). The code is set once (compare-and-swap on local memory) and is
sticky: the kernel of a failed workspace pushes nothing, waits for nothing and writes NaN. The
mask only ever names ranks of the group other than the recording one. On GPUs the same words are
mirrored into host-mapped memory, where the host reads them without a copy.

Work plan: a row of H elements is cut into chunks of `chunk` elements (a power of two, 512 to
4096 bytes, one 16-byte vector per thread); item i = (row i // num_chunks, chunk i % num_chunks)
is handled by program i % programs in every phase. When a row has several chunks, the RMSNorm's
sum of squares is exchanged between programs as epoch-tagged partials (see `tpfuse.kernels.sync`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

NUM_SLOTS = 2
# Epoch words, one per program: the largest grid a launch may have (more than any GPU's SM count
# this targets: H200 132, RTX PRO 6000 188).
STATE_WORDS = MAX_GRID = 256
ERR_CODE, ERR_RANKS, ERR_ROW, ERR_CALL = range(4)
ERR_WORDS = 4
ERR_TIMEOUT, ERR_ABORTED, ERR_STALL, ERR_EPOCH = 1, 2, 3, 4
TAG_ALIGN_WORDS = 32  # tag rows are 128-byte aligned
HEADER_BYTES = 128  # keeps slot 0 128-byte aligned
ABORT_WORD = 0  # int32 index in the header
SENTINEL_BITS = {2: -(1 << 15), 4: -(1 << 31)}  # -0.0 by element size (tpfuse.kernels.sync)
ALIGN_ELEMS = 64  # regions are multiples of 64 elements: 128-byte aligned for 16-bit data

MAX_HIDDEN = 16384  # the largest row the kernels and the epilogue accept (epilogue: one row in registers)
MAX_WORLD = 16  # the error record is a 31-bit rank mask; W is a compile-time constant
# Per-rank input cap: TensorRT-LLM's custom allreduce workspace limit for TP <= 2 (16 MB,
# customAllReduceUtils.h); each rank's buffer is NUM_SLOTS x regions x this.
MAX_INPUT_BYTES = 16 * 1024 * 1024

MIN_CHUNK_BYTES = 512  # one warp, one 16-byte vector per thread
MAX_CHUNK_BYTES = 4096  # eight warps
# Programs a plan aims to keep busy on one GPU: about one per SM of the GPUs this targets (H100 /
# H200: 132, RTX PRO 6000: 188, A100: 108; a plan over more programs than SMs only queues them).
PLAN_PROGRAMS_PER_GPU = 128
# The plan's cost model, in bytes of data each cost is worth: an item costs its chunk's bytes plus a
# fixed cost per item a program handles in sequence (loop step, index math, its norm partial), and
# a split row costs per chunk (the row's partials are awaited by all of its programs, so more
# chunks mean a wider wait). Chosen so that the model picks what the emulated-peer chunk sweeps on
# one H200 measured fastest (rows with `chunk_forced`: peer_kernels_emulated_first.jsonl, W=8:
# 1 token x 6144, 6 chunks of 1024 beat 12 of 512 and 3 of 2048; 16 and 64 tokens, 2048;
# peer_kernels_v3_chunks_emulated.jsonl with every source polled at once (spin 4), 1 token: 6 of
# 1024 fastest at W = 2, 4 and 8, within 0.05 us of 3 of 2048 at W = 1).
ITEM_OVERHEAD_BYTES = 512
PARTIAL_FANIN_BYTES = 512


@dataclass(frozen=True)
class Plan:
    """How one call's (tokens x hidden) input is cut into items; identical on every rank."""

    chunk: int  # elements per item
    num_chunks: int  # items per row
    items: int  # tokens x num_chunks
    num_warps: int
    programs: int = PLAN_PROGRAMS_PER_GPU  # the parallelism it was made for (make_plan's `programs`)

    @property
    def split(self) -> bool:
        return self.num_chunks > 1


def plan_programs(world_size: int, shares_device: bool) -> int:
    """The parallelism a plan aims for: programs per GPU, split among the ranks that share it."""
    return max(1, PLAN_PROGRAMS_PER_GPU // (world_size if shares_device else 1))


@lru_cache(maxsize=4096)
def make_plan(num_tokens: int, hidden: int, itemsize: int, programs: int) -> Plan:
    """The chunk size with the least modelled cost: the work one program does in sequence, plus the
    partials' fan-in of a split row (see ITEM_OVERHEAD_BYTES).

    A pure function of the shape and `programs` (which `plan_programs` derives from agreed group
    facts), so every rank makes the same plan. Ties go to the larger chunk (fewer partials).
    """
    best = None
    chunk = MAX_CHUNK_BYTES // itemsize
    while chunk * itemsize >= MIN_CHUNK_BYTES:
        num_chunks = -(-hidden // chunk)
        items = num_tokens * num_chunks
        serial = -(-items // programs) * (chunk * itemsize + ITEM_OVERHEAD_BYTES)
        if num_chunks > 1:
            serial += num_chunks * PARTIAL_FANIN_BYTES
        if best is None or serial < best[0]:
            best = (serial, chunk, num_chunks)
        chunk //= 2
    _, chunk, num_chunks = best
    return Plan(chunk, num_chunks, num_tokens * num_chunks, max(1, chunk * itemsize // MIN_CHUNK_BYTES), programs)


# Two-shot's chunk owners whose programs would each hold several of make_plan's items take chunks
# of this many bytes (sixteen warps) instead, where that still cuts a row in two or more: measured
# with bench_peer_kernels --suite wide_chunks (bf16 x 6144, W = 2, 4 and 8 ranks emulated on one
# H100, 16-66 programs a rank): 6-22% faster than make_plan's 2048-element chunks where a program
# held two or more items (48-128 tokens), within 0.1 us to 5% where it held one (32 tokens).
TWOSHOT_WIDE_CHUNK_BYTES = 8192


def twoshot_plan(num_tokens: int, hidden: int, itemsize: int, programs: int, world_size: int) -> Plan:
    """Two-shot's plan: `make_plan`'s, except where chunk owners (not `twoshot_owns_rows`) would
    give a program more than one item (an owner's items, 1/W of the call's, over `programs`): then
    wide chunks (TWOSHOT_WIDE_CHUNK_BYTES; the measurements are in its note). make_plan's model
    counts one program's items in sequence; for an owner that polls W - 1 sources an item, fewer
    and larger items keep more loads in flight per poll. Rows a wide chunk would hold whole keep
    make_plan's chunks (whole-row items were slower: the results README). A pure function of the
    shape and agreed group facts, as make_plan, so every rank makes the same plan."""
    plan = make_plan(num_tokens, hidden, itemsize, programs)
    wide = TWOSHOT_WIDE_CHUNK_BYTES // itemsize
    if (hidden <= wide or plan.chunk >= wide or -(-plan.items // world_size) <= programs
            or twoshot_owns_rows(num_tokens, world_size, programs)):
        return plan
    num_chunks = -(-hidden // wide)
    return Plan(wide, num_chunks, num_tokens * num_chunks, TWOSHOT_WIDE_CHUNK_BYTES // MIN_CHUNK_BYTES, programs)


def region_elems_for(num_tokens: int, hidden: int, world_size: int, plan: Plan, *, twoshot: bool) -> int:
    """Elements one region must hold for this call (one-shot: the input; two-shot: also one owner's chunks)."""
    need = num_tokens * hidden
    if twoshot:
        need = max(need, -(-plan.items // world_size) * plan.chunk)
    return need


def round_region(elems: int) -> int:
    return -(-int(elems) // ALIGN_ELEMS) * ALIGN_ELEMS


def round_tags(items: int) -> int:
    """Tag words per region for calls of up to `items` items (also the row words per slot)."""
    return -(-max(1, int(items)) // TAG_ALIGN_WORDS) * TAG_ALIGN_WORDS


@dataclass(frozen=True)
class Layout:
    """Where the parts of one rank's buffer start, in elements of the data dtype."""

    header_elems: int
    tags_elems: int  # start of the tag words
    rows_elems: int  # start of the row words
    total_elems: int


def buffer_layout(region_elems: int, num_regions: int, tag_words: int, itemsize: int) -> Layout:
    """The buffer layout of the module docstring (region_elems from `round_region`, tag_words from
    `round_tags`): what the workspace allocates and the kernels address (they recompute it from
    header, region, the number of regions and tag_words, so the two must agree)."""
    header = HEADER_BYTES // itemsize
    tags = header + NUM_SLOTS * num_regions * region_elems
    rows = tags + NUM_SLOTS * num_regions * tag_words * 4 // itemsize
    return Layout(header, tags, rows, rows + NUM_SLOTS * tag_words * 8 // itemsize)


def twoshot_owns_rows(num_tokens: int, world_size: int, programs: int) -> bool:
    """Whether two-shot's owners hold whole rows: from as many rows a rank as the rank's plan has
    programs (`Plan.programs`), so that whole rows still fill them. An owner then computes each
    row's norm itself and pushes the row's sum of squares with its sums, and no rank exchanges
    partials; but one program reduces a row chunk after chunk, so with fewer rows than programs
    the chain is longer and programs idle. Below that, owners hold runs of chunks, so that even one
    token is spread over every rank and many programs. The measurements behind the rule (8 ranks
    emulated on one H200, and one rank): benchmarks/results/README.md, "Two-shot's cut"."""
    return num_tokens >= programs * world_size


def tag_words_for(plan: Plan, num_tokens: int) -> int:
    """Tag words one region needs for this call (items, and rows for the row words)."""
    return max(plan.items, num_tokens)


def partials_len(region_elems: int, itemsize: int) -> int:
    """int64 partials a workspace needs: two per item (the norm's sum of squares, and per-token
    FP8's absmax), at most two items per chunk-sized piece of a region (a row's last chunk may be
    partial), chunks being at least MIN_CHUNK_BYTES."""
    items = 2 * region_elems // (MIN_CHUNK_BYTES // itemsize) + MAX_CHUNK_BYTES // MIN_CHUNK_BYTES
    return 2 * items


def partials_needed(plan, quant) -> int:
    """Partials of a split row's call: norm partials, and absmax partials for per-token FP8."""
    return plan.items * (2 if quant is not None and quant.kind == "fp8_per_token" else 1)


def quantizes_in_kernel(plan, quant) -> bool:
    """Whether the peer kernels can quantize this plan's chunks themselves (`quantize_chunk`): a
    chunk must hold whole scale blocks (per-group FP8: GROUP columns; NVFP4: 64, so that the
    row's last chunk also covers the padded scale columns). Plans' chunks are powers of two of at
    least 128 elements, so every format of `tpfuse.quant` at group <= 128 qualifies."""
    if quant.kind == "fp8_per_group":
        return plan.chunk % quant.group == 0
    if quant.kind == "nvfp4":
        return plan.chunk % 64 == 0
    return True
