"""Seeded meanings of architecture predicates, for names the target does not define.

The semantics are those of the helpers' definitions in sglang (`srt/utils/common.py`), vLLM
(`platforms/interface.py`) and FlashInfer (`utils.py`). Two tables:

- `ALWAYS`: names whose seed wins even over a definition in the target, because their bodies query
  hardware (capability getters) or the platform kind (`is_cuda`: every architecture audited is an
  NVIDIA GPU, so `is_cuda()` is true and `is_hip()` false; this also drops ROCm/MUSA branches, whose
  capability tuples are not SM numbers).
- `FALLBACK`: helpers used when the target does not define them (imported from another package,
  or a single file audited alone). Unknown `is_smNNN*` names fall back to a name pattern and are
  marked weak (lower confidence).
"""

from __future__ import annotations

import re

from tpfuse.audit.arch import ArchBool, ArchNum
from tpfuse.audit.values import UNKNOWN, Const, Obj, Partial, SeedFn

# The CUDA toolkit is assumed new enough for every audited architecture: 13.0 is the first that
# targets all of them (sm_110 arrived with it), so `torch.version.cuda >= (12, 8)` clauses of
# helpers such as sglang's `_check_cuda_device_version` do not blur an arch test into "unknown".
ASSUMED_CUDA_VERSION = "13.0"

CAP_TUPLE = ArchNum.of(lambda a: (a.major, a.minor))
CAP_INT = ArchNum.of(lambda a: a.cc_int)
CAP_MAJOR = ArchNum.of(lambda a: a.major)


class Capability(tuple):
    """A capability whose caller may pass `(major, minor)`, a major or `major*10+minor` (a parameter
    named `capability`): it compares equal and ordered with each form, like vLLM's DeviceCapability
    with `.major`, `.minor` and `.to_int()`."""

    def _other(self, other):
        if isinstance(other, int) and not isinstance(other, bool):
            # The integer's size says its form (FlashInfer and vLLM use all three): a major (9),
            # major*10+minor (90) or the __CUDA_ARCH__ form (900).
            if other < 20:
                return self[0], other
            return (self[0] * 10 + self[1], other) if other < 300 else (self[0] * 100 + self[1] * 10, other)
        return tuple(self), tuple(other) if isinstance(other, (tuple, list)) else other

    def __eq__(self, other):
        a, b = self._other(other)
        return a == b

    def __ne__(self, other):
        return not self.__eq__(other)

    def __lt__(self, other):
        a, b = self._other(other)
        return a < b

    def __le__(self, other):
        a, b = self._other(other)
        return a <= b

    def __gt__(self, other):
        a, b = self._other(other)
        return a > b

    def __ge__(self, other):
        a, b = self._other(other)
        return a >= b

    __hash__ = tuple.__hash__


CAP_ANY = ArchNum.of(lambda a: Capability((a.major, a.minor)))
CAP_GUESSED = ArchNum.of(lambda a: Capability((a.major, a.minor)), weak=True)

# Getters named as returning the device's capability or architecture (sglang `get_jit_cuda_arch()`,
# `get_device_compute_capability()`), for calls whose definition cannot be read (a global set
# elsewhere, an external package): they evaluate to the capability, marked weak. Lists, flags and
# strings of the build's targets are not the device's capability.
_GETTER_RE = re.compile(r"_?get_\w*(?:cuda_arch|gpu_arch|device_arch|arch_info|capabilit\w*|compute_cap\w*"
                        r"|sm_version|device_sm)")
_NOT_A_CAPABILITY = re.compile(r"(?:list|lists|flags?|str|string|names?|suffix|targets?|archs|capabilities"
                               r"|_ptx|_nvcc)$")


def getter_guess(name: str):
    """CAP_GUESSED for a capability getter's name (`get_jit_cuda_arch`), else None."""
    if _GETTER_RE.fullmatch(name) and not _NOT_A_CAPABILITY.search(name):
        return CAP_GUESSED
    return None


def majors(*ms: int, weak: bool = False) -> ArchBool:
    return ArchBool.where(lambda a: a.major in ms, weak=weak)


def exact(major: int, minor: int) -> ArchBool:
    return ArchBool.where(lambda a: (a.major, a.minor) == (major, minor))


def _pred(name: str, value: ArchBool) -> SeedFn:
    return SeedFn(name, lambda args, kwargs: value, weak=value.weak)


def _returns(name: str, value) -> SeedFn:
    return SeedFn(name, lambda args, kwargs: value)


def _const_arg(args: list):
    return args[0].value if args and isinstance(args[0], Const) else None


def _cap_match(kind: str):
    """vLLM Platform methods: exact (`is_device_capability`), same major (`_family`), `>=` (`has_`)."""

    def call(args, kwargs):
        cap = _const_arg(args)
        if cap is None and kwargs:
            cap = next(iter(kwargs.values())).value if isinstance(next(iter(kwargs.values())), Const) else None
        if isinstance(cap, (tuple, list)) and len(cap) == 2:
            key = lambda a: (a.major, a.minor)  # noqa: E731
            want = tuple(cap)
            major_of = cap[0]
        elif isinstance(cap, int):
            key = lambda a: a.cc_int  # noqa: E731
            want = cap
            major_of = cap // 10
        else:
            return UNKNOWN
        if kind == "exact":
            return ArchBool.where(lambda a: key(a) == want)
        if kind == "family":
            return ArchBool.where(lambda a: a.major == major_of)
        return ArchBool.where(lambda a: key(a) >= want)

    return call


def _identity_decorator(args, kwargs):
    # lru_cache(maxsize=1) -> decorator; lru_cache(func) / cache(func) -> func itself.
    if args and not isinstance(args[0], Const):
        return args[0]
    return SeedFn("decorator", lambda a, k: a[0] if a else UNKNOWN)


def _partial(args, kwargs):
    return Partial(args[0], tuple(args[1:]), dict(kwargs)) if args else UNKNOWN


_PROPS = Obj("device_properties",
             lambda n: {"major": CAP_TUPLE.map(lambda v: v[0]), "minor": CAP_TUPLE.map(lambda v: v[1])}.get(n, UNKNOWN))

_NOT_NVIDIA = ("is_hip", "is_rocm", "is_npu", "is_xpu", "is_musa", "is_cpu", "is_mps", "is_tpu", "is_hpu")

ALWAYS: dict = {
    "get_device_capability": _returns("get_device_capability", CAP_TUPLE),
    "get_compute_capability": _returns("get_compute_capability", CAP_TUPLE),
    "get_device_sm": _returns("get_device_sm", CAP_INT),
    "get_sm_version": _returns("get_sm_version", CAP_INT),
    "get_device_properties": _returns("get_device_properties", _PROPS),
    "is_cuda": _pred("is_cuda", ArchBool.const(True)),
    "is_cuda_alike": _pred("is_cuda_alike", ArchBool.const(True)),
    **{n: _pred(n, ArchBool.const(False)) for n in _NOT_NVIDIA},
    "lru_cache": SeedFn("lru_cache", _identity_decorator),
    "cache": SeedFn("cache", _identity_decorator),
    "partial": SeedFn("partial", _partial),
}

FALLBACK: dict = {
    # sglang srt/utils/common.py: majors via _check_cuda_device_version; is_sm120()/is_sm121() exact.
    "is_sm80_supported": majors(8),
    "is_ampere_with_cuda_12_3": majors(8),
    "is_sm90_supported": majors(9),
    "is_hopper_with_cuda_12_3": majors(9),
    "is_sm100_supported": majors(10),
    "is_sm100_or_sm110_supported": majors(10, 11),
    "is_sm110_supported": majors(11),
    "is_sm120_supported": majors(12),
    "is_blackwell_supported": majors(10, 11, 12),
    "is_blackwell": majors(10, 11, 12),
    "is_sm120": exact(12, 0),
    "is_sm121": exact(12, 1),
    # FlashInfer utils.py: the "a" helpers are majors except 120a/121a, which are exact.
    "is_sm90a_supported": majors(9),
    "is_sm100a_supported": majors(10),
    "is_sm100f_supported": majors(10),
    "is_sm110a_supported": majors(11),
    "is_sm120a_supported": exact(12, 0),
    "is_sm121a_supported": exact(12, 1),
    "is_sm120f_supported": majors(12),
    "is_sm12x_supported": majors(12),
    "is_hopper": exact(9, 0),
}

# sglang PlatformContext facts (runtime_context.py _PLATFORM_PROBES), used when the target lacks the table.
SGLANG_FACTS: dict = {
    "is_cuda": ArchBool.const(True), "is_hip": ArchBool.const(False), "is_npu": ArchBool.const(False),
    "is_xpu": ArchBool.const(False), "is_musa": ArchBool.const(False), "is_mps": ArchBool.const(False),
    "is_sm90": majors(9), "is_sm100": majors(10), "is_sm100_or_sm110": majors(10, 11),
    "is_sm110": majors(11), "is_sm120": majors(12), "is_blackwell": majors(10, 11, 12),
    "is_hopper_with_cuda_12_3": majors(9), "device_sm": CAP_INT, "device_capability": CAP_TUPLE,
}

_PATTERN = re.compile(r"_?(?:is|has)_sm_?(\d{2,3})[af]?(?:_supported)?")
_FAMILY_WORDS = {"blackwell": (10, 11, 12), "hopper": (9,), "ampere": (8,), "ada": (8,)}


_CUDA_NAME_RE = re.compile(r"_?is_cuda(?:_\w*)?")  # is_cuda_static, is_cuda_alike, _is_cuda_platform
# Predicates of other vendors' devices (`is_gfx95_supported`, `_is_hip`, `is_mi300`): false on every audited NVIDIA GPU.
_OTHER_VENDOR_RE = re.compile(r"_?(?:is|use|has)_\w*(?:gfx\d+|hip|rocm|musa|npu|xpu|hpu|mi\d{3}|amd|cdna|rdna)\w*",
                              re.IGNORECASE)


def fallback(name: str):
    """Seeded meaning of an undefined helper name, a weak guess from its spelling, or None."""
    if name in FALLBACK:
        return _pred(name, FALLBACK[name])
    if _CUDA_NAME_RE.fullmatch(name) and "available" not in name:
        return _pred(name, ArchBool.const(True))
    if _OTHER_VENDOR_RE.fullmatch(name):
        return _pred(name, ArchBool.const(False))
    m = _PATTERN.fullmatch(name)
    if m:
        return _pred(name, majors(int(m.group(1)) // 10, weak=True))
    for word, ms in _FAMILY_WORDS.items():
        if re.fullmatch(rf"_?is_{word}\w*", name):
            return _pred(name, majors(*ms, weak=True))
    return None


def _vllm_attr(name: str):
    if name == "get_device_capability":
        return _returns(name, CAP_TUPLE)
    if name in ("is_device_capability", "is_device_capability_family", "has_device_capability"):
        kind = {"is_device_capability": "exact", "is_device_capability_family": "family"}.get(name, "atleast")
        return SeedFn(name, _cap_match(kind))
    if name in ("is_cuda", "is_cuda_alike"):
        return _pred(name, ArchBool.const(True))
    if name in _NOT_NVIDIA or name in ("is_out_of_tree", "is_neuron"):
        return _pred(name, ArchBool.const(False))
    # sglang multimodal_gen's vLLM-like platform: is_blackwell() is major 10, is_hopper() is (9, 0).
    if name == "is_blackwell":
        return _pred(name, majors(10))
    if name == "is_hopper":
        return _pred(name, exact(9, 0))
    if name in ("device_capability", "capability"):
        return CAP_ANY
    m = _PATTERN.fullmatch(name)
    if m:  # a platform's `is_sm120()` is the major family (sglang multimodal_gen's `get_device_capability()[0] == 12`)
        return _pred(name, majors(int(m.group(1)) // 10, weak=True))
    return fallback(name) or UNKNOWN


VLLM_PLATFORM = Obj("current_platform", _vllm_attr)


def sglang_fact(name: str):
    """A `get_platform().<name>` fact from the seed table (UNKNOWN for facts it does not know)."""
    if name in SGLANG_FACTS:
        return SGLANG_FACTS[name]
    seeded = fallback(f"is_{name[3:]}_supported") if name.startswith("is_sm") else None
    return seeded.call([], {}) if seeded else UNKNOWN


# sglang's `get_platform()` (srt/runtime_context.py) where the target does not define it: its facts from the seed table.
SGLANG_PLATFORM = Obj("platform", sglang_fact)
SEED_GLOBALS: dict = {"current_platform": VLLM_PLATFORM, "get_platform": _returns("get_platform", SGLANG_PLATFORM)}
