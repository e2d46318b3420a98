"""Quantized output of the fused epilogue: the formats, as small frozen specs, and what each needs.

    quant = tpfuse.fp8_static(scale)                 # e4m3, one given fp32 scale for the tensor
    quant = tpfuse.fp8_per_token(scale_ub=2.0)       # e4m3, scale = row absmax / 448 per token
    quant = tpfuse.fp8_per_group(128, layout="col")  # e4m3, one scale per 128 columns of a row
    quant = tpfuse.nvfp4(global_scale, swizzled=True)
    out = comm.all_reduce_residual_rmsnorm(x, residual, weight, quant=quant)
    out.out, out.scale, out.residual, out.normed       # `QuantOutput`, see tpfuse.reference

The exact arithmetic (every step one IEEE fp32 operation, then round-to-nearest-even onto the
format's grid, saturating to its largest finite value) and the NaN / inf behaviour are defined by
`tpfuse.reference.quantize_ref`; the Triton helpers (`tpfuse.kernels.quant`) and every
strategy reproduce it bit for bit. This module imports nothing heavy: admission and dispatch use
it without torch or Triton.

Output shapes for `M` tokens (leading dimensions of x flattened) and hidden `H`:

| format | out | scale |
|---|---|---|
| fp8_static | float8_e4m3fn (..., H) | the given scale, fp32 (1,) |
| fp8_per_token | float8_e4m3fn (..., H) | fp32 (..., 1) |
| fp8_per_group, layout="row" | float8_e4m3fn (..., H) | fp32 (M, H/g), row-major |
| fp8_per_group, layout="col" | float8_e4m3fn (..., H) | fp32 (M, H/g) view of a column-major (H/g, align4(M)) buffer |
| nvfp4, swizzled=False | uint8 (..., H/2), two e2m1 a byte | float8_e4m3fn (M, H/16) |
| nvfp4, swizzled=True | uint8 (..., H/2) | float8_e4m3fn (align128(M), align4(H/16)) in the 128x4 layout |

layout="col" is what DeepGEMM reads for its LHS scales on SM90 (`get_mn_major_tma_aligned_tensor`:
M-major, M padded to a multiple of 4 so that each column starts 16-byte aligned for TMA); the
padding entries are not written. (DeepGEMM's own `per_token_cast_to_fp8` also floors the absmax
at 1e-4, and on SM100 it wants power-of-two UE8M0 scales packed four to an int32; neither is done
here: an all-zero group gets scale 0.) The 128x4 swizzle is the CUTLASS `Sm1xxBlockScaledConfig` /
FlashInfer / TensorRT-LLM layout read by the NVFP4 GEMMs: byte offset of scale (m, k) =
(m // 128) * (K4 * 512) + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4, with
K4 = ceil(H / 64) (FlashInfer `include/flashinfer/comm/trtllm_allreduce_fusion.cuh`,
`get_sf_out_offset_128x4`); padding rows and columns are written as zeros, as the GEMMs need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1
NVFP4_BLOCK = 16  # elements per e4m3 block scale (NVFP4's definition)
DEEPGEMM_GROUP = 128  # DeepGEMM's activation group along K

KINDS = ("fp8_static", "fp8_per_token", "fp8_per_group", "nvfp4")
LAYOUTS = {"fp8_static": ("row",), "fp8_per_token": ("row",), "fp8_per_group": ("row", "col"),
           "nvfp4": ("linear", "swizzled")}
# The compute capability from which PTX has an e4m3 conversion (cvt.rn.satfinite.e4m3x2.f32,
# PTX ISA: requires sm_89). Below it the software conversion runs; it gives the same bits.
FP8_CVT_MIN_CAPABILITY = (8, 9)
# The e2m1 conversion (cvt.rn.satfinite.e2m1x2.f32) exists on sm_100a-class targets (Blackwell:
# sm_100a, sm_101a/sm_110a, sm_120a), which Triton compiles for from compute capability 10.0.
FP4_CVT_MIN_CAPABILITY = (10, 0)


@dataclass(frozen=True, eq=False)
class QuantSpec:
    """One quantized-output format. Build it with `fp8_static`, `fp8_per_token`, `fp8_per_group`
    or `nvfp4`. `scale` (fp8_static) and `global_scale` (nvfp4) are fp32 tensors of one element
    on the data's device (a float is filled on the device at call time); they are data, not part of
    the format, so `key` (what kernels are compiled for) leaves them out. Compared by identity."""

    kind: str
    group: int = 0  # elements per scale: H (token), g (group), 16 (nvfp4); 0 for static
    layout: str = "row"  # fp8_per_group: "row" | "col"; nvfp4: "linear" | "swizzled"
    scale_ub: float | None = None  # fp8_per_token / fp8_per_group: upper bound on each scale
    with_normed: bool = False  # also return the unquantized normed output (dtype of x)
    scale: Any = field(default=None, repr=False)  # fp8_static scale / nvfp4 global scale

    @property
    def key(self) -> str:
        """The format without its data: 'fp8_per_group:128:col', 'nvfp4:16:swizzled:normed'."""
        parts = [self.kind, str(self.group), self.layout]
        if self.scale_ub is not None:
            parts.append("ub")
        if self.with_normed:
            parts.append("normed")
        return ":".join(parts)

    @property
    def is_nvfp4(self) -> bool:
        return self.kind == "nvfp4"

    @property
    def dynamic(self) -> bool:
        return self.kind in ("fp8_per_token", "fp8_per_group")


def fp8_static(scale, *, with_normed: bool = False) -> QuantSpec:
    """e4m3 with one given scale: q = e4m3(y * (1 / scale)); dequantize as q * scale.

    Pass `scale` as an fp32 (1,) tensor on the device, as engines hold it: a Python float is
    filled into a new tensor on every call, one more small kernel (what it costs:
    benchmarks/results/README.md, `extra.scale_arg`)."""
    return QuantSpec("fp8_static", 0, "row", None, with_normed, scale)


def fp8_per_token(*, scale_ub: float | None = None, with_normed: bool = False) -> QuantSpec:
    """e4m3 with one scale per token: scale = min(absmax(row) / 448, scale_ub), written as fp32.

    `scale_ub` bounds the scale itself (vLLM's `scale_ub` bounds the absmax before the division
    by 448: pass its value / 448 for the same effect)."""
    return QuantSpec("fp8_per_token", 0, "row", _ub("fp8_per_token", scale_ub), with_normed)


def fp8_per_group(group: int = DEEPGEMM_GROUP, *, layout: str = "row", scale_ub: float | None = None,
                  with_normed: bool = False) -> QuantSpec:
    """e4m3 with one scale per `group` consecutive columns of a row (128 for DeepGEMM); scales
    row-major (`layout="row"`) or in DeepGEMM's column-major TMA-aligned layout (`"col"`)."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 16 or group & (group - 1):
        raise ValueError(f"fp8_per_group: group {group!r} must be a power of two >= 16; use 128 (DeepGEMM)")
    if layout not in ("row", "col"):
        raise ValueError(f"fp8_per_group: layout {layout!r} is not 'row' or 'col'; use 'col' for DeepGEMM")
    return QuantSpec("fp8_per_group", group, layout, _ub("fp8_per_group", scale_ub), with_normed)


def nvfp4(global_scale, *, swizzled: bool = True, with_normed: bool = False) -> QuantSpec:
    """NVFP4: e2m1 codes two a byte (element 2k in the low nibble), one e4m3 scale per 16
    elements relative to `global_scale` (typically 448 * 6 / amax(x)): block scale =
    e4m3(global_scale * (absmax(block) * fp32(1/6))); q = e2m1(y * (global_scale / block scale))
    (FlashInfer's recipe, `cvt_warp_fp16_to_fp4`). Dequantize as q * block scale / global_scale."""
    return QuantSpec("nvfp4", NVFP4_BLOCK, "swizzled" if swizzled else "linear", None, with_normed, global_scale)


def _ub(op: str, scale_ub):
    if scale_ub is None:
        return None
    if (isinstance(scale_ub, bool) or not isinstance(scale_ub, (int, float)) or not scale_ub > 0
            or scale_ub == float("inf")):
        raise ValueError(f"{op}: scale_ub {scale_ub!r} must be a finite number > 0; omit it for no bound")
    return float(scale_ub)


def kind_of(quant: QuantSpec | None) -> str | None:
    """The format name a Problem carries ('fp8_per_token', ...), None for unquantized output."""
    return None if quant is None else quant.kind


def conversion_path(kind: str, compute_capability: tuple[int, int] | None) -> tuple[bool, str]:
    """(hardware e4m3 conversion used, reason) for format `kind` on a GPU of this capability
    (None: CPU / interpreter). Both paths give the same bits; only the instruction count differs."""
    fp8_hw = compute_capability is not None and tuple(compute_capability) >= FP8_CVT_MIN_CAPABILITY
    fp4_hw = compute_capability is not None and tuple(compute_capability) >= FP4_CVT_MIN_CAPABILITY
    cc = ("no GPU" if compute_capability is None
          else f"compute capability {compute_capability[0]}.{compute_capability[1]}")
    fp8 = ("e4m3 by the hardware cvt (PTX cvt.rn.satfinite.e4m3x2 exists from sm_89; " + cc + ")" if fp8_hw
           else "e4m3 by the software conversion from integer ops (" + cc + "; the e4m3 cvt needs sm_89)")
    if kind == "nvfp4":
        fp4 = ("e2m1 by the hardware cvt (cvt.rn.satfinite.e2m1x2, sm_100a-class; " + cc + ")" if fp4_hw
               else "e2m1 by the software conversion from integer ops (" + cc
               + "; the e2m1 cvt needs sm_100a-class targets)")
        return fp8_hw, fp4 + "; block scales " + fp8
    return fp8_hw, fp8


def admission_reason(kind: str, caps) -> str:
    """The conversion path `kind` takes on the least capable GPU of `caps` (admission's reason)."""
    capabilities = [gpu.compute_capability for gpu in caps.gpus] if caps is not None else []
    return f"{kind}: {conversion_path(kind, min(capabilities) if capabilities else None)[1]}"


class QuantOutput(NamedTuple):
    """What a quantized call returns: `out` (codes), `scale` (see the module table), `residual`
    (the new residual, dtype of x) and `normed` (the unquantized normed output when the spec has
    with_normed=True, else None). Unpack as `q, scale, residual, normed = ...`."""

    out: Any
    scale: Any
    residual: Any
    normed: Any = None
