"""Fused residual-add + RMSNorm: one pass over x, residual and weight; writes normed and new_residual.

    new_residual = round_dt(f32(s) + f32(residual))          # s itself when residual is None
    normed       = round_dt((h * f32(weight)) * (1 / sqrt(sum(h^2) / H + eps))),  h = f32(new_residual)

the rounding points of `tpfuse.reference.residual_rmsnorm_ref`. new_residual matches the
reference bit for bit. normed differs from it only through the order of the H-term sum of squares
(a tree here, sequential in torch), so it matches within `TOLERANCE`, and exactly whenever that
sum is exact (small-integer inputs). 1/sqrt is computed correctly rounded (sqrt_rn, div_rn), not
with the approximate rsqrt, for the same reason.

Shapes: s, residual, normed, new_residual (M, H) contiguous; weight (H,). Any H up to 16384 (one
program holds a whole row in registers: BLOCK_H = next power of two >= H, masked; with quantized
output a row may instead be cut into slices, one program each, or held in two power-of-two parts:
`quant_launch_config`); bf16, fp16 and fp32. `residual_rmsnorm` is the validated launcher,
`launch_residual_rmsnorm` the same launch for callers that validated (strategies): one Triton
launch pre-bound per shape (`tpfuse.kernels.launcher`), so a steady-state call costs the outputs'
allocation and the launch.
`epilogue_row` is the per-row helper the fused collectives call. CUDA-graph safe: no host sync,
no allocation except the outputs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tpfuse.kernels.device import hardware_fp4, hardware_fp8, interpreting
from tpfuse.kernels.launcher import PreboundLaunch, bind
from tpfuse.kernels.protocol import MAX_HIDDEN  # one row in registers: 16384 fp32 over 16 warps = 32 a thread
from tpfuse.kernels.quant import (
    PAD_WORDS,
    QuantBuffers,
    abs_bits,
    block_for,
    load_param,
    pad_programs,
    quantize_chunk,
    token_amax,
    zero_scale_padding,
)
from tpfuse.quant import QuantOutput
from tpfuse.validation import check_quant

SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def round_like(y, like, SOFT_BF16: tl.constexpr):
    """fp32 `y` rounded to nearest-even in `like`'s dtype.

    The Triton 3.6 interpreter truncates fp32 -> bf16 casts (and its "rtne" mode does not carry
    into the exponent), so with SOFT_BF16 the rounding is done on the bits, as torch does it on
    CPU. GPUs use the native conversion (cvt.rn), which gives the same bits.
    """
    if SOFT_BF16 and like.dtype == tl.bfloat16:
        u = y.to(tl.uint32, bitcast=True)
        u = u + 0x7FFF + ((u >> 16) & 1)
        r = (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        r = y.to(like.dtype)
    return r


@triton.jit
def load_weight(w_ptr, cols, cmask, HAS_NORM: tl.constexpr):
    """The RMSNorm weight as an fp32 row (zeros without norm, where w_ptr may be any tensor)."""
    return tl.load(w_ptr + cols, mask=cmask & HAS_NORM, other=0.0).to(tl.float32)


@triton.jit
def epilogue_row(
    s, row, cols, mask, res_ptr, w, out_ptr, newres_ptr, H, eps,
    HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    """Finish one row from its allreduce output `s` (already rounded to the data dtype).

    `w` is the weight row already loaded in fp32 (see `load_weight`): loading it once per program,
    before any row, takes its latency off the row's dependency chain (load, add, reduce, scale).
    HAS_NORM=False stores s to `out_ptr` (the plain allreduce). Offsets are int64 so that
    M x H may exceed 2^31 elements.
    """
    offs = row.to(tl.int64) * H + cols
    if HAS_NORM:
        hw, inv = normed_factors(s, row, cols, mask, res_ptr, w, newres_ptr, H, eps, HAS_RES, SOFT_BF16)
        tl.store(out_ptr + offs, round_like(hw * inv, s, SOFT_BF16), mask=mask)
    else:
        tl.store(out_ptr + offs, s, mask=mask)


@triton.jit
def normed_factors(s, row, cols, mask, res_ptr, w, newres_ptr, H, eps, HAS_RES: tl.constexpr,
                   SOFT_BF16: tl.constexpr):
    """Store the row's new residual and return (h * w, the row's inverse RMS) in fp32: their
    product is the normed row before any rounding, what `epilogue_row` rounds to the data dtype and
    `tpfuse.kernels.quant.quantize_row` quantizes (per-token FP8's absmax comes from the factors:
    `tpfuse.kernels.quant.token_amax`)."""
    offs = row.to(tl.int64) * H + cols
    nr = new_residual(s, offs, mask, res_ptr, HAS_RES, SOFT_BF16)
    tl.store(newres_ptr + offs, nr, mask=mask)
    h = nr.to(tl.float32)
    return h * w, inverse_rms(h, H, eps)


@triton.jit
def new_residual(s, offs, mask, res_ptr, HAS_RES: tl.constexpr, SOFT_BF16: tl.constexpr):
    """s + residual rounded to s's dtype (s itself without a residual), s's elements at `offs`."""
    if HAS_RES:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        nr = round_like(s.to(tl.float32) + r.to(tl.float32), s, SOFT_BF16)
    else:
        nr = s
    return nr


@triton.jit
def inverse_rms(h, H, eps):
    """1 / sqrt(mean(h^2) + eps) of a whole fp32 row `h` (zeros in masked lanes), correctly rounded."""
    return inverse_rms_of(tl.sum(h * h, axis=0), H, eps)


@triton.jit
def inverse_rms_of(ss, H, eps):
    """1 / sqrt(ss / H + eps), correctly rounded, from a row's fp32 sum of squares `ss`."""
    ms = tl.math.div_rn(ss, H.to(tl.float32))
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))


@triton.jit
def part_residual(s_ptr, res_ptr, newres_ptr, row, cols, M, H, HAS_RES: tl.constexpr, SOFT_BF16: tl.constexpr):
    """Columns `cols` of one row: (input, mask, new residual in fp32), the new residual stored."""
    s, mask = load_row(s_ptr, row, cols, cols < H, M, H)
    offs = row.to(tl.int64) * H + cols
    nr = new_residual(s, offs, mask, res_ptr, HAS_RES, SOFT_BF16)
    tl.store(newres_ptr + offs, nr, mask=mask)
    return s, mask, nr.to(tl.float32)


@triton.jit
def load_row(s_ptr, row, cols, cmask, M, H):
    """(row `row` of the (M, H) input, its mask); rows >= M load zeros."""
    # The row test is broadcast to a vector first: Triton 3.9's interpreter rejects a mask
    # built from a vector & a scalar comparison (compiled, both forms give identical sm90 PTX).
    mask = cmask & ((row + 0 * cols) < M)
    return tl.load(s_ptr + row.to(tl.int64) * H + cols, mask=mask, other=0.0), mask


@triton.jit(do_not_specialize=["M"])  # H stays specialised: its divisibility by 16 enables 128-bit accesses
def residual_rmsnorm_kernel(
    s_ptr, res_ptr, w_ptr, out_ptr, newres_ptr, M, H, eps,
    BLOCK_H: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    """Program p handles rows p*ROWS .. p*ROWS+ROWS-1 (the last program masks its tail)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = load_weight(w_ptr, cols, cmask, True)
    for i in tl.static_range(ROWS):
        row = pid * ROWS + i
        s, mask = load_row(s_ptr, row, cols, cmask, M, H)
        epilogue_row(s, row, cols, mask, res_ptr, w, out_ptr, newres_ptr, H, eps, HAS_RES, True, SOFT_BF16)


@triton.jit(do_not_specialize=["M", "s_row_stride", "s_col_stride"])
def residual_rmsnorm_quant_kernel(
    s_ptr, res_ptr, w_ptr, out_ptr, newres_ptr, M, H, eps,
    q_ptr, q_row_stride, sc_ptr, s_row_stride, s_col_stride, param_ptr, scale_ub,
    BLOCK_H: tl.constexpr, ROWS: tl.constexpr, SLICE: tl.constexpr, HAS_RES: tl.constexpr, SOFT_BF16: tl.constexpr,
    WITH_NORMED: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr, SWIZZLED: tl.constexpr,
    HAS_UB: tl.constexpr, HW_CVT: tl.constexpr, P1: tl.constexpr = 0,
):
    """The epilogue with quantized output (`tpfuse.kernels.quant.quantize_chunk`); with swizzled
    NVFP4 scales the programs after the row programs zero the scales of the padding rows.

    SLICE == BLOCK_H: program p finishes rows p*ROWS .. p*ROWS+ROWS-1 whole. SLICE < BLOCK_H (ROWS
    1): cdiv(H, SLICE) programs share a row, program p taking row p // parts and its columns
    (p % parts) * SLICE .. + SLICE - 1. Each of them reads the whole row for its sum of squares
    (per-token FP8: and its absmax), so every program of a row computes the same fp32 values, then
    stores the new residual and the quantized output of its columns only: at decode sizes the
    per-element work of the conversion is spread over that many SMs instead of one.

    P1 > 0 (whole rows, `row_parts`): a row is held in two parts, of BLOCK_H and P1 columns
    (powers of two that add up to H), so that no lane is masked: with one masked block of
    next_pow2(H) columns, a quarter of the conversion work at H = 6144 was on masked lanes."""
    pid = tl.program_id(0)
    if SLICE < BLOCK_H:
        parts = (H + SLICE - 1) // SLICE
        row_programs = M * parts
    else:
        parts = 1
        row_programs = (M + ROWS - 1) // ROWS
    if pid < row_programs:
        if SLICE < BLOCK_H:
            row = pid // parts
            start = (pid % parts) * SLICE
            full = tl.arange(0, BLOCK_H)
            fmask = full < H
            cols = start + tl.arange(0, SLICE)
            cmask = cols < H
            w = load_weight(w_ptr, cols, cmask, True)
            param = load_param(param_ptr, KIND)  # with the weight, off the row's dependency chain
            s_all, m_all = load_row(s_ptr, row, full, fmask, M, H)
            h_all = new_residual(s_all, row.to(tl.int64) * H + full, m_all, res_ptr, HAS_RES, SOFT_BF16).to(tl.float32)
            inv = inverse_rms(h_all, H, eps)
            amax = 0
            if KIND == 2:  # the row's absmax, from the whole row every program of the row reads alike
                amax = token_amax(tl.max(abs_bits(h_all * load_weight(w_ptr, full, fmask, True), m_all), axis=0), inv)
            s, mask = load_row(s_ptr, row, cols, cmask, M, H)
            offs = row.to(tl.int64) * H + cols
            nr = new_residual(s, offs, mask, res_ptr, HAS_RES, SOFT_BF16)
            tl.store(newres_ptr + offs, nr, mask=mask)
            y = (nr.to(tl.float32) * w) * inv
            if WITH_NORMED:
                tl.store(out_ptr + offs, round_like(y, s, SOFT_BF16), mask=mask)
            quantize_chunk(y, row, start, M, H, q_ptr, q_row_stride, sc_ptr, s_row_stride, s_col_stride, param,
                           scale_ub, amax, KIND, GROUP, SLICE, SWIZZLED, HAS_UB, HW_CVT, KIND == 2)
        elif P1 > 0:
            cols0 = tl.arange(0, BLOCK_H)
            cols1 = BLOCK_H + tl.arange(0, P1)
            w0 = load_weight(w_ptr, cols0, cols0 < H, True)
            w1 = load_weight(w_ptr, cols1, cols1 < H, True)
            param = load_param(param_ptr, KIND)  # with the weights, off the rows' dependency chains
            for i in tl.static_range(ROWS):
                row = pid * ROWS + i
                s0, m0, h0 = part_residual(s_ptr, res_ptr, newres_ptr, row, cols0, M, H, HAS_RES, SOFT_BF16)
                s1, m1, h1 = part_residual(s_ptr, res_ptr, newres_ptr, row, cols1, M, H, HAS_RES, SOFT_BF16)
                # one block reduction for the row: the first part folded onto the second's columns first
                inv = inverse_rms_of(tl.sum(tl.sum(tl.reshape(h0 * h0, [BLOCK_H // P1, P1]), axis=0) + h1 * h1,
                                            axis=0), H, eps)
                hw0 = h0 * w0
                hw1 = h1 * w1
                y0 = hw0 * inv
                y1 = hw1 * inv
                amax = 0
                if KIND == 2:  # the row's absmax over its parts, in one block reduction as the sum
                    amax = token_amax(tl.max(tl.maximum(tl.max(tl.reshape(abs_bits(hw0, m0), [BLOCK_H // P1, P1]),
                                                               axis=0), abs_bits(hw1, m1)), axis=0), inv)
                if WITH_NORMED:
                    tl.store(out_ptr + row.to(tl.int64) * H + cols0, round_like(y0, s0, SOFT_BF16), mask=m0)
                    tl.store(out_ptr + row.to(tl.int64) * H + cols1, round_like(y1, s1, SOFT_BF16), mask=m1)
                quantize_chunk(y0, row, 0, M, H, q_ptr, q_row_stride, sc_ptr, s_row_stride, s_col_stride, param,
                               scale_ub, amax, KIND, GROUP, BLOCK_H, SWIZZLED, HAS_UB, HW_CVT, KIND == 2)
                quantize_chunk(y1, row, BLOCK_H, M, H, q_ptr, q_row_stride, sc_ptr, s_row_stride, s_col_stride,
                               param, scale_ub, amax, KIND, GROUP, P1, SWIZZLED, HAS_UB, HW_CVT, KIND == 2)
        else:
            cols = tl.arange(0, BLOCK_H)
            cmask = cols < H
            w = load_weight(w_ptr, cols, cmask, True)
            param = load_param(param_ptr, KIND)  # with the weight, off the rows' dependency chains
            for i in tl.static_range(ROWS):
                row = pid * ROWS + i
                s, mask = load_row(s_ptr, row, cols, cmask, M, H)
                hw, inv = normed_factors(s, row, cols, mask, res_ptr, w, newres_ptr, H, eps, HAS_RES, SOFT_BF16)
                y = hw * inv
                amax = 0
                if KIND == 2:
                    amax = token_amax(tl.max(abs_bits(hw, mask), axis=0), inv)
                if WITH_NORMED:
                    tl.store(out_ptr + row.to(tl.int64) * H + cols, round_like(y, s, SOFT_BF16), mask=mask)
                quantize_chunk(y, row, 0, M, H, q_ptr, q_row_stride, sc_ptr, s_row_stride, s_col_stride, param,
                               scale_ub, amax, KIND, GROUP, BLOCK_H, SWIZZLED, HAS_UB, HW_CVT, KIND == 2)
    elif SWIZZLED:
        zero_scale_padding(sc_ptr, M, H, pid - row_programs, PAD_WORDS)


def launch_config(hidden: int, itemsize: int, num_tokens: int, quantized: bool = False) -> tuple[int, int, int]:
    """(BLOCK_H, num_warps, rows per program), a pure function of the shape and of whether the
    output is quantized.

    Up to 16 warps, one 128-bit access per thread per tensor and row, for one row's latency at
    decode sizes and for bandwidth at prefill sizes; 4 warps from 256 to 2047 tokens, where more,
    smaller programs fill the GPU better (the warp sweep: benchmarks/results/README.md,
    `epilogue.jsonl`), and with quantized output from 256 tokens on: its longer arithmetic between
    a row's loads and stores is hidden by more programs per SM (`quant.jsonl`, the `fused[w=..]`
    rows). 2 rows per program for short rows at prefill sizes, so that programs are not too small
    to hide latency.
    """
    block = triton.next_power_of_2(hidden)
    num_warps = max(1, min(16, block * itemsize // (16 * 32)))
    if 256 <= num_tokens < 2048 or (quantized and num_tokens >= 256):
        num_warps = min(num_warps, 4)
    rows = 2 if (hidden <= 2048 and num_tokens >= 1024) else 1
    return block, num_warps, rows


# Where per-group FP8 and NVFP4 cut rows into slices, from the `fused[w=..,r=1,s=..]` sweeps in
# `quant.jsonl` (benchmarks/results/README.md, "Quantized epilogue: rows cut into slices at decode"
# and "... slices up to 64 tokens"): the narrowest slice of at least SLICE_COLUMNS columns whose
# grid (tokens x slices a row) stays within SLICE_PROGRAMS, about one program an SM of an H200
# (132); none when only whole rows fit. Warps (slices of SLICE_COLUMNS, wider ones): per-group 8 / 16,
# NVFP4 4 / 8. NVFP4 also keeps whole rows where that slice would cut a row in more than
# NVFP4_MAX_SLICES (4 slices of 2048 at 32 x 7168 measured +1.47 us against whole rows' +0.84,
# 3 of 2048 at 32 x 6144 +0.36 against +0.85). Static FP8 keeps whole rows (slices gained it
# nothing); per-token FP8 keeps whole rows, with PER_TOKEN_DECODE_WARPS warps up to
# PER_TOKEN_DECODE_TOKENS tokens (rows of up to 8192 columns).
SLICE_COLUMNS = 1024
SLICE_PROGRAMS = 128
SLICE_WARPS = {"fp8_per_group": (8, 16), "nvfp4": (4, 8)}
NVFP4_MAX_SLICES = 3
PER_TOKEN_DECODE_TOKENS = 16
PER_TOKEN_DECODE_WARPS = 4
# From this many tokens a row whose columns are a power of two and a smaller one may be held in
# those two parts (`parts_for`), none masked, with one block reduction: NVFP4 and per-group FP8
# where the row fills at most 3/4 of its masked block (per-group x 6144 with WIDE_PARTS' launch,
# below; at 4 warps and no cap slower than the masked block). At 4096 / 16384 tokens (`quant.jsonl`,
# rows of tree 63739f0, `fused[w=4,r=1,parts]` against `fused[w=4,r=1]`, the masked block), us:
# NVFP4 x 5120 62.71 -> 46.38 / 229.37 -> 150.08, x 6144 62.11 -> 58.04 / 224.65 -> 204.40;
# per-group x 5120 52.24 -> 41.06 / 185.96 -> 145.21, x 6144 53.27 -> 53.97 / 191.66 -> 195.70
# (slower, also in an earlier run); static and per-token FP8 within 2% either way; three parts
# (7168 = 4096 + 2048 + 1024, tree 0f621a1) slower for every format.
ROW_PARTS_TOKENS = 256
PARTS_MAX_FILL = {"nvfp4": 0.75, "fp8_per_group": 0.75}
# Where a thread of the default warps would hold more than WIDE_PARTS_ELEMENTS columns of a
# two-part row (6144 at 4 warps: 48), its registers bound the programs an SM holds (sm_90 code
# from Triton 3.6: per-group FP8 149 registers a thread, NVFP4 136, so 3 programs of 128 threads
# an SM): WIDE_PARTS gives such rows (num_warps, REGS), REGS the registers a thread may use (PTX
# .maxnreg; 0: the compiler's choice). Per-group FP8 takes 8 warps (60 registers), NVFP4 4 warps
# capped at 128 (no spill; 4 programs an SM). At 4096 / 16384 tokens x 6144 (`quant.jsonl`, tree
# d3e8148, one H200), us: per-group two parts at 4 warps 53.43 / 195.11, capped at 128 (4 bytes
# spilled) 49.46 / 177.20, at 8 warps 47.99 / 173.31; NVFP4 two parts 56.48 / 200.71, capped
# 50.67 / 179.44, at 8 warps 51.88 / 179.16. Rows of 5120 (40 a thread) gained nothing from
# either (per-group capped 41.13 -> 42.11 at 4096 tokens, at 8 warps 69.10: its part of 1024
# columns holds 4 a thread).
WIDE_PARTS_ELEMENTS = 40
WIDE_PARTS = {"fp8_per_group": (8, 0), "nvfp4": (4, 128)}
MIN_REGS, MAX_REGS = 24, 255  # what PTX .maxnreg takes and ptxas honours


def slice_for(hidden: int, num_tokens: int, block: int, kind: str) -> int:
    """The columns one program of a row quantizes (`block`: whole rows), by the rule above."""
    cut = SLICE_COLUMNS
    while cut < block and num_tokens * -(-hidden // cut) > SLICE_PROGRAMS:
        cut *= 2
    if kind == "nvfp4" and cut > SLICE_COLUMNS and -(-hidden // cut) > NVFP4_MAX_SLICES:
        return block
    return min(cut, block)


def row_parts(hidden: int, block: int) -> int:
    """P1 of a row of `hidden` columns held whole in two parts, of `block` (a power of two below
    hidden) and P1 columns: hidden - block, which must be a smaller power of two. ValueError
    otherwise."""
    rest = hidden - block
    if not (_power_of_two(block) and 0 < rest < block and _power_of_two(rest)):
        raise ValueError(f"a row of {hidden} columns is not {block} and one smaller power of two; use a BLOCK_H of "
                         f"{triton.next_power_of_2(hidden)} (one masked block) instead")
    return rest


def parts_for(hidden: int, block: int, warps: int, kind: str) -> bool:
    """Whether a row at prefill is held in two parts (`row_parts`) rather than one masked block of
    `block` columns: for the formats of PARTS_MAX_FILL, where hidden fills at most that share of
    the block and is block / 2 plus a smaller power of two of at least one code run (8 elements) a
    thread."""
    if hidden > PARTS_MAX_FILL.get(kind, 0.0) * block:
        return False
    try:
        rest = row_parts(hidden, block // 2)
    except ValueError:
        return False
    return rest >= max(64, 8 * 32 * warps)


def quant_launch_config(hidden: int, itemsize: int, num_tokens: int, kind: str, *, group: int = 0
                        ) -> tuple[int, int, int, int, int]:
    """(BLOCK_H, num_warps, rows per program, SLICE, REGS) of the quantized epilogue, a pure
    function of the shape and the format: `launch_config`'s with whole rows (SLICE == BLOCK_H),
    except per-group FP8 (`group`: its columns a scale) and NVFP4 at decode sizes, whose conversion
    work per row is spread over programs of SLICE columns each (`slice_for`), per-token FP8 at
    decode sizes, and NVFP4 and per-group FP8 rows at prefill held in two parts (`parts_for`;
    BLOCK_H below hidden). REGS: the registers a thread may use (`parts_launch`; 0: the compiler's
    choice)."""
    block, warps, rows = launch_config(hidden, itemsize, num_tokens, quantized=True)
    block = max(block, block_for(hidden, kind))
    if kind in SLICE_WARPS and block > SLICE_COLUMNS and SLICE_COLUMNS % max(group, 1) == 0:
        cut = slice_for(hidden, num_tokens, block, kind)
        if cut < block:
            return block, SLICE_WARPS[kind][cut > SLICE_COLUMNS], 1, cut, 0
    if kind == "fp8_per_token" and num_tokens <= PER_TOKEN_DECODE_TOKENS and block <= 8192:
        warps = min(warps, PER_TOKEN_DECODE_WARPS)  # (measured up to 64 elements a thread)
    if num_tokens >= ROW_PARTS_TOKENS and parts_for(hidden, block, warps, kind):
        block //= 2  # the row in two parts (`row_parts`): BLOCK_H below hidden
        warps, regs = parts_launch(hidden, block, warps, kind)
        return block, warps, rows, block, regs
    return block, warps, rows, block, 0


def parts_launch(hidden: int, block: int, warps: int, kind: str) -> tuple[int, int]:
    """(num_warps, REGS) of a row held in parts of `block` and `row_parts(hidden, block)` columns:
    WIDE_PARTS[kind] where a thread of `warps` would hold more than WIDE_PARTS_ELEMENTS of its
    columns and the smaller part still holds one code run (8 elements) a thread of those warps,
    else (`warps`, 0)."""
    wide_warps, regs = WIDE_PARTS.get(kind, (warps, 0))
    if hidden <= WIDE_PARTS_ELEMENTS * 32 * warps or row_parts(hidden, block) < 8 * 32 * wide_warps:
        return warps, 0
    return wide_warps, regs


def least_columns(kind: str, group: int) -> int:
    """The narrowest slice or part of a row the quantized kernel takes: whole scale blocks, and at
    least 64 columns (NVFP4's 16-column blocks in groups of 4 scales; and what the tests run:
    narrower ones leave a thread less than one code run)."""
    return max(64, group) if kind == "fp8_per_group" else 64


def check_quant_config(config: tuple, hidden: int, quant) -> tuple[int, int, int, int, int]:
    """`config` of a quantized call as (BLOCK_H, num_warps, rows, SLICE, REGS); a 3-tuple quantizes
    whole rows, a 4-tuple leaves REGS (the registers a thread may use, PTX .maxnreg) 0, the
    compiler's choice. Raises ValueError, naming the fix, for a launch the kernel cannot run."""
    op = "residual_rmsnorm"
    if len(config) not in (3, 4, 5):
        raise ValueError(f"{op}: config must be (BLOCK_H, num_warps, rows[, slice[, regs]]), got {config!r}; omit "
                         "config for the default")
    block, warps, rows = config[:3]
    if not (_power_of_two(block) and _power_of_two(warps) and warps <= 32 and isinstance(rows, int) and rows >= 1):
        raise ValueError(f"{op}: config {config!r} needs BLOCK_H a power of two, num_warps a power of two up to "
                         "32 and rows >= 1; omit config for the default")
    regs = config[4] if len(config) == 5 else 0
    if not (isinstance(regs, int) and (regs == 0 or MIN_REGS <= regs <= MAX_REGS)):
        raise ValueError(f"{op}: regs {regs!r} of config {config!r} must be 0 (the compiler's choice) or from "
                         f"{MIN_REGS} to {MAX_REGS} registers a thread; omit it for the compiler's choice")
    least = least_columns(quant.kind, quant.group)
    if block < hidden:  # a whole row in two parts
        try:
            rest = row_parts(hidden, block)
        except ValueError as exc:
            raise ValueError(f"{op}: config {config!r}: {exc}; omit config for the default") from None
        if len(config) >= 4 and config[3] != block or rest < least:
            raise ValueError(f"{op}: config {config!r} holds rows of {hidden} in parts of {block} and {rest}: they "
                             f"quantize whole rows (no slice) and each must be at least {least} columns for "
                             f"{quant.kind}; omit config for the default")
        return block, warps, rows, block, regs
    block = max(block, block_for(hidden, quant.kind))
    cut = config[3] if len(config) >= 4 else block
    if not (_power_of_two(cut) and least <= cut <= block) or (cut < block and rows != 1):
        raise ValueError(f"{op}: slice {cut} of config {config!r} must be a power of two from {least} "
                         f"({quant.kind}) to BLOCK_H {block}, with rows 1 when it cuts rows; omit it to quantize "
                         "whole rows")
    return block, warps, rows, cut, regs


def _power_of_two(value) -> bool:
    return isinstance(value, int) and value > 0 and value & (value - 1) == 0


def residual_rmsnorm(
    s: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: tuple[int, ...] | None = None,
    quant=None,
):
    """(normed, new_residual) of `s` (M, H); see the module docstring. `out` reuses buffers;
    `config` replaces `launch_config`'s (BLOCK_H, num_warps, rows).

    With `quant` (a `tpfuse.quant.QuantSpec`) the normed rows are quantized in the same pass and
    a `tpfuse.quant.QuantOutput` (out, scale, residual, normed) is returned instead; `config` may
    then add SLICE, the columns one program quantizes, and REGS, the registers a thread may use,
    or give a BLOCK_H below H for rows held in two parts of BLOCK_H and H - BLOCK_H columns
    (`check_quant_config`)."""
    _check(s, residual, weight)
    if quant is not None:
        check_quant("residual_rmsnorm", quant, s.shape[1], device=s.device)
        if config is not None:
            config = check_quant_config(tuple(config), s.shape[1], quant)
    return launch_residual_rmsnorm(s, residual, weight, eps, out=out, config=config, quant=quant)


# Launches per shape, pre-bound (tpfuse.kernels.launcher): (M, H, dtype, residual?, device, config
# [, quantized-output variant]) -> PreboundLaunch. Bounded for memory, not tuned: a process that sees
# every token count up to this many keeps them all; past it the cache starts again (each shape then
# costs one ordinary Triton launch more).
MAX_CACHED_SHAPES = 16384
_LAUNCHES: dict[tuple, PreboundLaunch] = {}


def launch_residual_rmsnorm(s, residual, weight, eps: float, *, out=None, config=None, quant=None):
    """`residual_rmsnorm` for callers that have validated its arguments (as `residual_rmsnorm`
    does: contiguous (M, H) `s` of a supported dtype, H <= MAX_HIDDEN, residual and weight to
    match, `quant` a fitting QuantSpec and `config` then a 5-tuple from `check_quant_config`):
    the outputs, then one launch pre-bound per shape."""
    if quant is not None:
        return _launch_quant(s, residual, weight, eps, quant, config)
    m, h = s.shape
    normed, new_res = out if out is not None else (torch.empty_like(s), torch.empty_like(s))
    if m == 0:
        return normed, new_res
    args = (s, residual if residual is not None else s, weight, normed, new_res, m, h, float(eps))
    key = (m, h, s.dtype, residual is not None, s.get_device(), config)
    launch = _LAUNCHES.get(key)
    if launch is not None:
        launch(*args)
        return normed, new_res
    block, warps, rows = config or launch_config(h, s.element_size(), m)
    meta = dict(BLOCK_H=block, ROWS=rows, HAS_RES=residual is not None, SOFT_BF16=interpreting(), num_warps=warps)
    _remember(key, bind(residual_rmsnorm_kernel, (triton.cdiv(m, rows),), args, meta, launch=True))
    return normed, new_res


def _launch_quant(s, residual, weight, eps, quant, config):

    m, h = s.shape
    key = (m, h, s.dtype, residual is not None, s.get_device(), config, quant.kind, quant.group, quant.layout,
           quant.scale_ub is not None, quant.with_normed)
    launch = _LAUNCHES.get(key)
    buf = QuantBuffers(quant, m, h, s.device, *_hardware(key[4]))
    normed = torch.empty_like(s) if quant.with_normed else None
    new_res = torch.empty_like(s)
    if m == 0:
        return QuantOutput(buf.out, buf.scale, new_res, normed)
    args = (s, residual if residual is not None else s, weight, normed if normed is not None else s, new_res,
            m, h, float(eps), buf.codes, buf.codes.stride(0), buf.scales, *buf.s_strides, buf.param, buf.scale_ub)
    if launch is not None:
        launch(*args)
        return QuantOutput(buf.out, buf.scale, new_res, normed)
    block, warps, rows, cut, regs = config or quant_launch_config(h, s.element_size(), m, quant.kind,
                                                                  group=quant.group)
    grid = m * triton.cdiv(h, cut) if cut < block else triton.cdiv(m, rows)
    grid += pad_programs(m, h) if buf.swizzled else 0
    meta = dict(BLOCK_H=block, ROWS=rows, SLICE=cut, HAS_RES=residual is not None, SOFT_BF16=interpreting(),
                WITH_NORMED=normed is not None, num_warps=warps, P1=row_parts(h, block) if block < h else 0,
                **_quant_constexprs(buf, block))
    if regs:
        meta["maxnreg"] = regs  # a Triton launch option (the interpreter drops it)
    _remember(key, bind(residual_rmsnorm_quant_kernel, (grid,), args, meta, launch=True))
    return QuantOutput(buf.out, buf.scale, new_res, normed)


def _remember(key: tuple, launch: PreboundLaunch) -> None:
    if len(_LAUNCHES) >= MAX_CACHED_SHAPES:
        _LAUNCHES.clear()
    _LAUNCHES[key] = launch


@functools.cache
def _hardware(index: int) -> tuple[bool, bool]:
    """(hardware_fp8, hardware_fp4) of the device with this `Tensor.get_device()` index (-1: CPU)."""
    device = torch.device("cuda", index) if index >= 0 else torch.device("cpu")
    return hardware_fp8(device), hardware_fp4(device)


def _quant_constexprs(buf, block: int) -> dict:
    kw = buf.constexprs(block)
    del kw["BLOCK"]
    return kw


def _check(s: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    op = "residual_rmsnorm"
    if s.dim() != 2 or not s.is_contiguous():
        raise ValueError(f"{op}: s must be a contiguous (tokens, hidden) tensor, got shape {tuple(s.shape)}; "
                         "use s.contiguous().view(-1, hidden)")
    if s.dtype not in SUPPORTED:
        raise TypeError(f"{op}: dtype {s.dtype} is not supported; use bfloat16, float16 or float32")
    if s.shape[1] > MAX_HIDDEN:
        raise ValueError(f"{op}: hidden size {s.shape[1]} exceeds {MAX_HIDDEN}; use the reference strategy")
    if residual is not None and (residual.shape != s.shape or residual.dtype != s.dtype
                                 or not residual.is_contiguous()):
        raise ValueError(f"{op}: residual must be contiguous with the shape and dtype of s {tuple(s.shape)} {s.dtype}")
    if weight.shape != (s.shape[1],) or weight.dtype != s.dtype or not weight.is_contiguous():
        raise ValueError(f"{op}: weight must be contiguous, shape ({s.shape[1]},) and dtype {s.dtype}")
