"""Plain facts that cross module boundaries: the op, the process group, one problem, a verdict.

Everything here is a frozen dataclass or an enum and imports nothing heavy, so admission,
dispatch and the dispatch table can be reasoned about (and tested) without a GPU.

A `Problem` is rank-identical by construction: it is built from the call's shape and from a
`GroupFacts` that the Communicator agrees on across ranks at construction. Admission and choice
are pure functions of (Problem, Capabilities), so every rank reaches the same decision, which a
collective needs: a rank that picks another strategy than its peers deadlocks the group.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# Element sizes by dtype name; dtypes travel as names ("bfloat16") so that specs stay plain data.
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


class Op(str, enum.Enum):
    """Collective ops. Values cross the dispatch-table file format: append only."""

    ALL_REDUCE = "all_reduce"
    ALL_REDUCE_RESIDUAL_RMSNORM = "all_reduce_residual_rmsnorm"


@dataclass(frozen=True)
class Verdict:
    """Answer to "may this run here?": `ok`, and the reason (why not, or what was checked)."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def yes(cls, reason: str = "all needs met") -> Verdict:
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str) -> Verdict:
        return cls(False, reason)


@dataclass(frozen=True)
class GroupFacts:
    """What the ranks of one process group agreed on at Communicator construction.

    `peer_access` is True when every pair of ranks can map each other's device memory (CUDA peer
    access between their GPUs, or the same GPU), checked from every rank and reduced with AND;
    False on CPU groups and across hosts. `devices` is one entry per rank: "cpu" or the GPU's UUID.
    """

    world_size: int
    backend: str
    device_type: str
    num_hosts: int = 1
    devices: tuple[str, ...] = ()
    peer_access: bool = False
    native_atomics: bool = False
    shares_device: bool = False

    @classmethod
    def single_process(cls, device_type: str = "cpu", backend: str = "gloo") -> GroupFacts:
        return cls(world_size=1, backend=backend, device_type=device_type, devices=(device_type,))


@dataclass(frozen=True)
class Problem:
    """One call's shape, as seen identically by every rank."""

    op: Op
    num_tokens: int
    hidden: int
    dtype: str
    facts: GroupFacts
    has_residual: bool = True
    quant: str | None = None  # quantized-output format (tpfuse.quant.KINDS), None for none

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"Problem: dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")

    @property
    def world_size(self) -> int:
        return self.facts.world_size

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of one rank's input, `num_tokens x hidden x itemsize`."""
        return self.num_tokens * self.hidden * self.itemsize


def dtype_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16 or 'bfloat16'; no torch import needed for strings."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Needs:
    """What a strategy needs from the machine and the group; checked against probed facts only.

    There is deliberately no field for an architecture: a strategy states the capability it uses
    (peer access, an importable package, a size bound) and the probe answers.
    """

    cuda: bool = False
    nccl: bool = False
    peer_access: bool = False
    single_host: bool = False
    package: str | None = None
    dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")
    hidden_multiple: int = 1
    max_input_bytes: int | None = None
    ops: tuple[Op, ...] = (Op.ALL_REDUCE, Op.ALL_REDUCE_RESIDUAL_RMSNORM)
    quant: tuple[str, ...] = ()  # quantized-output formats implemented (tpfuse.quant.KINDS)
    notes: tuple[str, ...] = field(default=())
