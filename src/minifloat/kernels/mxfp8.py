"""MXFP8 quantization in Triton (NUMERICS.md §5), bit-exact against numerics.mxfp8.

One pass over the input: each program loads a BLOCK_M x BLOCK_K tile once and writes whichever
copies are asked for. Both copies keep the [M, K] layout of the input (no transpose):
- rowwise: 1x32 blocks along K -> data [M, K], E8M0 scales [M, K/32]
- columnwise: 32x1 blocks along M -> data [M, K], E8M0 scales [M/32, K]
Scales are compact (no padding), as numerics stores them. Elements are rounded with the integer
casts of element_cast (Triton's float8 conversions do not match the contract everywhere) under
the interpreter, and with cvt.rn.satfinite on CUDA.

One kernel: `mxfp8_tile` quantizes a 32 x BLOCK_K tile, writing four codes per int32 word end
to end (v3: ~14 SASS instructions an element where the byte-per-register kernel it replaced
took ~35). The single-tensor launch (_mxfp8_kernel) and the multi-tensor one
(kernels.mxfp8_multi) both call it. bf16 inputs at 8-byte aligned addresses (the training case)
are read as int64 words of four elements with halfwise maxima (HALVES); other dtypes and
unaligned views load each word's four columns as element tensors and take fp32 bit-pattern
maxima. M and K are multiples of 32, so every copy is stored as whole words.

Imported lazily by the MXFP8 quantizer once `minifloat.kernels.available(x)` holds.
"""

import struct

import torch
import triton
import triton.language as tl

from ..numerics.blocks import as_2d, require_divisible
from ..numerics.formats import fp8_format
from ..numerics.mxfp8 import BLOCK
from .element_cast import (
    E4M3_CONSTANTS,
    E5M2_CONSTANTS,
    FP8_NAN_CODE,
    FP32_INF_BITS,
    expand_blocks,
    magnitude_bits,
    round_to_code,
    sign_bit,
    split_magnitude,
)
from .fp8_common import _capability, hw_cast, sat_rne_fp8
from .launch import launch

# Tile width and warps (its tile is one 32-row block high). Swept on an H200 (tune_kernels.py
# --only mx, copy 4168 GB/s): 32x256 w4 0.153 ms (0.853 of copy), 32x256 w2 0.154, 32x128 w2
# 0.162, 32x128 w4 0.162, 32x64 w2 0.181; the byte-per-register kernel of before 0.235
# (benchmarks/KERNEL_NOTES.md, "MXFP8 v3").
BLOCK_K = 256
NUM_WARPS = 4
# Tests only: run the words kernel's hardware algorithm (fp32 products, per-block NaN words) in
# the interpreter, with the integer sat_rne_fp8 standing in for the cvt and max.u16x2.
EMULATE_PRODUCTS = False

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
E8M0_NAN = tl.constexpr(0xFF)
E8M0_BIAS = tl.constexpr(127)


def _reciprocal_bits(element_max: float) -> int:
    """Bits of fp32(1/element_max) (nearest), the constant the E8M0 rule multiplies by."""
    return struct.unpack("<i", struct.pack("<f", 1.0 / element_max))[0]


@triton.jit
def _fp8_codes(
    x,
    scale_exponent,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    MAX_CODE: tl.constexpr,
):
    """FP8 bytes of x * 2^-(e - 127) for fp32 elements x and their block's E8M0 exponent e
    broadcast to them. The power of two only shifts the exponent (exact, like numerics'
    exp2_exact product), except that an infinity stays infinite and saturates.
    e = 255 (a NaN in the block) gives the NaN byte 0x7F for every element of the block: the
    reference multiplies by a positive NaN scale, which yields a positive NaN (on CPU the scale's
    NaN wins the product, on CUDA NaN results are canonical) whatever the element."""
    magnitude = magnitude_bits(x)
    mantissa, exponent = split_magnitude(magnitude)
    code = round_to_code(
        mantissa, exponent + E8M0_BIAS - scale_exponent, MANTISSA_BITS, MIN_EXPONENT, MAX_CODE
    )
    code = tl.where(magnitude == FP32_INF_BITS, MAX_CODE, code) | (sign_bit(x) << 7)
    return tl.where(scale_exponent == E8M0_NAN, FP8_NAN_CODE, code).to(tl.uint8)


@triton.jit
def _hw_factors(scale_exponent):
    """Per-block fp32 factors (f, h) with x * f * h = x * 2^(127 - e) for the hardware path:
    f = 2^(127 - e) is an fp32 normal for e <= 253; e = 254 (an infinite block amax) takes
    f = 2^-126 and h = 1/2; e = 255 (a NaN in the block) takes f = NaN, so every product is the
    GPU's canonical (positive) NaN and encodes as 0x7F, as the reference does."""
    f = (tl.maximum(254 - scale_exponent, 1) << 23).to(tl.float32, bitcast=True)
    nan = tl.full(f.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    f = tl.where(scale_exponent == E8M0_NAN, nan, f)
    h = tl.where(scale_exponent == 254, 0.5, 1.0)
    return f, h


# ---------------------------------------------------------------------------------------------
# words of four elements (32-row tiles)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _word_floats(words):
    """fp32 bit patterns (int32) of the four bf16 values in int64 words, element 0 in the low
    half of the low half (little-endian memory order); one shift or mask each, exact."""
    low = words.to(tl.int32)
    high = (words >> 32).to(tl.int32)
    return low << 16, low & -65536, high << 16, high & -65536


@triton.jit
def _e8m0(block_amax, RECIPROCAL_BITS: tl.constexpr):
    """element_cast.e8m0_exponent in ~8 instructions instead of ~18 (it runs once per scale
    on every thread that holds the block, 16 times per thread in a 32 x 128 tile):
    e = ceil(log2(v)) + 127 clamped to [0, 254] for v = fp32(amax * R), with e = 0 meaning
    2^-127, NaN -> 255. From the bits b of v (v >= 0): u = (b + 2^23 - 1) >> 23 is the
    exponent field plus one when the mantissa is non-zero (inf -> 255, NaN -> 256);
    min(u, 254) | (u >> 8) clamps inf and the top binade to 254 and sends NaN to 255; v <= 2^-127
    (b <= 0x400000, zero included) gives 0. Equal to the reference rule for every fp32 v
    (checked exhaustively over all 2^31 non-negative patterns)."""
    reciprocal = tl.full(block_amax.shape, RECIPROCAL_BITS, tl.int32).to(tl.float32, bitcast=True)
    bits = (block_amax * reciprocal).to(tl.int32, bitcast=True)
    u = (bits.to(tl.uint32, bitcast=True) + 0x7FFFFF) >> 23
    e = (tl.minimum(u, 254) | (u >> 8)).to(tl.int32)
    return tl.where(bits <= 0x400000, 0, e)


@triton.jit
def _word_factor(scale_exponent):
    """fp32 2^(127 - e), the exact element factor of the reference (numerics exp2_exact): a
    normal for e <= 253 and the subnormal 2^-127 for e = 254 (an infinite block amax). One
    product x * factor is then the reference's own fp32 product: the GPU's mul.f32 (no .ftz)
    keeps subnormal operands and results. e = 255 (NaN blocks) gives 2^-127 too; those blocks
    are overwritten after the cast (_nan_words)."""
    bits = tl.maximum((254 - scale_exponent) << 23, 0x00400000)  # IMAD + VIMNMX
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _cvt_words(y0, y1, y2, y3, E5M2: tl.constexpr, HW_CAST: tl.constexpr):
    """int32 words of the FP8 codes of four scaled fp32 elements (element k in byte k).

    HW_CAST: two cvt.rn.satfinite (two elements each) straight into the word; that is the
    sat_rne_fp8 contract apart from NaN, which callers handle per block (_nan_words). Without
    it (tests under the interpreter, EMULATE_PRODUCTS) sat_rne_fp8 per element stands in for
    the cvt, so the rest of the hardware path runs there too."""
    if HW_CAST:
        if E5M2:
            words = tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; "
                "cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
                "=r,r,r,r,r", [y0, y1, y2, y3], dtype=tl.int32, is_pure=True, pack=1)
        else:
            words = tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
                "=r,r,r,r,r", [y0, y1, y2, y3], dtype=tl.int32, is_pure=True, pack=1)
    else:
        words = (sat_rne_fp8(y0, E5M2).to(tl.int32) | (sat_rne_fp8(y1, E5M2).to(tl.int32) << 8)
                 | (sat_rne_fp8(y2, E5M2).to(tl.int32) << 16)
                 | (sat_rne_fp8(y3, E5M2).to(tl.int32) << 24))
    return words


@triton.jit
def _max_u16x2(a, b):
    """Halfwise unsigned max of int32 words (max.u16x2, sm_90+): two magnitudes at once."""
    return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _max_halves(a, b):
    """_max_u16x2 in plain integer ops (the interpreter's path) for words whose bits 15 and 31
    are clear, as the masked magnitudes are."""
    return tl.maximum(a & 0xFFFF, b & 0xFFFF) | tl.maximum(a & 0x7FFF0000, b & 0x7FFF0000)


@triton.jit
def _max_u16x2_pairs(a0, a1, b0, b1):
    """Combine function of a two-tensor _max_u16x2 reduction."""
    return _max_u16x2(a0, b0), _max_u16x2(a1, b1)


@triton.jit
def _max_halves_pairs(a0, a1, b0, b1):
    """Combine function of a two-tensor _max_halves reduction."""
    return _max_halves(a0, b0), _max_halves(a1, b1)


@triton.jit
def _int_words(b0, b1, b2, b3, e0, e1, e2, e3, MANTISSA_BITS: tl.constexpr,
               MIN_EXPONENT: tl.constexpr, MAX_CODE: tl.constexpr):
    """_cvt_words by the integer rounding (_fp8_codes: NaN blocks included) for elements given
    as fp32 bits and their blocks' E8M0 exponents; the interpreter's path."""
    c0 = _fp8_codes(b0.to(tl.float32, bitcast=True), e0, MANTISSA_BITS, MIN_EXPONENT, MAX_CODE)
    c1 = _fp8_codes(b1.to(tl.float32, bitcast=True), e1, MANTISSA_BITS, MIN_EXPONENT, MAX_CODE)
    c2 = _fp8_codes(b2.to(tl.float32, bitcast=True), e2, MANTISSA_BITS, MIN_EXPONENT, MAX_CODE)
    c3 = _fp8_codes(b3.to(tl.float32, bitcast=True), e3, MANTISSA_BITS, MIN_EXPONENT, MAX_CODE)
    return (c0.to(tl.int32) | (c1.to(tl.int32) << 8) | (c2.to(tl.int32) << 16)
            | (c3.to(tl.int32) << 24))


@triton.jit
def _scaled(bits, factor):
    """fp32 element (given as bits) times its block factor: the reference's product."""
    return bits.to(tl.float32, bitcast=True) * factor


@triton.jit
def _nan_words(words, byte_mask):
    """Bytes under byte_mask (0xFF per byte of a NaN block) set to 0x7F, the reference's code for
    every element of a block whose E8M0 scale is NaN (its product with the NaN scale is a
    positive NaN). One LOP3 per word of four codes; whatever the cvt wrote there is replaced."""
    return (words & ~byte_mask) | (byte_mask & 0x7F7F7F7F)


@triton.jit
def _magnitude_bits(bits):
    """|x| as fp32 bits (sign cleared): ordered like the magnitudes, every NaN above inf."""
    return bits & 0x7FFFFFFF


@triton.jit
def _max4(a, b, c, d):
    return tl.maximum(tl.maximum(a, b), tl.maximum(c, d))


@triton.jit
def mxfp8_tile(
    x_ptr,
    row_data_ptr,
    row_scale_ptr,
    col_data_ptr,
    col_scale_ptr,
    M,
    K,
    pid_m,
    pid_k,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    MAX_CODE: tl.constexpr,
    RECIPROCAL_BITS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    HW_CAST: tl.constexpr,
    PRODUCTS: tl.constexpr,
    MAX_U16X2: tl.constexpr,
    E5M2: tl.constexpr,
    MASK_K: tl.constexpr,
    HALVES: tl.constexpr,
):
    """Tile (pid_m, pid_k), 32 x BLOCK_K, of an [M, K] tensor (M, K multiples of 32): x_ptr is
    the input as int64 words [M, K/4] of four bf16 (HALVES) or its elements [M, K]; both copies
    are written as int32 words of four codes (row_data_ptr, col_data_ptr: int32 views [M, K/4]),
    columnwise scales as int32 words of four (col_scale_ptr: int32 view [M/32, K/4]), rowwise
    scales as bytes [M, K/32].

    Why words: with every code a byte in its own register, unpacked from the cvt's packed
    result and repacked for the store, with a NaN fix-up per element, the kernel took ~35 SASS
    instructions an element against ~14 here (counts in KERNEL_NOTES.md). Element c of a word is
    column 4j + c, so each of the four components is a [32, BLOCK_K / 4] tensor in the layout of
    the words and every step is elementwise across them.

    HW_CAST: cvt by inline PTX (CUDA); PRODUCTS: the fp32-product algorithm that cvt needs
    (also run under the interpreter by tests, with an integer stand-in for the cvt);
    MAX_U16X2: max.u16x2 for the halfwise maxima (HALVES, sm_90+; plain integer ops otherwise).

    Tiles are exactly one columnwise block high, so no row mask; columns are masked only when
    K % BLOCK_K != 0 (MASK_K). Addresses are a 64-bit tile origin plus 32-bit in-tile offsets.
    """
    WORDS_K: tl.constexpr = BLOCK_K // 4
    RUNS: tl.constexpr = BLOCK_K // SCALE_BLOCK  # rowwise blocks per tile row
    RUN_WORDS: tl.constexpr = SCALE_BLOCK // 4
    k_words = K // 4
    rows = tl.arange(0, SCALE_BLOCK)
    cols = tl.arange(0, WORDS_K)
    origin = (pid_m * SCALE_BLOCK).to(tl.int64) * k_words + pid_k * WORDS_K
    offsets = rows[:, None] * k_words + cols[None, :]
    col_ok = None
    mask = None
    if MASK_K:
        col_ok = pid_k * WORDS_K + cols < k_words
        mask = tl.broadcast_to(col_ok[None, :], [SCALE_BLOCK, WORDS_K])
    if HALVES:
        if MASK_K:
            words = tl.load(x_ptr + origin + offsets, mask=mask, other=0)
        else:
            words = tl.load(x_ptr + origin + offsets)
        # |x| of two bf16 per int32 (sign bits cleared): as unsigned 16-bit halves they are
        # ordered like the values with every NaN above inf, so a halfwise max is torch.amax's
        # NaN-propagating absolute max, two elements per instruction (max.u16x2 on CUDA)
        low = words.to(tl.int32) & 0x7FFF7FFF
        high = (words >> 32).to(tl.int32) & 0x7FFF7FFF
    else:
        # the four columns of each word as element tensors (fp32 bits), from 4 * (word offset)
        elements = x_ptr + 4 * origin + 4 * offsets
        if MASK_K:
            b0 = tl.load(elements, mask=mask, other=0).to(tl.float32).to(tl.int32, bitcast=True)
            b1 = tl.load(elements + 1, mask=mask, other=0).to(tl.float32).to(tl.int32,
                                                                             bitcast=True)
            b2 = tl.load(elements + 2, mask=mask, other=0).to(tl.float32).to(tl.int32,
                                                                             bitcast=True)
            b3 = tl.load(elements + 3, mask=mask, other=0).to(tl.float32).to(tl.int32,
                                                                             bitcast=True)
        else:
            b0 = tl.load(elements).to(tl.float32).to(tl.int32, bitcast=True)
            b1 = tl.load(elements + 1).to(tl.float32).to(tl.int32, bitcast=True)
            b2 = tl.load(elements + 2).to(tl.float32).to(tl.int32, bitcast=True)
            b3 = tl.load(elements + 3).to(tl.float32).to(tl.int32, bitcast=True)
        m0 = _magnitude_bits(b0)
        m1 = _magnitude_bits(b1)
        m2 = _magnitude_bits(b2)
        m3 = _magnitude_bits(b3)

    if ROWWISE:
        if HALVES:
            if MAX_U16X2:
                pairs = tl.reduce(tl.reshape(_max_u16x2(low, high),
                                             [SCALE_BLOCK, RUNS, RUN_WORDS]), 2, _max_u16x2)
            else:
                pairs = tl.reduce(tl.reshape(_max_halves(low, high),
                                             [SCALE_BLOCK, RUNS, RUN_WORDS]), 2, _max_halves)
            amax_bits = tl.maximum(pairs & 0xFFFF, pairs >> 16) << 16
        else:
            amax_bits = tl.max(tl.reshape(_max4(m0, m1, m2, m3), [SCALE_BLOCK, RUNS, RUN_WORDS]),
                               axis=2)
        row_scale = _e8m0(amax_bits.to(tl.float32, bitcast=True), RECIPROCAL_BITS)  # [32, RUNS]
    if COLUMNWISE:
        if HALVES:
            if MAX_U16X2:
                low_max, high_max = tl.reduce((low, high), 0, _max_u16x2_pairs)
            else:
                low_max, high_max = tl.reduce((low, high), 0, _max_halves_pairs)
            a0 = low_max << 16
            a1 = low_max & -65536
            a2 = high_max << 16
            a3 = high_max & -65536
        else:
            a0 = tl.max(m0, axis=0)
            a1 = tl.max(m1, axis=0)
            a2 = tl.max(m2, axis=0)
            a3 = tl.max(m3, axis=0)
        e0 = _e8m0(a0.to(tl.float32, bitcast=True), RECIPROCAL_BITS)  # [WORDS_K]
        e1 = _e8m0(a1.to(tl.float32, bitcast=True), RECIPROCAL_BITS)
        e2 = _e8m0(a2.to(tl.float32, bitcast=True), RECIPROCAL_BITS)
        e3 = _e8m0(a3.to(tl.float32, bitcast=True), RECIPROCAL_BITS)

    if HALVES:
        # the elements as fp32 bits, taken from the words again here (not kept from above), so
        # the tile stays in registers as words until the casts
        b0, b1, b2, b3 = _word_floats(words)
    if ROWWISE:
        element_scale = expand_blocks(row_scale, SCALE_BLOCK, WORDS_K, RUN_WORDS)
        if PRODUCTS:
            factor = expand_blocks(_word_factor(row_scale), SCALE_BLOCK, WORDS_K, RUN_WORDS)
            data = _cvt_words(_scaled(b0, factor), _scaled(b1, factor), _scaled(b2, factor),
                              _scaled(b3, factor), E5M2, HW_CAST)
            data = _nan_words(data, tl.where(element_scale == E8M0_NAN, -1, 0))
        else:
            data = _int_words(b0, b1, b2, b3, element_scale, element_scale, element_scale,
                              element_scale, MANTISSA_BITS, MIN_EXPONENT, MAX_CODE)
        tl.store(row_data_ptr + origin + offsets, data, mask=mask)
        runs_k = K // SCALE_BLOCK
        run_cols = tl.arange(0, RUNS)
        scale_origin = (pid_m * SCALE_BLOCK).to(tl.int64) * runs_k + pid_k * RUNS
        scale_offsets = rows[:, None] * runs_k + run_cols[None, :]
        scale_mask = None
        if MASK_K:
            scale_mask = tl.broadcast_to((pid_k * RUNS + run_cols < runs_k)[None, :],
                                         [SCALE_BLOCK, RUNS])
        tl.store(row_scale_ptr + scale_origin + scale_offsets, row_scale.to(tl.uint8),
                 mask=scale_mask)

    if COLUMNWISE:
        if PRODUCTS:
            data = _cvt_words(_scaled(b0, _word_factor(e0)[None, :]),
                              _scaled(b1, _word_factor(e1)[None, :]),
                              _scaled(b2, _word_factor(e2)[None, :]),
                              _scaled(b3, _word_factor(e3)[None, :]), E5M2, HW_CAST)
            # (e + 1) >> 8 is 1 for e = 255 (NaN) only
            nan_bytes = (((e0 + 1) >> 8) | (((e1 + 1) >> 8) << 8) | (((e2 + 1) >> 8) << 16)
                         | (((e3 + 1) >> 8) << 24)) * 0xFF
            data = _nan_words(data, nan_bytes[None, :])
        else:
            data = _int_words(b0, b1, b2, b3, e0[None, :], e1[None, :], e2[None, :], e3[None, :],
                              MANTISSA_BITS, MIN_EXPONENT, MAX_CODE)
        tl.store(col_data_ptr + origin + offsets, data, mask=mask)
        scale_words = e0 | (e1 << 8) | (e2 << 16) | (e3 << 24)
        tl.store(col_scale_ptr + pid_m.to(tl.int64) * k_words + pid_k * WORDS_K + cols,
                 scale_words, mask=col_ok)


@triton.jit
def _mxfp8_kernel(
    x_ptr, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, M, K,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr, MAX_CODE: tl.constexpr, RECIPROCAL_BITS: tl.constexpr,
    BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr, HW_CAST: tl.constexpr,
    PRODUCTS: tl.constexpr, MAX_U16X2: tl.constexpr, E5M2: tl.constexpr, MASK_K: tl.constexpr,
    HALVES: tl.constexpr,
):
    """Grid (M / 32, K tiles): one mxfp8_tile per program."""
    mxfp8_tile(x_ptr, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, M, K,
               tl.program_id(0), tl.program_id(1), ROWWISE, COLUMNWISE, MANTISSA_BITS,
               MIN_EXPONENT, MAX_CODE, RECIPROCAL_BITS, BLOCK_K, SCALE_BLOCK, HW_CAST, PRODUCTS,
               MAX_U16X2, E5M2, MASK_K, HALVES)


def reads_halves(x2d: torch.Tensor) -> bool:
    """Whether mxfp8_tile may read x2d as int64 words of four bf16 (HALVES): bf16 at an 8-byte
    aligned address. Other inputs are read element by element."""
    return x2d.dtype == torch.bfloat16 and x2d.data_ptr() % 8 == 0


def tile_constexprs(x2d: torch.Tensor, dtype: torch.dtype, *, rowwise: bool, columnwise: bool,
                    mask_k: bool, halves: bool) -> dict:
    """The constexprs of mxfp8_tile for inputs like x2d and elements of `dtype` (shared by the
    single- and the multi-tensor launch, which must agree for their bytes to)."""
    fmt = fp8_format(dtype)
    mantissa_bits, min_exponent, max_code = (
        E4M3_CONSTANTS if dtype == torch.float8_e4m3fn else E5M2_CONSTANTS
    )
    hw = hw_cast(x2d)
    return dict(
        ROWWISE=rowwise, COLUMNWISE=columnwise, MANTISSA_BITS=mantissa_bits,
        MIN_EXPONENT=min_exponent, MAX_CODE=max_code,
        RECIPROCAL_BITS=_reciprocal_bits(fmt.max_value), BLOCK_K=BLOCK_K, SCALE_BLOCK=BLOCK,
        HW_CAST=hw, PRODUCTS=hw or EMULATE_PRODUCTS,
        MAX_U16X2=halves and hw and _capability(x2d.device.index or 0) >= (9, 0),
        E5M2=dtype == torch.float8_e5m2, MASK_K=mask_k, HALVES=halves,
    )


def _int32_view(buffer: torch.Tensor) -> torch.Tensor:
    """A uint8 output buffer as int32 words (last dim / 4); the empty dummy stays as it is."""
    return buffer.view(torch.int32) if buffer.numel() else buffer


def quantize_mxfp8(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    dtype: torch.dtype = torch.float8_e4m3fn,
) -> dict[str, torch.Tensor]:
    """Drop-in for numerics.quantize_mxfp8 on a contiguous float32/bfloat16/float16 tensor:
    the same dict of buffers (`rowwise_data` [M, K] in `dtype`, `rowwise_scale` [M, K/32] uint8,
    `columnwise_data` [M, K], `columnwise_scale` [M/32, K]), the same bytes, one kernel launch."""
    fp8_format(dtype)
    if not x.is_contiguous():
        raise ValueError("the MXFP8 kernel needs a contiguous input; call .contiguous() first")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"the MXFP8 kernel takes float32/bfloat16/float16 inputs, got {x.dtype}")
    x2d = as_2d(x)
    m, k = x2d.shape
    require_divisible((m, k), BLOCK, "MXFP8")
    if BLOCK * k >= 2**31:  # in-tile offsets are 32-bit (registers); see mxfp8_tile
        raise ValueError(f"the MXFP8 kernel takes rows of fewer than {2**31 // BLOCK} "
                         f"elements, got K = {k}; quantize the tensor in column slices")
    device = x.device
    out: dict[str, torch.Tensor] = {}
    dummy = torch.empty(0, dtype=torch.uint8, device=device)
    row_data = row_scale = col_data = col_scale = dummy
    if rowwise:
        row_data = torch.empty((m, k), dtype=torch.uint8, device=device)
        row_scale = torch.empty((m, k // BLOCK), dtype=torch.uint8, device=device)
        out["rowwise_data"], out["rowwise_scale"] = row_data.view(dtype), row_scale
    if columnwise:
        col_data = torch.empty((m, k), dtype=torch.uint8, device=device)
        col_scale = torch.empty((m // BLOCK, k), dtype=torch.uint8, device=device)
        out["columnwise_data"], out["columnwise_scale"] = col_data.view(dtype), col_scale
    if out and m * k:
        halves = reads_halves(x2d)
        launch(
            _mxfp8_kernel, (m // BLOCK, triton.cdiv(k, BLOCK_K)),
            x2d.view(torch.int64) if halves else x2d, _int32_view(row_data), row_scale,
            _int32_view(col_data), _int32_view(col_scale), m, k,
            **tile_constexprs(x2d, dtype, rowwise=rowwise, columnwise=columnwise,
                              mask_k=k % BLOCK_K != 0, halves=halves),
            num_warps=NUM_WARPS,
        )
    return out
