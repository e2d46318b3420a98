"""What the audit found at one architecture condition, and what it means for one architecture.

`ArchCondition` is the record the scan makes of one condition, the same whatever `--arch` is:
where it is, its text, its value on every audited architecture, and the evidence its category is
read from (the syntactic role of the code around it, what the guarded code does, whether its
architecture atoms turn something off where they name an architecture). `verdict(condition,
arch, like)` is the one place that decides what a condition means for `arch`: its category,
whether it excludes `arch`, whether it is reported as a gate that does, its confidence and its
hardware/policy class. The driver's selection, the report, SARIF, patch and the tests read it.

Categories: `gate` (turns a feature, backend or code path on where it is true); `inverse` (turns
something off where it names an architecture: listed apart, never patched); `quirk` (a
per-architecture tuning or workaround: it changes a default value and enables nothing, so it is
listed apart and never counts as a gate excluding an architecture); and the non-gates a text
search mistakes for gates: `helper-definition` (the body of an arch predicate), `flag-definition`
(a cached flag named after an architecture: the gates are where it is read), `test`, `test-skip`,
`log` (a branch that only logs) and `message` (a condition inside a log or error message).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

from tpfuse.audit.arch import ARCHS, Arch
from tpfuse.audit.hardware import gate_class

ROLES = ("code", "helper-definition", "flag-definition", "test", "test-skip", "log", "message")
EFFECTS = ("enable", "disable", "tune")
CATEGORIES = ("gate", "inverse", "quirk", *ROLES[1:])
# Categories listed in their own section, never among the gates (nor with --all).
APART = ("inverse", "quirk")


def stable_id(*parts: str) -> str:
    """8 hex digits of the SHA-1 of `parts`: 2**32 values for a few thousand conditions per engine."""
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:8]


def number_repeats(conditions: list) -> None:
    """IDs unique within one file's conditions: a repeated ID gets -2, -3 in order of appearance."""
    seen: dict = {}
    for cond in conditions:
        seen[cond.id] = seen.get(cond.id, 0) + 1
        if seen[cond.id] > 1:
            cond.id = f"{cond.id}-{seen[cond.id]}"


@dataclass
class ArchCondition:
    """One architecture-dependent condition as the scan found it (independent of `--arch`).

    `values` maps each audited architecture to True / False / None (unknown: a clause that does not
    depend on the GPU decides). `role` is the syntactic role of the code around it (ROLES), `effect`
    what the guarded code does where the condition is true (EFFECTS), `turns_off` whether each of its
    architecture atoms turns the feature off where it names an architecture. `table` locates a
    capability-keyed table whose missing key is the gate (`path`, `line`, `name`, `keys`)."""

    id: str
    path: str
    line: int
    end_line: int
    column: int
    scope: str
    kind: str
    condition: str
    guards: str
    values: dict
    role: str = "code"
    effect: str = "enable"
    turns_off: bool = False
    weak: bool = False
    language: str = "python"
    report_only: bool = False
    note: str | None = None
    requires: list = field(default_factory=list)  # hardware features the guarded code uses (hardware.py)
    table: dict | None = None

    @property
    def enables(self) -> list:
        """`sm90`, or `sm90?` where the value there is unknown (other clauses decide)."""
        return [a.name + ("?" if self.values[a.name] is None else "")
                for a in ARCHS if self.values[a.name] is not False]

    @property
    def category(self) -> str:
        return categorize(self)

    @property
    def confidence(self) -> str:
        """low: nearby text cites a hardware reason (the exclusion may be intentional); medium: a
        predicate's meaning was guessed from its name; high otherwise."""
        if self.note:
            return "low"
        return "medium" if self.weak else "high"

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(category=self.category, enables=self.enables, confidence=self.confidence)
        return out


def categorize(cond: ArchCondition) -> str:
    """The category of a condition (the module docstring lists them)."""
    if cond.role != "code":
        return cond.role
    if cond.report_only:
        return "gate"
    if cond.turns_off:
        return "inverse"
    if cond.effect == "tune":
        return "quirk"
    return "gate"


@dataclass(frozen=True)
class Verdict:
    """What one condition means for `arch` (and `like`)."""

    category: str
    excludes: bool  # false on `arch` while not false on `like` (or on some other architecture)
    reported: bool  # listed as a gate that excludes `arch`
    confidence: str
    klass: str | None  # gates: 'hardware' (guarded code needs what `arch` lacks; patch refuses it) or 'policy'
    klass_reason: str | None
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def verdict(cond: ArchCondition, arch: Arch, like: Arch | None = None) -> Verdict:
    """The verdict of `cond` on `arch`, compared with `like` when given."""
    category = categorize(cond)
    on_arch = cond.values[arch.name]
    if like is not None:
        elsewhere = cond.values[like.name] is not False
    else:
        elsewhere = any(cond.values[a.name] is not False for a in ARCHS if a != arch)
    excludes = on_arch is False and elsewhere
    klass = klass_reason = None
    if category == "gate":
        klass, klass_reason = gate_class(cond, arch)
    if on_arch is not False:
        reason = f"{'true' if on_arch else 'undecided by the GPU'} on {arch.name}"
    elif not excludes:
        reason = f"false on {arch.name} and on {like.name if like else 'every other architecture'}"
    elif category == "gate":
        reason = f"false on {arch.name}: the feature it guards is off there ({klass})"
    elif category == "inverse":
        reason = f"turns a feature off on {arch.name} on purpose (never patched)"
    elif category == "quirk":
        reason = f"a per-architecture tuning or workaround not applied on {arch.name}: it enables nothing elsewhere"
    else:
        reason = f"a {category}, not a gate"
    return Verdict(category, excludes, excludes and category == "gate", cond.confidence, klass, klass_reason, reason)
