"""Quantized stores for a fused epilogue: `@triton.jit` helpers over fp32 rows held in registers.

A kernel that has normalised one row into fp32 registers calls `quantize_row` instead of storing
the row in its data dtype; it writes the codes and the scales in the layouts of `tpfuse.quant`
with the arithmetic of `tpfuse.reference.quantize_ref`, bit for bit. Formats (KIND constexpr):

    KIND_FP8_STATIC = 1   q = e4m3(y * inv(scale)), scale from param_ptr
    KIND_FP8_TOKEN  = 2   per-row scale; GROUP is ignored (the whole row)
    KIND_FP8_GROUP  = 3   one scale per GROUP columns
    KIND_NVFP4      = 4   e2m1 pairs, one e4m3 scale per 16 columns, global scale from param_ptr

A fused kernel calls it where it would store the normed row, e.g.

    hw, inv = normed_factors(s, row, cols, mask, res_ptr, w, newres_ptr, H, eps, HAS_RES, SOFT_BF16)
    quantize_row(hw * inv, row, cols, cols < H, M, H, q_ptr, q_row_stride, s_ptr, s_row_stride,
                 s_col_stride, param_ptr, scale_ub, KIND, GROUP, BLOCK_H, SWIZZLED, HAS_UB, HW_CVT)
    # with SWIZZLED, pad_programs(M, H) extra programs (pid >= the row programs) each call
    zero_scale_padding(s_ptr, M, H, pid - row_programs, PAD_WORDS)
    # (a persistent, grid-strided kernel can instead spread chunk = 0 .. pad_programs(M, H) - 1
    # over its programs; M must then be known to every program, as it is)

with the buffers, strides and constexprs of a `QuantBuffers` (`constexprs(BLOCK_H)`), as
`tpfuse.kernels.epilogue.residual_rmsnorm_quant_kernel` does. Every rank quantizes the same
fp32 rows with the same code, so the outputs are identical on every rank.

`quantize_row` takes per-token FP8's absmax from y itself (max |y|, `quantize_ref`); the fused
op defines it from the norm's factors instead (`token_amax`, the contract in `tpfuse.reference`),
which a kernel passes to `quantize_chunk` with ROW_AMAX. They agree except in a degenerate
row (inverse RMS inf: `tpfuse.reference`).

Conversions are built from integer operations on the fp32 bit patterns (`e4m3_code`; `e2m1_code`
also rounds with one fp32 addition), so they run wherever Triton runs: the CPU interpreter, SM80, SM90. HW_CVT (bit
flags, chosen by the launcher from the compute capability, `tpfuse.quant.conversion_path`)
switches to the hardware instructions where they exist: bit 1, the e4m3 rounding by Triton's fp32
-> float8e4nv cast (PTX cvt.rn.satfinite.e4m3x2.f32, sm_89 and newer); bit 2, the e2m1 pairs by
inline cvt.rn.satfinite.e2m1x2.f32 (sm_100a-class, compute capability 10.0 and newer; never in the
interpreter, which has no inline assembly). Same bits, fewer instructions: both instructions round
to nearest even and saturate (infinities too); NaN codes are made the software result's, for e4m3
on four packed codes at a time (`nan_codes`), for e2m1 lane by lane. The e2m1 path
is checked here only as far as it compiles and assembles for sm_100a (tests/kernels/test_quant.py);
its bits on a Blackwell GPU are checked by the GPU tier there.
Absolute maxima are taken over the bit patterns as integers (|y| bits, NaN above inf), so NaN
propagates identically on GPUs (where a float max drops NaN) and in the interpreter (where it
keeps it). No rounding step may be fused into an FMA: every product is rounded (stored to a
register as fp32) before integer ops read its bits.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

KIND_FP8_STATIC = 1
KIND_FP8_TOKEN = 2
KIND_FP8_GROUP = 3
KIND_NVFP4 = 4
KIND_BY_NAME = {"fp8_static": KIND_FP8_STATIC, "fp8_per_token": KIND_FP8_TOKEN, "fp8_per_group": KIND_FP8_GROUP,
                "nvfp4": KIND_NVFP4}

# Globals read inside @triton.jit functions must be tl.constexpr instances.
E4M3_MAX_BITS = tl.constexpr(0x43E00000)  # 448.0
E2M1_MAX_BITS = tl.constexpr(0x40C00000)  # 6.0
PAD_WORDS = tl.constexpr(1024)  # 32-bit scale words zeroed per call of zero_scale_padding
# A predicated plain store of one 32-bit word / of its low byte (PTX lets a wider register feed st.b8).
STORE_B32_IF = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }")
STORE_B8_IF = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b8 [$1], $2; mov.b32 $0, 0; }")
CODE_RUN = tl.constexpr(8)  # one 128-bit access of 16-bit data: 8 elements a thread
NVFP4_MIN_BLOCK = 64  # BLOCK >= 64 so that the 16-column blocks of a row cover align4(H / 16) scales


@triton.jit
def round_bits(a, E_MIN32: tl.constexpr, M: tl.constexpr):
    """Round-to-nearest-even code of non-negative fp32 bit patterns `a` (uint32, at most the
    format's largest finite value) in a minifloat with M mantissa bits whose smallest normal
    exponent is E_MIN32 - 127 (fp32-biased E_MIN32): e4m3 (121, 3), e2m1 (127, 1).

    Normal results: rebias the exponent, round the 23 - M dropped bits (a carry moves into the
    exponent by itself). Subnormal results: shift the significand with its implicit bit right by
    the distance to the subnormal quantum, rounding the same way; a carry gives the smallest
    normal's code, which is the right one."""
    SH: tl.constexpr = 23 - M
    one = tl.full(a.shape, 1, tl.uint32)
    e = a >> 23
    r = a - ((E_MIN32 - 1) << 23)
    normal = (r + ((one << (SH - 1)) - 1) + ((r >> SH) & 1)) >> SH
    sig = (a & 0x7FFFFF) | tl.where(e > 0, one << 23, 0 * one)
    shift = tl.minimum((SH + E_MIN32) - tl.maximum(e, one), 31 * one)
    sub = (sig + ((one << (shift - 1)) - 1) + ((sig >> shift) & 1)) >> shift
    return tl.where(e >= E_MIN32, normal, sub)


@triton.jit
def e4m3_code(x, HW: tl.constexpr):
    """float8_e4m3fn codes of fp32 `x`: RNE, saturating to +-448, NaN -> 0x7F. uint8 with HW (the
    hardware cvt), uint32 (0..255) without."""
    if HW:
        # cvt.rn.satfinite rounds to nearest even and saturates, infinities included (no clamp
        # needed); a NaN may keep its sign (0xFF), which nan_codes drops. No per-element compare:
        # the codes stay packed four to a register.
        code = nan_codes(x.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
    else:
        u = x.to(tl.uint32, bitcast=True)
        a = tl.minimum(u & 0x7FFFFFFF, E4M3_MAX_BITS)  # inf and NaN bits compare above 448's
        code = round_bits(a, 121, 3) | ((u >> 24) & 0x80)
        code = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7F, code)
    return code


@triton.jit
def nan_codes(codes):
    """e4m3 codes (uint8) with every NaN as 0x7F: four codes a register, the bytes whose low seven
    bits are all ones (0x7F, 0xFF: the NaNs) lose their sign bit. Adding 1 to a byte's low seven
    bits carries into its high bit exactly when they are 0x7F, and never into the next byte."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; and.b32 t, $1, 0x7F7F7F7F; add.u32 t, t, 0x01010101; and.b32 t, t, 0x80808080; "
        "xor.b32 t, t, 0xFFFFFFFF; and.b32 $0, $1, t; }",
        "=r,r", [codes], dtype=tl.uint8, is_pure=True, pack=4,
    )


@triton.jit
def e2m1_code(x):
    """e2m1 codes (uint32, 0..15) of fp32 `x`: RNE, saturating to +-6, NaN -> 0x7.

    One fp32 addition rounds: a = min(|x|, 6) plus c = 2^(E + 22), E = max(floor(log2 a), 0), is a
    multiple of ulp(c) = 2^(E - 1), the e2m1 grid step of a's binade (0.5 below 2, 1 in [2, 4), 2
    in [4, 6]), rounded to nearest even by the FPU (a < 2^22: the sum stays in c's binade). The
    sum's bits minus c's count the grid steps k of the rounded value (k = r / 2^(E - 1)), and the
    code of r is k + 2E. No compare chain, no variable shift; subnormal and zero a give c, code 0.
    """
    u = x.to(tl.uint32, bitcast=True)
    a = tl.minimum(u & 0x7FFFFFFF, E2M1_MAX_BITS)  # inf and NaN bits compare above 6's (NaN is patched below)
    e = tl.maximum(a >> 23, 127)  # biased exponent, at least 1.0's: below 2 the grid step is 0.5
    c = (e + 22) << 23
    s = a.to(tl.float32, bitcast=True) + c.to(tl.float32, bitcast=True)
    code = (s.to(tl.uint32, bitcast=True) - c + 2 * (e - 127)) | ((u >> 28) & 0x8)
    return tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7, code)


@triton.jit
def e2m1_pair_hw(lo, hi):
    """(low, high) e2m1 codes of fp32 pairs by the hardware cvt (PTX cvt.rn.satfinite.e2m1x2.f32,
    sm_100a-class targets; its first source goes to the high nibble). NaN lanes are set to 0x7 as
    in `e2m1_code`, so the bits do not depend on what the instruction does with NaN."""
    byte = tl.inline_asm_elementwise(
        "{ .reg .b8 t; cvt.rn.satfinite.e2m1x2.f32 t, $2, $1; mov.b32 $0, {t, 0, 0, 0}; }",
        "=r,f,f", [lo, hi], dtype=tl.uint32, is_pure=True, pack=1,
    )
    lo_nan = (lo.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
    hi_nan = (hi.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
    return tl.where(lo_nan, 0x7, byte & 0xF), tl.where(hi_nan, 0x7, (byte >> 4) & 0xF)


@triton.jit
def e4m3_value(code):
    """fp32 value of non-negative e4m3 codes (uint32 0..0x7F; 0x7F is NaN), exactly."""
    e = code >> 3
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e > 0, normal, m.to(tl.float32) * 0.001953125)  # subnormal: m * 2^-9
    return tl.where(code == 0x7F, float("nan"), v)


@triton.jit
def inverse(scale):
    """0 where scale == 0, else the correctly rounded 1 / scale."""
    return tl.where(scale == 0.0, 0.0, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))


@triton.jit
def quantize_row(
    y, row, cols, cmask, M, H, q_ptr, q_row_stride, s_ptr, s_row_stride, s_col_stride, param_ptr, scale_ub,
    KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr, SWIZZLED: tl.constexpr,
    HAS_UB: tl.constexpr, HW_CVT: tl.constexpr,
):
    """Quantize and store one row.

    y: fp32 [BLOCK], the normalised row (any values in masked lanes); cols = tl.arange(0, BLOCK);
    cmask = cols < H; row: the row index (scalar); M: rows that exist (row >= M stores nothing).
    H: columns, a multiple of GROUP (16 for nvfp4). With SWIZZLED the launch must also zero the
    padding rows' scales (`zero_scale_padding` from `pad_programs(M, H)` extra programs).
    q_ptr: uint8 codes, row r at q_ptr + r * q_row_stride (H bytes, or H/2 for nvfp4).
    s_ptr: scales: fp32 at s_ptr + r * s_row_stride + g * s_col_stride (token: g = 0; group: g =
    column // GROUP; any strides, e.g. DeepGEMM's column-major (1, align4(M))); nvfp4: uint8
    e4m3, linear at s_ptr + r * s_row_stride + g, or at the 128x4 offset with SWIZZLED (strides
    ignored; the padded columns up to align4(H/16) are zeroed). param_ptr: fp32 static scale
    (KIND 1) or global scale (KIND 4); unused otherwise. scale_ub: fp32 bound on dynamic scales,
    used when HAS_UB. BLOCK: a power of two >= H (and >= 64 for nvfp4).
    """
    quantize_chunk(y, row, 0, M, H, q_ptr, q_row_stride, s_ptr, s_row_stride, s_col_stride, load_param(param_ptr, KIND),
                   scale_ub, 0, KIND, GROUP, BLOCK, SWIZZLED, HAS_UB, HW_CVT, False)


@triton.jit
def load_param(param_ptr, KIND: tl.constexpr):
    """The fp32 static scale (KIND 1) or global scale (KIND 4) at param_ptr; 0.0 for the other
    formats (whose param_ptr may point anywhere). One scalar load: a kernel that can, loads it
    early, off the dependency chain of its rows."""
    if (KIND == 1) | (KIND == 4):
        param = tl.load(param_ptr).to(tl.float32)
    else:
        param = 0.0
    return param


@triton.jit
def abs_bits(y, mask):
    """|y| as uint32 bit patterns (NaN above inf), 0 in masked lanes: maxima of these are absmax."""
    return tl.where(mask, y.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, 0)


@triton.jit
def token_amax(hw_amax, inv):
    """Per-token FP8's row absmax in the fused op, as bits for `quantize_chunk`'s ROW_AMAX: the
    row's inverse RMS `inv` times its max |h * w| (`hw_amax`, bits as `abs_bits` maxima give),
    which is max |(h * w) * inv| as fp32 rounding is monotone (`tpfuse.reference`). A split row
    knows it once it knows its sum of squares: its chunks exchange both maxima together."""
    return (hw_amax.to(tl.uint32).to(tl.float32, bitcast=True) * inv).to(tl.uint32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def quantize_chunk(
    y, row, start, M, H, q_ptr, q_row_stride, s_ptr, s_row_stride, s_col_stride, param, scale_ub, row_amax,
    KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr, SWIZZLED: tl.constexpr,
    HAS_UB: tl.constexpr, HW_CVT: tl.constexpr, ROW_AMAX: tl.constexpr,
):
    """Quantize and store columns start .. start + BLOCK - 1 of one row (`quantize_row` is the
    chunk that starts at 0 and covers the row); what a kernel that holds a row in several chunks
    (the peer kernels' split rows) calls once per chunk.

    y: fp32 [BLOCK] (BLOCK a power of two). start: a multiple of BLOCK, and BLOCK a multiple of
    GROUP for per-group FP8 and of 64 for NVFP4 (so a chunk holds whole scale blocks and the last
    chunk of a row covers the padded scale columns up to align4(H/16)). Per-token FP8: with
    ROW_AMAX the row's absolute maximum comes in as `row_amax` (uint32 bits, as `abs_bits` gives:
    the maximum over the row's chunks), else the chunk must be the whole row; only the chunk that
    starts at 0 stores the row's scale. `param`: the fp32 static or global scale (`load_param`).
    Other arguments as `quantize_row`.
    """
    cols = tl.arange(0, BLOCK)
    gcols = start + cols
    mask = (gcols < H) & ((row + 0 * cols) < M)
    qrow = q_ptr + row.to(tl.int64) * q_row_stride
    if KIND == 1:
        store_runs(qrow + start, e4m3_code(y * inverse(param), HW_CVT & 1).to(tl.uint8), H - start, row, M, BLOCK,
                   CODE_RUN)
    elif KIND == 2:
        # one scale for the row: scalars, no reshape, one thread stores it
        if ROW_AMAX:
            amax = row_amax.to(tl.uint32).to(tl.float32, bitcast=True)
        else:
            amax = tl.max(abs_bits(y, mask), axis=0).to(tl.float32, bitcast=True)
        scale = dynamic_scale(amax, scale_ub, HAS_UB)
        store_runs(qrow + start, e4m3_code(y * inverse(scale), HW_CVT & 1).to(tl.uint8), H - start, row, M, BLOCK,
                   CODE_RUN)
        tl.store(s_ptr + row.to(tl.int64) * s_row_stride, scale, mask=(row < M) & (start == 0))
    else:
        G: tl.constexpr = GROUP
        NG: tl.constexpr = BLOCK // G
        gidx = start // G + tl.arange(0, NG)  # this chunk's scale blocks, numbered along the row
        amax = tl.max(tl.reshape(abs_bits(y, mask), [NG, G]), axis=1).to(tl.float32, bitcast=True)
        y2 = tl.reshape(y, [NG, G])
        srow = row + 0 * gidx
        if KIND == 4:
            # 0.1666...: fp32(1/6), FlashInfer's RECIPROCAL_6
            sf_code = e4m3_code(param * (amax * 0.16666667163372040), HW_CVT & 1).to(tl.uint32)
            sfv = e4m3_value(sf_code)
            out_scale = tl.where(sfv == 0.0, 0.0, tl.math.div_rn(tl.zeros_like(sfv) + param, sfv))
            q = tl.reshape(y2 * out_scale[:, None], [BLOCK])
            if HW_CVT & 2:
                lo, hi = e2m1_pair_hw(*tl.split(tl.reshape(q, [BLOCK // 2, 2])))
            else:
                lo, hi = tl.split(tl.reshape(e2m1_code(q), [BLOCK // 2, 2]))
            store_runs(qrow + start // 2, (lo | (hi << 4)).to(tl.uint8), (H - start) // 2, row, M, BLOCK // 2,
                       CODE_RUN // 2)
            k_real = H // 16
            value = tl.where((gidx < k_real) & (srow < M), sf_code, 0).to(tl.uint8)
            if SWIZZLED:
                k4 = (k_real + 3) // 4
                offs = ((srow // 128).to(tl.int64) * (k4 * 512) + (gidx // 4) * 512
                        + (srow % 32) * 16 + ((srow % 128) // 32) * 4 + gidx % 4)
                store_scales(s_ptr + offs, value, (gidx < 4 * k4) & (srow < M), HW_CVT & 4)
            else:
                store_scales(s_ptr + srow.to(tl.int64) * s_row_stride + gidx, value, (gidx < k_real) & (srow < M),
                             HW_CVT & 4)
        else:
            scale = dynamic_scale(amax, scale_ub, HAS_UB)
            codes = tl.reshape(e4m3_code(y2 * inverse(scale)[:, None], HW_CVT & 1), [BLOCK]).to(tl.uint8)
            store_runs(qrow + start, codes, H - start, row, M, BLOCK, CODE_RUN)
            smask = (gidx < H // G) & (srow < M)
            store_scales(s_ptr + row.to(tl.int64) * s_row_stride + gidx * s_col_stride, scale, smask, HW_CVT & 4)
            # Column-major (DeepGEMM) scales are stored (H/G, align4(M)) and handed over whole: the
            # last row's program zeroes rows M .. align4(M) - 1 too, so no byte of them is left
            # unwritten. Row-major scales (column stride 1) have no padding rows.
            # (the stride test broadcast to a vector: the interpreter rejects a mask of a scalar test)
            col_major = (0 * gidx + s_col_stride) > 1
            pad = (gidx < H // G) & (srow == M - 1) & col_major
            for p in tl.static_range(1, 4):
                tl.store(s_ptr + (row + p).to(tl.int64) * s_row_stride + gidx * s_col_stride, tl.zeros_like(scale),
                         mask=pad & (srow + p < (M + 3) // 4 * 4))


@triton.jit
def store_scales(ptrs, values, mask, ASM: tl.constexpr):
    """Store a chunk's per-block scales (fp32, or uint8 e4m3 codes) from the layout they were
    reduced into. With ASM (a GPU build) through an inline st.global, which Triton leaves where it
    is: its own store gave the [NG] vector a layout of its own and moved the scales there through
    shared memory first (a barrier pair on the path of every row). Threads that hold the same
    block's scale store the same bytes."""
    if ASM:
        bits = values.to(tl.uint32, bitcast=True) if values.dtype == tl.float32 else values.to(tl.uint32)
        if values.dtype == tl.float32:
            tl.inline_asm_elementwise(STORE_B32_IF, "=r,l,r,r", [ptrs.to(tl.int64), bits, mask.to(tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(STORE_B8_IF, "=r,l,r,r", [ptrs.to(tl.int64), bits, mask.to(tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptrs, values, mask=mask)


@triton.jit
def store_runs(ptr, values, valid, row, M, N: tl.constexpr, RUN: tl.constexpr):
    """Store bytes `values` [N] at ptr + 0 .. N - 1, those below `valid` of a row below M, in runs
    of RUN per thread: the offsets as (N / RUN, RUN) tell Triton that only RUN bytes are
    contiguous (a flat uint8 store gets 16 a thread, and Triton then moves the 16-bit data's row
    through shared memory, two barriers, to give every tensor that layout). The mask is built on
    the 2-D offsets, so that Triton sees it constant over each run (`valid` a multiple of RUN) and
    vectorises the store; a reshaped 1-D mask made Triton 3.6 store byte by byte."""
    offs = tl.arange(0, N // RUN)[:, None] * RUN + tl.arange(0, RUN)[None, :]
    mask = (offs < valid) & ((row + 0 * offs) < M)
    tl.store(ptr + offs, tl.reshape(values, [N // RUN, RUN]), mask=mask)


@triton.jit
def dynamic_scale(amax, scale_ub, HAS_UB: tl.constexpr):
    """amax / 448 (correctly rounded), bounded by scale_ub when HAS_UB; a NaN amax gives the
    canonical quiet NaN (0x7FC00000), as the reference's: GPU division returns 0x7FFFFFFF, the
    interpreter the input's pattern."""
    scale = tl.math.div_rn(amax, tl.zeros_like(amax) + 448.0)
    if HAS_UB:
        scale = tl.where(scale > scale_ub, scale_ub, scale)
    nan = (tl.zeros_like(amax.to(tl.int32, bitcast=True)) + 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where(amax != amax, nan, scale)


def pad_programs(m: int, h: int) -> int:
    """Calls of `zero_scale_padding` (extra programs of a launch) that 128x4-swizzled NVFP4 scales of
    m rows x h columns need: the last 128-row tile's words, PAD_WORDS a call, where it has padding
    rows (m not a multiple of 128), else none."""
    if m % 128 == 0:
        return 0
    return -(-(-(-(h // 16) // 4) * 128) // PAD_WORDS.value)


@triton.jit
def zero_scale_padding(s_ptr, M, H, chunk, WORDS: tl.constexpr):
    """Zero the 128x4-swizzled NVFP4 scales of the padding rows M .. align128(M) - 1, all columns
    up to align4(H / 16): words chunk * WORDS .. + WORDS - 1 of the last tile (`pad_programs` calls,
    chunk = 0, 1, ...). The NVFP4 GEMMs read the whole padded tile. In the 128x4 layout a 32-bit
    word holds one row's scales of four consecutive 16-column blocks; word w of a 512-byte block
    holds row (w % 4) * 32 + (w % 128) // 4 of its tile, and a tile's blocks lie one after the
    other, so the tile is align4(H / 16) / 4 * 128 consecutive words: each warp's store is one
    128-byte line, and no word of a row below M (which its row's program stores) is written. The
    buffer must be 4-byte aligned (`QuantBuffers` allocates it). A launch gives these calls to extra
    programs, or a kernel spreads them over its programs where they wait anyway: at decode sizes
    they add no latency to the rows."""
    k4 = (H // 16 + 3) // 4
    tile = M // 128
    w = chunk * WORDS + tl.arange(0, WORDS)
    row = tile * 128 + (w % 4) * 32 + (w % 128) // 4
    words = s_ptr.to(tl.pointer_type(tl.int32)) + tile.to(tl.int64) * (k4 * 128)
    tl.store(words + w, tl.zeros([WORDS], tl.int32), mask=(w < k4 * 128) & (row >= M) & (row < (M + 127) // 128 * 128))


@triton.jit
def quantize_rows_kernel(
    y_ptr, M, H, q_ptr, s_ptr, s_row_stride, s_col_stride, param_ptr, scale_ub,
    KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr, SWIZZLED: tl.constexpr,
    HAS_UB: tl.constexpr, HW_CVT: tl.constexpr,
):
    """Quantize rows (M, H) from memory (fp32, or 16-bit widened exactly), one row per program:
    the helpers alone, for tests and as a standalone quantizer."""
    row = tl.program_id(0)
    if row < M:
        param = load_param(param_ptr, KIND)  # issued before the row's load, so its latency overlaps it
        cols = tl.arange(0, BLOCK)
        cmask = cols < H
        y = tl.load(y_ptr + row.to(tl.int64) * H + cols, mask=cmask & ((row + 0 * cols) < M), other=0.0).to(tl.float32)
        q_stride = H // 2 if KIND == 4 else H
        quantize_chunk(y, row, 0, M, H, q_ptr, q_stride, s_ptr, s_row_stride, s_col_stride, param, scale_ub, 0,
                       KIND, GROUP, BLOCK, SWIZZLED, HAS_UB, HW_CVT, False)
    elif SWIZZLED:
        zero_scale_padding(s_ptr, M, H, row - M, PAD_WORDS)


def block_for(hidden: int, kind: str) -> int:
    """BLOCK for `quantize_row`: the next power of two >= hidden (>= 64 for nvfp4)."""
    block = triton.next_power_of_2(hidden)
    return max(block, NVFP4_MIN_BLOCK) if kind == "nvfp4" else block


class QuantBuffers:
    """Outputs of one quantized call and the `quantize_row` arguments that address them."""

    def __init__(self, quant, m: int, h: int, device, hw_fp8: bool, hw_fp4: bool = False) -> None:
        import torch

        self.kind = KIND_BY_NAME[quant.kind]
        self.group = quant.group or 16
        self.swizzled = quant.layout == "swizzled"
        self.has_ub = quant.scale_ub is not None
        self.scale_ub = float(quant.scale_ub) if self.has_ub else 0.0
        self.hw_cvt = hw_bits(hw_fp8, hw_fp4)
        self.sf_m = m
        if quant.kind == "nvfp4":
            self.codes = torch.empty(m, h // 2, dtype=torch.uint8, device=device)
            self.out = self.codes
            k = h // 16
            if self.swizzled:
                self.sf_m = -(-m // 128) * 128
                self.scales = torch.empty(self.sf_m, -(-k // 4) * 4, dtype=torch.uint8, device=device)
            else:
                self.scales = torch.empty(m, k, dtype=torch.uint8, device=device)
            self.scale = self.scales.view(torch.float8_e4m3fn)
            self.s_strides = (self.scales.stride(0), 1)
        else:
            self.codes = torch.empty(m, h, dtype=torch.uint8, device=device)
            self.out = self.codes.view(torch.float8_e4m3fn)
            if quant.kind == "fp8_static":
                self.scales = None
                self.s_strides = (0, 0)
            elif quant.kind == "fp8_per_token":
                self.scales = torch.empty(m, 1, dtype=torch.float32, device=device)
                self.s_strides = (1, 0)
            elif quant.layout == "col":  # DeepGEMM: (G, align4(M)) storage, an (M, G) view
                storage = torch.empty(h // quant.group, -(-m // 4) * 4, dtype=torch.float32, device=device)
                self.scales = storage.t()[:m]
                self.s_strides = (1, storage.stride(0))
            else:
                self.scales = torch.empty(m, h // quant.group, dtype=torch.float32, device=device)
                self.s_strides = (self.scales.stride(0), 1)
            self.scale = self.scales
        self.param = _param(quant.scale, device) if quant.kind in ("fp8_static", "nvfp4") else self.codes
        if quant.kind == "fp8_static":
            self.scale = self.param
            self.scales = self.codes  # any tensor: the kernel stores no scales

    def constexprs(self, block: int) -> dict:
        return dict(KIND=self.kind, GROUP=self.group, BLOCK=block, SWIZZLED=self.swizzled, HAS_UB=self.has_ub,
                    HW_CVT=self.hw_cvt)


def hw_bits(hw_fp8: bool, hw_fp4: bool) -> int:
    """HW_CVT of a launch: bit 1 the e4m3 cvt, bit 2 the e2m1 cvt (where the GPU has them), bit 4
    inline PTX (every GPU build: the scale stores of `store_scales`). 0 in the interpreter: its
    float8 cast truncates and it has no inline assembly."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return 0
    return int(hw_fp8) | (2 if hw_fp4 else 0) | 4


def _param(value, device):
    import torch

    if isinstance(value, torch.Tensor):
        return value
    return torch.full((1,), float(value), dtype=torch.float32, device=device)  # filled on the device: capturable


def quantize(y, quant, *, hw_fp8: bool = False, hw_fp4: bool = False):
    """(codes, scale) of rows `y` (M, H; fp32, bf16 or fp16, contiguous) through the Triton
    helpers, one row per program: the quantizer as a separate kernel."""
    m, h = y.shape
    buf = QuantBuffers(quant, m, h, y.device, hw_fp8, hw_fp4)
    if m:
        quantize_rows_kernel[(m + (pad_programs(m, h) if buf.swizzled else 0),)](
            y, m, h, buf.codes, buf.scales, *buf.s_strides, buf.param, buf.scale_ub,
            **buf.constexprs(block_for(h, quant.kind)),
        )
    return buf.out, buf.scale
