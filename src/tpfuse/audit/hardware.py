"""Hardware exclusions: what a gate's guarded code needs that some architectures do not have.

A gate is `hardware` on `--arch` when the code it guards (the if-body, the rest of a function
after a guard, the statement of a return or assignment, and the bodies of target functions that
code calls) uses an instruction, PTX target or resource `--arch` lacks; otherwise it is `policy`
(a default, an allow-list, a tuned table) and safe to open. `patch` refuses hardware gates unless
`--force-hardware`. The features and which architectures have them: PTX ISA 8.7/9.0 and the CUDA
programming guide's compute-capability tables (tcgen05 and TMEM: sm_100a/sm_103a/sm_110a only;
wgmma: sm_90a only; TMA multicast: clusters on 9.x-11.x, not on consumer 12.x; `cvt.rs`: 10.x;
an `a` target such as `sm_100a` runs only on that exact capability), and for shared memory the
per-block maximum opt-in of each capability (227 KB on 9.0-11.0, 163 KB on 8.0, 99 KB on 8.6,
8.9 and 12.x).
"""

from __future__ import annotations

import re

from tpfuse.audit.arch import ARCHS, Arch

# feature -> (regex over the guarded code, predicate: does `arch` have it, lower-cased words of which
# every match holds one: in ASCII text, where IGNORECASE is ASCII case folding, the regex is tried
# only where one of them is, since an alternation is tried at every position of the guarded code)
FEATURES: dict = {
    "tcgen05/TMEM/UMMA instructions": (
        re.compile(r"tcgen05|\btmem\b|tmem_|_tmem|\bumma\b|utccp|kind::f8f6f4|kind::mxf8f6f4", re.IGNORECASE),
        lambda a: a.major in (10, 11), ("tcgen05", "tmem", "umma", "utccp", "kind::"),
    ),
    "wgmma (sm_90a)": (re.compile(r"\bwgmma\b", re.IGNORECASE), lambda a: a.major == 9, ("wgmma",)),
    "TMA multicast": (re.compile(r"multicast", re.IGNORECASE), lambda a: a.major in (9, 10, 11), ("multicast",)),
    "cvt.rs (stochastic rounding)": (re.compile(r"cvt\.rs\b|cvt_rs\b"), lambda a: a.major in (10, 11), ("cvt",)),
}
# `sm_100a`, `compute_90a`, "100a": code built for one exact capability (the `a` target).
_ARCH_SPECIFIC_RE = re.compile(r"(?:sm|compute)_?(\d{2,3})a\b", re.IGNORECASE)
_SMEM_RE = re.compile(r"(?:smem|shared_?mem\w*|shared_memory\w*)\s*[=:]\s*(\d+)\s*(\*\s*1024)?", re.IGNORECASE)
# Maximum shared memory per block (opt-in), bytes: CUDA C++ Programming Guide, compute capabilities table.
MAX_SMEM = {"sm80": 166912, "sm86": 101376, "sm89": 101376, "sm90": 232448, "sm100": 232448, "sm103": 232448,
            "sm110": 232448, "sm120": 101376, "sm121": 101376}


# the words of the two patterns above, as in FEATURES
_ARCH_SPECIFIC_WORDS = ("sm", "compute")
_SMEM_WORDS = ("smem", "shared")


def needed(text: str) -> list:
    """Hardware features the code `text` uses: feature names, `sm_100a`-style targets, `smem>=N`."""
    lower = text.lower() if text.isascii() else None

    def may(words: tuple) -> bool:
        return lower is None or any(w in lower for w in words)

    out = [name for name, (rx, _, words) in FEATURES.items() if may(words) and rx.search(text)]
    if may(_ARCH_SPECIFIC_WORDS):
        out += sorted({f"sm_{m.group(1)}a" for m in _ARCH_SPECIFIC_RE.finditer(text)})
    sizes = [int(m.group(1)) * (1024 if m.group(2) else 1) for m in _SMEM_RE.finditer(text)] if may(_SMEM_WORDS) else []
    if sizes and max(sizes) > min(MAX_SMEM.values()):
        out.append(f"smem>={max(sizes)}")
    return out


def has(feature: str, arch: Arch) -> bool:
    if feature in FEATURES:
        return FEATURES[feature][1](arch)
    m = re.fullmatch(r"sm_(\d+)a", feature)
    if m:
        return arch.cc_int == int(m.group(1))
    m = re.fullmatch(r"smem>=(\d+)", feature)
    if m:
        return MAX_SMEM[arch.name] >= int(m.group(1))
    return True


def hardware_needs(finding, arch: Arch) -> str | None:
    """What the gate's guarded code needs that `arch` lacks (None: a policy gate)."""
    lacking = [f for f in getattr(finding, "requires", None) or [] if not has(f, arch)]
    return ", ".join(lacking) or None


def gate_class(finding, arch: Arch) -> tuple[str, str]:
    """('hardware', why) or ('policy', why) of a gate on `arch`."""
    lacking = hardware_needs(finding, arch)
    if lacking:
        return "hardware", f"guarded code needs {lacking}; {arch.name} lacks it"
    if getattr(finding, "requires", None):
        return "policy", f"guarded code needs {', '.join(finding.requires)}, which {arch.name} has"
    return "policy", "guarded code needs nothing architecture-specific that could be read"


assert set(MAX_SMEM) == {a.name for a in ARCHS}
