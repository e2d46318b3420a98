"""The architectures `tpfuse audit` evaluates gates for, and three-valued per-arch booleans.

An `ArchBool` holds one of True / False / None (unknown) per architecture in `ARCHS`. Unknown
stands for a clause that does not depend on the GPU (an environment variable, a model name, a
tensor-parallel size): Kleene logic keeps it unknown unless the GPU part decides the answer.
A gate "enables" an architecture when its value there is not False: the GPU does not rule the
feature out, whatever the other clauses say.

`ArchNum` holds one concrete value per architecture (a capability tuple, an SM integer, a major
number); arithmetic, indexing and comparisons with constants lift element-wise, so
`torch.cuda.get_device_capability()[0] >= 9` or `get_device_sm() // 10 == 10` evaluate exactly.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    """One NVIDIA compute capability: `sm120` is major 12, minor 0."""

    name: str
    major: int
    minor: int
    label: str

    @property
    def cc_int(self) -> int:
        """major*10+minor, the integer form of `get_device_sm()` and vLLM's `to_int()`."""
        return self.major * 10 + self.minor

    @property
    def cuda_arch(self) -> int:
        """The value of `__CUDA_ARCH__` when compiling for this architecture (major*100+minor*10)."""
        return self.major * 100 + self.minor * 10


# The audited architectures, Ampere to Blackwell (SM80-SM121), labelled as the engines name them.
ARCHS: tuple[Arch, ...] = (
    Arch("sm80", 8, 0, "A100"),
    Arch("sm86", 8, 6, "A10 / RTX 30xx"),
    Arch("sm89", 8, 9, "L40S / RTX 40xx"),
    Arch("sm90", 9, 0, "H100 / H200"),
    Arch("sm100", 10, 0, "B200 / GB200"),
    Arch("sm103", 10, 3, "B300 / GB300"),
    Arch("sm110", 11, 0, "Thor"),
    Arch("sm120", 12, 0, "RTX PRO 6000 / RTX 5090"),
    Arch("sm121", 12, 1, "GB10"),
)
ARCH_NAMES = tuple(a.name for a in ARCHS)
_INDEX = {a.name: i for i, a in enumerate(ARCHS)}


def parse_arch(text: str, *, option: str = "--arch") -> Arch:
    """`sm120`, `sm_120`, `120`, `12.0` or `SM120a` -> the `Arch`; ValueError naming the valid ones."""
    raw = str(text).strip().lower()
    m = re.fullmatch(r"(?:sm_?)?(\d+)\.(\d)[af]?", raw)
    key = f"sm{int(m.group(1)) * 10 + int(m.group(2))}" if m else None
    if key is None:
        m = re.fullmatch(r"(?:sm_?|compute_)?(\d{2,3})[af]?", raw)
        key = f"sm{m.group(1)}" if m else raw
    if key not in _INDEX:
        raise ValueError(f"{option}: unknown architecture {text!r}; use one of {', '.join(ARCH_NAMES)}")
    return ARCHS[_INDEX[key]]


def arch_index(arch: Arch) -> int:
    return _INDEX[arch.name]


def _and(a, b):
    if a is False or b is False:
        return False
    if a is None or b is None:
        return None
    return True


def _or(a, b):
    if a is True or b is True:
        return True
    if a is None or b is None:
        return None
    return False


@dataclass(frozen=True)
class ArchBool:
    """A boolean per architecture (True / False / None = unknown); `weak` marks a name-only guess."""

    values: tuple
    weak: bool = False

    @classmethod
    def const(cls, value) -> ArchBool:
        return cls((value,) * len(ARCHS))

    @classmethod
    def where(cls, pred, *, weak: bool = False) -> ArchBool:
        """True exactly on the architectures for which `pred(arch)` holds."""
        return cls(tuple(bool(pred(a)) for a in ARCHS), weak)

    def and_(self, other: ArchBool) -> ArchBool:
        return ArchBool(tuple(map(_and, self.values, other.values)), self.weak or other.weak)

    def or_(self, other: ArchBool) -> ArchBool:
        return ArchBool(tuple(map(_or, self.values, other.values)), self.weak or other.weak)

    def not_(self) -> ArchBool:
        return ArchBool(tuple(None if v is None else not v for v in self.values), self.weak)

    def at(self, arch: Arch):
        return self.values[_INDEX[arch.name]]

    def enables(self, arch: Arch) -> bool:
        """The GPU does not rule the feature out on `arch` (True, or unknown for other reasons)."""
        return self.at(arch) is not False

    @property
    def depends_on_arch(self) -> bool:
        return len(set(self.values)) > 1

    def enabled_names(self) -> list[str]:
        """`sm90`, or `sm90?` where the value there is unknown (other clauses decide)."""
        return [a.name + ("?" if v is None else "") for a, v in zip(ARCHS, self.values) if v is not False]


@dataclass(frozen=True)
class ArchNum:
    """A concrete value per architecture (tuple, int, str) derived from the device capability;
    `weak` marks a value whose source was recognised by its name only."""

    values: tuple
    weak: bool = False

    @classmethod
    def of(cls, fn, *, weak: bool = False) -> ArchNum:
        return cls(tuple(fn(a) for a in ARCHS), weak)

    def at(self, arch: Arch):
        return self.values[_INDEX[arch.name]]

    def map(self, fn) -> ArchNum | None:
        try:
            return ArchNum(tuple(fn(v) for v in self.values), self.weak)
        except (TypeError, ValueError, IndexError, ZeroDivisionError, AttributeError):
            return None


_CMP = {
    "Eq": operator.eq, "NotEq": operator.ne, "Lt": operator.lt, "LtE": operator.le,
    "Gt": operator.gt, "GtE": operator.ge,
    "In": lambda a, b: _member(a, b), "NotIn": lambda a, b: not _member(a, b),
}


def compare(op: str, left, right) -> ArchBool | None:
    """`left op right` where either side may be an ArchNum and the other a plain constant.

    Returns None when the comparison cannot be decided (an unknown side, a type mismatch)."""
    fn = _CMP[op]
    lvals = left.values if isinstance(left, ArchNum) else (left,) * len(ARCHS)
    rvals = right.values if isinstance(right, ArchNum) else (right,) * len(ARCHS)
    weak = any(isinstance(side, ArchNum) and side.weak for side in (left, right))
    try:
        return ArchBool(tuple(bool(fn(_norm(a), _norm(b))) for a, b in zip(lvals, rvals)), weak)
    except TypeError:
        return None


def _member(a, container) -> bool:
    """`a in container` by equality, not hash: a capability that compares equal to 90, (9, 0) and 9
    (predicates.Capability) is in `frozenset({90})`."""
    if isinstance(container, (set, frozenset, dict)):
        return any(a == k for k in container)
    return a in container


def _norm(v):
    # DeviceCapability-style named tuples and lists compare as plain tuples.
    return tuple(v) if isinstance(v, list) else v
