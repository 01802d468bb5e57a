"""FP8 block-scaling kernel, DeepSeek style (NUMERICS.md §4): E4M3 elements, 128-long blocks.

Layouts follow numerics/block_fp8.py exactly (compact scale grids, partial edge blocks scaled by
the amax of the elements that exist):
- 1D rowwise: data [M, K], scale_inv [M, ceil(K/128)] (1x128 runs along K);
- 1D columnwise: data [K, M], scale_inv [K, ceil(M/128)] (x^T in 1x128 runs along M);
  both 1D grids are written column-major (stride 1 along the rows), the layout blockwise
  scaled_mm reads its 1x128 scales in: the GEMM then takes them as they are, where a row-major
  grid cost a transposing copy per operand (gemm_paths.blockwise_scaled_mm_gemm). The values are
  the reference's; only the strides differ.
- 2D: data [M, K], scale_inv [ceil(M/128), ceil(K/128)]; its columnwise copy is the exact
  transpose of both (data [K, M], scale_inv [ceil(K/128), ceil(M/128)]).

One kernel serves every input: `block_tile` quantizes one aligned 128x128 tile of the [M, K]
view, which holds whole blocks of both directions, so one program writes both copies and the
input crosses HBM once. The single-tensor launch (`_block_kernel`) and the multi-tensor launch
(multi_tensor._multi_block_1d_kernel) both call it. Why it is built around words of four
elements (benchmarks/KERNEL_NOTES.md, "block FP8 words"; the byte-per-register kernels it
replaced ran at 0.64-0.67 of copy on an H200, issue-bound):
- the tile is held as four row slices (slice j holds rows 4i + j of quad i), so a thread owns
  4x4 blocks of elements: rows 4i..4i+3, columns 4w..4w+3 for each (i, w) it holds;
- rowwise codes leave as int32 words of four columns, transposed codes as int32 words of four
  rows: each word is assembled in registers by one conversion, only whole words cross shared
  memory (Triton's layout conversion for the coalesced transposed store);
- one fp32 product per element and direction (x * scale, exactly the reference's product; 2D
  shares one product between both directions) and cvt.rn.satfinite.e4m3x2 into the word. No NaN
  fix-up: a block holding a NaN has scale 1, its NaN product converts to a NaN code (low bits
  0x7F), and the NaN sign is not part of the contract.

What the input and shape decide (constexprs, chosen by the host):
- HALVES (bf16, K % 4 == 0, 8-byte aligned): the input is read as int64 words of four bf16 and
  the maxima are taken halfwise on int32 pairs of magnitudes (max.u16x2 on sm_90), two elements
  per max; otherwise each of a word's four columns is loaded as its own element tensor (any
  float dtype, any K) and the maxima are fp32 bit-pattern maxima;
- ROW_WORDS (K % 4 == 0) / COL_WORDS (M % 4 == 0): whole int32 words can be stored into that
  copy; otherwise its words are stored byte by byte (odd shapes, decode-sized inputs);
- MASK_M / MASK_K: the tensor has partial tiles along M / K (masks compiled in only then).

Under the interpreter the same algorithm runs with sat_rne_fp8 standing in for the cvt and plain
integer maxima for max.u16x2 (both bit-exact), so the interpreter tests check the algorithm.
Scales follow numerics.scale_from_amax with the input dtype's max as the overflow value
(power-of-2 scales by default, computed from exponent bits without a division; see pow2_scale).
"""

from __future__ import annotations

import torch

from .fp8_common import (
    cdiv,
    column_offsets,
    dtype_max_bits,
    float32_value,
    hw_cast,
    jit,
    kernel_input,
    max_u16x2,
    needs_wide_offsets,
    reads_halves,
    reciprocal_rn,
    sat_rne_fp8,
    scale_from_amax,
    tile_offsets,
    tl,
)
from .halfwise import halves_amax, max16, reduce16, reduce16_pairs
from .launch import launch

BLOCK = 128  # the block length: one tile holds whole blocks of both directions
TILE = BLOCK if tl is None else tl.constexpr(BLOCK)  # BLOCK inside kernels
QUADS = BLOCK // 4  # words of four along either side of the tile
QUADS = QUADS if tl is None else tl.constexpr(QUADS)
# Warps per program, swept on an H200 (KERNEL_NOTES.md, "block FP8 words").
NUM_WARPS_1D, NUM_WARPS_2D = 4, 4

# Four fp32 ($1..$4) to the E4M3 codes of one int32 word ($1's code in the low byte).
_CVT_ASM = ("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }")
_CVT_ASM = _CVT_ASM if tl is None else tl.constexpr(_CVT_ASM)
ScaledCopies = tuple[
    torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None
]


# ---------------------------------------------------------------------------------------------
# scales
# ---------------------------------------------------------------------------------------------


@jit
def pow2_scale(amax, eps, OVERFLOW_BITS: tl.constexpr):
    """scale_from_amax(amax, eps, E4M3, POW2=True) without the division: the bytes are the same.

    For a normal amax = (1 + m / 2^23) * 2^(E - 127), 448 / amax = q * 2^(135 - E) with
    q = 1.75 / (1 + m / 2^23) in (0.875, 1.75]. q >= 1 exactly when m <= 0x600000, and below
    that the correctly rounded q stays below 1 (the largest, at m = 0x600001, is 1 - 1.14 * 2^-24,
    nearer 1 - 2^-24 than 1), so the power of two under the rounded quotient has biased exponent
    262 - E - (m > 0x600000). It is never subnormal (E <= 254); a biased exponent past 254 is
    the infinite quotient, as it is for every subnormal amax (E = 0): the overflow value.
    Zero, infinite and NaN amax give scale 1. The per-block division and the exact reciprocal
    were most of the 1D kernel's arithmetic: every thread computes the scales of the blocks it
    holds a slice of, many times over."""
    amax = tl.where(amax < eps, eps, amax)  # NaN compares false and stays NaN
    bits = amax.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    degenerate = (magnitude == 0) | (magnitude >= 0x7F800000)
    exponent = 262 - (magnitude >> 23) - ((magnitude & 0x7FFFFF) > 0x600000).to(tl.int32)
    scale_bits = tl.where(exponent >= 255, OVERFLOW_BITS & -8388608,
                          (exponent << 23) | (bits & -2147483648))
    scale_bits = tl.where(degenerate, 0x3F800000, scale_bits)
    return scale_bits.to(tl.float32, bitcast=True)


@jit
def pow2_reciprocal(scale):
    """reciprocal_rn of a power-of-two scale from pow2_scale (biased exponent 1..254), by
    exponent arithmetic: 2^-(E - 127) has biased exponent 254 - E; E = 254 gives the subnormal
    2^-127 (bits 0x400000). Exact, like the reference's reciprocal."""
    bits = scale.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    inverse = tl.where(exponent == 254, 0x400000, (254 - exponent) << 23)
    return (inverse | (bits & -2147483648)).to(tl.float32, bitcast=True)


@jit
def _scale(amax_bits, eps, POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr):
    """Block scales from int32 amax bits (numerics.scale_from_amax, E4M3)."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    if POW2:
        scale = pow2_scale(amax, eps, OVERFLOW_BITS)
    else:
        scale = scale_from_amax(amax, eps, False, POW2, OVERFLOW_BITS)
    return scale


@jit
def _scale_inv(scale, POW2: tl.constexpr):
    """scale_inv = 1 / scale as the reference rounds it (exponent arithmetic for powers of 2)."""
    return pow2_reciprocal(scale) if POW2 else reciprocal_rn(scale)


# ---------------------------------------------------------------------------------------------
# words: conversion, halfwise maxima, loads and stores
# ---------------------------------------------------------------------------------------------


@jit
def _e4m3_word(y0, y1, y2, y3, HW_CAST: tl.constexpr):
    """int32 word of the E4M3 codes of four fp32 values (y0 in the low byte), the sat_rne_fp8
    contract up to the NaN sign: two cvt.rn.satfinite in one asm block on CUDA, sat_rne_fp8 per
    element under the interpreter."""
    if HW_CAST:
        word = tl.inline_asm_elementwise(_CVT_ASM, "=r,r,r,r,r", [y0, y1, y2, y3],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        word = (sat_rne_fp8(y0, False).to(tl.int32)
                | (sat_rne_fp8(y1, False).to(tl.int32) << 8)
                | (sat_rne_fp8(y2, False).to(tl.int32) << 16)
                | (sat_rne_fp8(y3, False).to(tl.int32) << 24))
    return word


@jit
def _max4(a, b, c, d):
    return tl.maximum(tl.maximum(a, b), tl.maximum(c, d))


@jit
def _mask(row_ok, col_ok, MASKED: tl.constexpr):
    """The [quad, word] mask of one slice and column (None when the tile is whole)."""
    mask = None
    if MASKED:
        mask = row_ok[:, None] & col_ok[None, :]
    return mask


@jit
def _when(mask, ON: tl.constexpr):
    """`mask` where ON (the tile may be partial along its axis), else None: an unmasked access
    keeps its vector width."""
    kept = None
    if ON:
        kept = mask
    return kept


@jit
def _load(pointers, mask, MASKED: tl.constexpr):
    """Values at `pointers`, zeros where masked: a zero cannot raise an amax."""
    return tl.load(pointers, mask=mask, other=0) if MASKED else tl.load(pointers)


@jit
def _slice(x_tile, row, i, w, K, K_WORDS, cols_left, words_left, row_ok, MASKED: tl.constexpr,
           HALVES: tl.constexpr, WIDE: tl.constexpr):
    """Row slice `row` of the tile (rows 4i + row): its four columns 4w + c as fp32, and their
    magnitudes: HALVES, two int32 words of two bf16 magnitudes (columns 0, 1 and 2, 3); else
    four int32 fp32 bit patterns (the second pair repeats the first two, unused). Masks along
    the word axis compare word indices (w < words_left), which Triton can prove constant over a
    vector; 4 * w < cols_left would cost the 16-byte accesses."""
    rows = 4 * i + row
    if HALVES:
        words = _load(x_tile + tile_offsets(rows, w, K_WORDS, WIDE),
                      _mask(row_ok, w < words_left, MASKED), MASKED)
        low = words.to(tl.int32)
        high = (words >> 32).to(tl.int32)
        f0 = (low << 16).to(tl.float32, bitcast=True)
        f1 = (low & -65536).to(tl.float32, bitcast=True)
        f2 = (high << 16).to(tl.float32, bitcast=True)
        f3 = (high & -65536).to(tl.float32, bitcast=True)
        m0 = low & 0x7FFF7FFF
        m1 = high & 0x7FFF7FFF
        m2 = m0
        m3 = m1
    else:
        base = x_tile + tile_offsets(rows, 4 * w, K, WIDE)
        f0 = _load(base, _mask(row_ok, 4 * w < cols_left, MASKED), MASKED).to(tl.float32)
        f1 = _load(base + 1, _mask(row_ok, 4 * w + 1 < cols_left, MASKED), MASKED).to(tl.float32)
        f2 = _load(base + 2, _mask(row_ok, 4 * w + 2 < cols_left, MASKED), MASKED).to(tl.float32)
        f3 = _load(base + 3, _mask(row_ok, 4 * w + 3 < cols_left, MASKED), MASKED).to(tl.float32)
        m0 = f0.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        m1 = f1.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        m2 = f2.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        m3 = f3.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return f0, f1, f2, f3, m0, m1, m2, m3


@jit
def _row_amax(m0, m1, m2, m3, HALVES: tl.constexpr, MAX_U16X2: tl.constexpr):
    """fp32 bits of each row's amax in one slice ([QUADS]: along the tile's 128 columns)."""
    if HALVES:
        amax = halves_amax(reduce16(max16(m0, m1, MAX_U16X2), 1, MAX_U16X2))
    else:
        amax = tl.max(_max4(m0, m1, m2, m3), axis=1)
    return amax


@jit
def _store_rows(row_words, row_bytes, row, i, w, K, K_WORDS, cols_left, words_left, row_ok,
                x0, x1, x2, x3, scale, MASKED: tl.constexpr, ROW_WORDS: tl.constexpr,
                WIDE: tl.constexpr, HW_CAST: tl.constexpr):
    """Rowwise codes of slice `row` (rows 4i + row; x0..x3 its columns 4w..4w+3, one int32 word
    of codes each, scaled by `scale`): whole words (ROW_WORDS, K % 4 == 0), or byte by byte."""
    word = _e4m3_word(x0 * scale, x1 * scale, x2 * scale, x3 * scale, HW_CAST)
    rows = 4 * i + row
    if ROW_WORDS:
        tl.store(row_words + tile_offsets(rows, w, K_WORDS, WIDE), word,
                 mask=_mask(row_ok, w < words_left, MASKED))
    else:
        base = row_bytes + tile_offsets(rows, 4 * w, K, WIDE)
        for b in tl.static_range(4):
            tl.store(base + b, ((word >> (8 * b)) & 0xFF).to(tl.uint8),
                     mask=_mask(row_ok, 4 * w + b < cols_left, MASKED))


@jit
def _store_columns(col_words, col_bytes, column, i, w, M, M_WORDS, rows_left, quads_left,
                   cols_left, x0, x1, x2, x3, scale, MASKED: tl.constexpr,
                   COL_WORDS: tl.constexpr, WIDE: tl.constexpr, HW_CAST: tl.constexpr):
    """Columnwise codes of columns 4w + column (x0..x3: rows 4i..4i+3 of it, one int32 word of
    codes each, scaled by `scale`): whole words (COL_WORDS, M % 4 == 0), or byte by byte."""
    word = _e4m3_word(x0 * scale, x1 * scale, x2 * scale, x3 * scale, HW_CAST)
    cols = 4 * w + column
    col_ok = cols < cols_left
    if COL_WORDS:
        tl.store(col_words + column_offsets(i, cols, M_WORDS, WIDE), word,
                 mask=_mask(i < quads_left, col_ok, MASKED))
    else:
        for b in tl.static_range(4):
            tl.store(col_bytes + column_offsets(4 * i + b, cols, M, WIDE),
                     ((word >> (8 * b)) & 0xFF).to(tl.uint8),
                     mask=_mask(4 * i + b < rows_left, col_ok, MASKED))


@jit
def block_tile(x_ptr, row_data_ptr, row_si_ptr, col_data_ptr, col_si_ptr, eps, M, K, M_WORDS,
               K_WORDS, pid_m, pid_k, POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr,
               ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, TILE_2D: tl.constexpr,
               HALVES: tl.constexpr, ROW_WORDS: tl.constexpr, COL_WORDS: tl.constexpr,
               MASK_M: tl.constexpr, MASK_K: tl.constexpr, WIDE: tl.constexpr,
               HW_CAST: tl.constexpr, MAX_U16X2: tl.constexpr):
    """Quantize tile (pid_m, pid_k) of a row-major [M, K] tensor.

    x_ptr: int64 words [M, K/4] (HALVES) or the elements [M, K]; row_data_ptr: int32 words
    [M, K/4] (ROW_WORDS) or bytes [M, K]; col_data_ptr: int32 words [K, M/4] (COL_WORDS) or
    bytes [K, M]. M_WORDS = M // 4 and K_WORDS = K // 4 (passed apart so Triton sees their
    divisibility). TILE_2D: one scale per tile (quantize_block_2d, the columnwise copy being its
    exact transpose), else 1x128 blocks along K (rowwise) and along M (columnwise).
    """
    MASKED: tl.constexpr = MASK_M or MASK_K
    tiles_k = tl.cdiv(K, TILE)
    tiles_m = tl.cdiv(M, TILE)
    row0 = pid_m.to(tl.int64) * TILE
    col0 = pid_k.to(tl.int64) * TILE
    # clamped to the tile and narrowed: the masks compare in-tile indices in 32 bits
    rows_left = tl.minimum(M - row0, TILE).to(tl.int32)
    cols_left = tl.minimum(K - col0, TILE).to(tl.int32)
    # the same in words (meaningful where K resp. M is a multiple of 4)
    words_left = tl.minimum(K_WORDS - pid_k * QUADS, QUADS).to(tl.int32)
    quads_left = tl.minimum(M_WORDS - pid_m * QUADS, QUADS).to(tl.int32)
    i = tl.arange(0, QUADS)  # row quad: rows 4i..4i+3 of the tile
    w = tl.arange(0, QUADS)  # word column: columns 4w..4w+3 of the tile
    x_tile = x_ptr + row0 * K_WORDS + pid_k * QUADS if HALVES else x_ptr + row0 * K + col0
    if COL_WORDS:  # M % 4 == 0: a row quad is whole or absent, one mask for its four rows
        ok0 = i < quads_left
        ok1 = ok0
        ok2 = ok0
        ok3 = ok0
    else:
        ok0 = 4 * i < rows_left
        ok1 = 4 * i + 1 < rows_left
        ok2 = 4 * i + 2 < rows_left
        ok3 = 4 * i + 3 < rows_left
    f00, f01, f02, f03, m00, m01, m02, m03 = _slice(
        x_tile, 0, i, w, K, K_WORDS, cols_left, words_left, ok0, MASKED, HALVES, WIDE)
    f10, f11, f12, f13, m10, m11, m12, m13 = _slice(
        x_tile, 1, i, w, K, K_WORDS, cols_left, words_left, ok1, MASKED, HALVES, WIDE)
    f20, f21, f22, f23, m20, m21, m22, m23 = _slice(
        x_tile, 2, i, w, K, K_WORDS, cols_left, words_left, ok2, MASKED, HALVES, WIDE)
    f30, f31, f32, f33, m30, m31, m32, m33 = _slice(
        x_tile, 3, i, w, K, K_WORDS, cols_left, words_left, ok3, MASKED, HALVES, WIDE)

    # scales: the tile's (2D); per row of each slice ([QUADS] each) and per column 4w + c
    if TILE_2D:
        if HALVES:
            pairs = max16(max16(max16(m00, m01, MAX_U16X2), max16(m10, m11, MAX_U16X2),
                                  MAX_U16X2),
                           max16(max16(m20, m21, MAX_U16X2), max16(m30, m31, MAX_U16X2),
                                  MAX_U16X2), MAX_U16X2)
            amax = halves_amax(reduce16(reduce16(pairs, 1, MAX_U16X2), 0, MAX_U16X2))
        else:
            every = _max4(_max4(m00, m01, m02, m03), _max4(m10, m11, m12, m13),
                          _max4(m20, m21, m22, m23), _max4(m30, m31, m32, m33))
            amax = tl.max(tl.max(every, axis=1), axis=0)
        scale = _scale(amax, eps, POW2, OVERFLOW_BITS)
        r0 = scale
        r1 = scale
        r2 = scale
        r3 = scale
        c0 = scale
        c1 = scale
        c2 = scale
        c3 = scale
    else:
        if ROWWISE:
            row_scale0 = _scale(_row_amax(m00, m01, m02, m03, HALVES, MAX_U16X2), eps, POW2,
                                OVERFLOW_BITS)
            row_scale1 = _scale(_row_amax(m10, m11, m12, m13, HALVES, MAX_U16X2), eps, POW2,
                                OVERFLOW_BITS)
            row_scale2 = _scale(_row_amax(m20, m21, m22, m23, HALVES, MAX_U16X2), eps, POW2,
                                OVERFLOW_BITS)
            row_scale3 = _scale(_row_amax(m30, m31, m32, m33, HALVES, MAX_U16X2), eps, POW2,
                                OVERFLOW_BITS)
            r0 = row_scale0[:, None]
            r1 = row_scale1[:, None]
            r2 = row_scale2[:, None]
            r3 = row_scale3[:, None]
        if COLUMNWISE:
            if HALVES:
                # column 4w + c: the four slices elementwise, then down the tile (both words of
                # a pair in one reduction)
                low = max16(max16(m00, m10, MAX_U16X2), max16(m20, m30, MAX_U16X2),
                             MAX_U16X2)
                high = max16(max16(m01, m11, MAX_U16X2), max16(m21, m31, MAX_U16X2),
                              MAX_U16X2)
                low, high = reduce16_pairs(low, high, 0, MAX_U16X2)
                a0 = low << 16
                a1 = low & -65536
                a2 = high << 16
                a3 = high & -65536
            else:
                a0 = tl.max(_max4(m00, m10, m20, m30), axis=0)
                a1 = tl.max(_max4(m01, m11, m21, m31), axis=0)
                a2 = tl.max(_max4(m02, m12, m22, m32), axis=0)
                a3 = tl.max(_max4(m03, m13, m23, m33), axis=0)
            col_scale0 = _scale(a0, eps, POW2, OVERFLOW_BITS)
            col_scale1 = _scale(a1, eps, POW2, OVERFLOW_BITS)
            col_scale2 = _scale(a2, eps, POW2, OVERFLOW_BITS)
            col_scale3 = _scale(a3, eps, POW2, OVERFLOW_BITS)
            c0 = col_scale0[None, :]
            c1 = col_scale1[None, :]
            c2 = col_scale2[None, :]
            c3 = col_scale3[None, :]

    if ROWWISE:
        row_words = row_data_ptr + row0 * K_WORDS + pid_k * QUADS
        row_bytes = row_data_ptr + row0 * K + col0
        _store_rows(row_words, row_bytes, 0, i, w, K, K_WORDS, cols_left, words_left, ok0,
                    f00, f01, f02, f03, r0, MASKED, ROW_WORDS, WIDE, HW_CAST)
        _store_rows(row_words, row_bytes, 1, i, w, K, K_WORDS, cols_left, words_left, ok1,
                    f10, f11, f12, f13, r1, MASKED, ROW_WORDS, WIDE, HW_CAST)
        _store_rows(row_words, row_bytes, 2, i, w, K, K_WORDS, cols_left, words_left, ok2,
                    f20, f21, f22, f23, r2, MASKED, ROW_WORDS, WIDE, HW_CAST)
        _store_rows(row_words, row_bytes, 3, i, w, K, K_WORDS, cols_left, words_left, ok3,
                    f30, f31, f32, f33, r3, MASKED, ROW_WORDS, WIDE, HW_CAST)
        if TILE_2D:
            tl.store(row_si_ptr + pid_m * tiles_k + pid_k, _scale_inv(scale, POW2))
        else:
            # column-major [M, tiles_k] (stride 1 along M): rows 4i..4i+3 are adjacent
            si_rows = pid_k.to(tl.int64) * M + row0 + 4 * i
            tl.store(row_si_ptr + si_rows, _scale_inv(row_scale0, POW2),
                     mask=_when(ok0, MASK_M))
            tl.store(row_si_ptr + si_rows + 1, _scale_inv(row_scale1, POW2),
                     mask=_when(ok1, MASK_M))
            tl.store(row_si_ptr + si_rows + 2, _scale_inv(row_scale2, POW2),
                     mask=_when(ok2, MASK_M))
            tl.store(row_si_ptr + si_rows + 3, _scale_inv(row_scale3, POW2),
                     mask=_when(ok3, MASK_M))
    if COLUMNWISE:
        col_words = col_data_ptr + col0 * M_WORDS + pid_m * QUADS
        col_bytes = col_data_ptr + col0 * M + row0
        _store_columns(col_words, col_bytes, 0, i, w, M, M_WORDS, rows_left, quads_left,
                       cols_left, f00, f10, f20, f30, c0, MASKED, COL_WORDS, WIDE, HW_CAST)
        _store_columns(col_words, col_bytes, 1, i, w, M, M_WORDS, rows_left, quads_left,
                       cols_left, f01, f11, f21, f31, c1, MASKED, COL_WORDS, WIDE, HW_CAST)
        _store_columns(col_words, col_bytes, 2, i, w, M, M_WORDS, rows_left, quads_left,
                       cols_left, f02, f12, f22, f32, c2, MASKED, COL_WORDS, WIDE, HW_CAST)
        _store_columns(col_words, col_bytes, 3, i, w, M, M_WORDS, rows_left, quads_left,
                       cols_left, f03, f13, f23, f33, c3, MASKED, COL_WORDS, WIDE, HW_CAST)
        if TILE_2D:
            tl.store(col_si_ptr + pid_k * tiles_m + pid_m, _scale_inv(scale, POW2))
        else:
            # column-major [K, tiles_m] (stride 1 along K): columns 4w..4w+3 are adjacent
            si_cols = pid_m.to(tl.int64) * K + col0 + 4 * w
            tl.store(col_si_ptr + si_cols, _scale_inv(col_scale0, POW2),
                     mask=_when(4 * w < cols_left, MASK_K))
            tl.store(col_si_ptr + si_cols + 1, _scale_inv(col_scale1, POW2),
                     mask=_when(4 * w + 1 < cols_left, MASK_K))
            tl.store(col_si_ptr + si_cols + 2, _scale_inv(col_scale2, POW2),
                     mask=_when(4 * w + 2 < cols_left, MASK_K))
            tl.store(col_si_ptr + si_cols + 3, _scale_inv(col_scale3, POW2),
                     mask=_when(4 * w + 3 < cols_left, MASK_K))


@jit
def _block_kernel(x_ptr, row_data_ptr, row_si_ptr, col_data_ptr, col_si_ptr, eps, M, K,
                  M_WORDS, K_WORDS, POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr,
                  ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, TILE_2D: tl.constexpr,
                  HALVES: tl.constexpr, ROW_WORDS: tl.constexpr, COL_WORDS: tl.constexpr,
                  MASK_M: tl.constexpr, MASK_K: tl.constexpr, WIDE: tl.constexpr,
                  HW_CAST: tl.constexpr, MAX_U16X2: tl.constexpr):
    """One 128x128 tile per program (grid: tiles, K fastest); see block_tile."""
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, TILE)
    block_tile(x_ptr, row_data_ptr, row_si_ptr, col_data_ptr, col_si_ptr, eps, M, K, M_WORDS,
               K_WORDS, pid // tiles_k, pid % tiles_k, POW2, OVERFLOW_BITS, ROWWISE,
               COLUMNWISE, TILE_2D, HALVES, ROW_WORDS, COL_WORDS, MASK_M, MASK_K, WIDE,
               HW_CAST, MAX_U16X2)


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------


def word_view(buffer: torch.Tensor | None, words: bool, stand_in: torch.Tensor) -> torch.Tensor:
    """A uint8 [rows, cols] output buffer as int32 words [rows, cols / 4] where `words`; a copy
    not asked for passes `stand_in` (any buffer: the kernel never touches it)."""
    if buffer is None:
        return stand_in
    return buffer.view(torch.int32) if words else buffer


def column_major_view(flat: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """The [rows, blocks] grid stored column-major in `flat` (rows * blocks elements). One
    block per row is the same order either way; it gets the row-major strides (1, 1), since
    torch rejects a dtype view of strides (1, rows) there although it calls them contiguous."""
    if blocks == 1:
        return flat.view(rows, 1)
    return flat.view(blocks, rows).t()


def column_major_grid(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """An fp32 [rows, blocks] scale grid stored column-major (the 1D kernels' layout)."""
    rows, blocks = shape
    flat = torch.empty(rows * blocks, dtype=torch.float32, device=device)
    return column_major_view(flat, rows, blocks)


def _check(x: torch.Tensor, rowwise: bool, columnwise: bool) -> tuple[int, int]:
    if not kernel_input(x):
        raise ValueError(
            "FP8 block kernels need a non-empty contiguous float32/bfloat16/float16 tensor; got "
            f"dtype {x.dtype}, shape {tuple(x.shape)}, contiguous={x.is_contiguous()}"
        )
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-dim tensor: give it at least one dimension")
    if not (rowwise or columnwise):
        raise ValueError("FP8 block kernel: ask for the rowwise or the columnwise copy")
    k = x.shape[-1]
    return x.numel() // k, k


def _launch(x: torch.Tensor, row_grid: tuple[int, int], col_grid: tuple[int, int], *,
            tile_2d: bool, rowwise: bool, columnwise: bool, power_2_scale: bool,
            amax_epsilon: float, num_warps: int) -> ScaledCopies:
    m, k = _check(x, rowwise, columnwise)
    device = x.device

    def buffers(wanted: bool, data_shape: tuple[int, int], grid_shape: tuple[int, int]):
        if not wanted:
            return None, None
        data = torch.empty(data_shape, dtype=torch.uint8, device=device)
        if tile_2d:
            return data, torch.empty(grid_shape, dtype=torch.float32, device=device)
        return data, column_major_grid(grid_shape, device)

    row_data, row_si = buffers(rowwise, (m, k), row_grid)
    col_data, col_si = buffers(columnwise, (k, m), col_grid)
    present = next(t for t in (row_data, col_data) if t is not None)
    present_si = row_si if row_si is not None else col_si
    x2d = x.view(m, k)
    halves = reads_halves(x2d, k)
    row_words, col_words = k % 4 == 0, m % 4 == 0
    hw = hw_cast(x)
    launch(
        _block_kernel, (cdiv(m, BLOCK) * cdiv(k, BLOCK),),
        x2d.view(torch.int64) if halves else x2d,
        word_view(row_data, row_words, present),
        row_si if row_si is not None else present_si,
        word_view(col_data, col_words, present),
        col_si if col_si is not None else present_si,
        float32_value(amax_epsilon), m, k, m // 4, k // 4,
        POW2=power_2_scale, OVERFLOW_BITS=dtype_max_bits(x.dtype), ROWWISE=rowwise,
        COLUMNWISE=columnwise, TILE_2D=tile_2d, HALVES=halves, ROW_WORDS=row_words,
        COL_WORDS=col_words, MASK_M=m % BLOCK != 0, MASK_K=k % BLOCK != 0,
        WIDE=needs_wide_offsets(m, k, BLOCK), HW_CAST=hw, MAX_U16X2=max_u16x2(x),
        num_warps=num_warps,
    )
    e4m3 = torch.float8_e4m3fn
    return (None if row_data is None else row_data.view(e4m3), row_si,
            None if col_data is None else col_data.view(e4m3), col_si)


def quantize_block_1d(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
) -> ScaledCopies:
    """1x128 block FP8 of the [M, K] view of `x`, both directions from one read of the input.

    Returns (rowwise data [M, K], rowwise scale_inv [M, ceil(K/128)], columnwise data [K, M],
    columnwise scale_inv [K, ceil(M/128)]), None for a copy not asked for; bytes equal
    numerics.quantize_block_1d and numerics.quantize_block_1d_columnwise. The scale grids are
    column-major views (module docstring).
    """
    m, k = _check(x, rowwise, columnwise)
    return _launch(x, (m, cdiv(k, BLOCK)), (k, cdiv(m, BLOCK)), tile_2d=False,
                   rowwise=rowwise, columnwise=columnwise, power_2_scale=power_2_scale,
                   amax_epsilon=amax_epsilon, num_warps=NUM_WARPS_1D)


def quantize_block_2d(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
) -> ScaledCopies:
    """128x128 tile FP8 of the [M, K] view of `x`, with the exact transpose as columnwise copy.

    Returns (data [M, K], scale_inv [ceil(M/128), ceil(K/128)], data_t [K, M],
    scale_inv_t [ceil(K/128), ceil(M/128)]), None for a copy not asked for; bytes equal
    numerics.quantize_block_2d and numerics.transpose_block_2d of it.
    """
    m, k = _check(x, rowwise, columnwise)
    tiles_m, tiles_k = cdiv(m, BLOCK), cdiv(k, BLOCK)
    return _launch(x, (tiles_m, tiles_k), (tiles_k, tiles_m), tile_2d=True, rowwise=rowwise,
                   columnwise=columnwise, power_2_scale=power_2_scale,
                   amax_epsilon=amax_epsilon, num_warps=NUM_WARPS_2D)
