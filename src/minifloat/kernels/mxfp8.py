"""MXFP8 quantization in Triton (NUMERICS.md §5), bit-exact against numerics.mxfp8.

One pass over the input: each program loads a BLOCK_M x BLOCK_K tile once and writes whichever
copies are asked for. Both copies keep the [M, K] layout of the input (no transpose):
- rowwise: 1x32 blocks along K -> data [M, K], E8M0 scales [M, K/32]
- columnwise: 32x1 blocks along M -> data [M, K], E8M0 scales [M/32, K]
Scales are compact (no padding), as numerics stores them. Elements are rounded with the integer
casts of element_cast (Triton's float8 conversions do not match the contract everywhere) under
the interpreter, and with cvt.rn.satfinite on CUDA.

Two kernels: bf16 inputs (the training case) take _mxfp8_words_kernel, which moves four
elements per int64 / int32 word end to end (v3: ~14 SASS instructions an element instead of
~35); other dtypes and unaligned views take _mxfp8_kernel (mxfp8_tile, shared with the
multi-tensor kernel).

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
    kernel_view,
    load_as_float,
    magnitude_bits,
    round_to_code,
    sign_bit,
    split_magnitude,
)
from .element_cast import e8m0_exponent as e8m0_from_amax
from .fp8_common import _capability, cdiv, cvt_sat_rne_fp8, hw_cast, sat_rne_fp8
from .halfwise import max_halves as _max_halves
from .halfwise import max_halves_pairs as _max_halves_pairs
from .halfwise import max_u16x2 as _max_u16x2
from .halfwise import max_u16x2_pairs as _max_u16x2_pairs
from .launch import launch

# Tile shape: 32 x 128 elements, 2 warps (64 elements a thread). Swept on an H100 with the
# hardware cast (benchmarks/KERNEL_NOTES.md): fewer warps per tile won at every tile size
# (32x128: 0.249 ms with 2 warps, 0.292 with 4, 0.531 with 8); each tile row is 256 bytes of
# bf16 input.
BLOCK_M = 32
BLOCK_K = 128
NUM_WARPS = 2
# DIRECT_COLUMNS: with BLOCK_M == 32 a tile holds one columnwise block per column, so its amax is
# a plain axis-0 max and its scale broadcasts back along axis 0 (no [1, 32, BLOCK_K] reshape):
# 0.245 ms against 0.248 reshaped (32x128, 2 warps; 1 warp 0.29, 4 warps 0.29, 32x64 w1 0.267).
# A 4-D [BLOCK_M/32, 32, BLOCK_K/32, 32] view with no reshape at all was 1.4-5x slower.
DIRECT_COLUMNS = True
# WORDS (v3): bf16 inputs with BLOCK_M == 32 take _mxfp8_words_kernel, which reads int64 words of
# four bf16 and writes int32 words of four FP8 codes, so no value is ever a lone byte: the v2
# kernel spent ~35 SASS instructions an element, most of them unpacking and repacking bytes
# around the cvt and a per-element NaN fix-up (benchmarks/KERNEL_NOTES.md, "MXFP8 v3").
# WORDS_BLOCK_K / WORDS_NUM_WARPS are that kernel's tile width and warps (its tile is 32 rows).
# Swept on an H200 (tune_kernels.py --only mx, copy 4168 GB/s): 32x256 w4 0.153 ms (0.853 of
# copy), 32x256 w2 0.154, 32x128 w2 0.162, 32x128 w4 0.162, 32x64 w2 0.181; v2 kernel 0.235.
WORDS = True
WORDS_BLOCK_K = 256
WORDS_NUM_WARPS = 4
# Tests only: run the words kernel's hardware algorithm (fp32 products, per-block NaN words) in
# the interpreter, with the integer sat_rne_fp8 standing in for the cvt and max.u16x2.
EMULATE_PRODUCTS = False

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
def _expand_rows(values, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr):
    """Per-block values [ROWS // BLOCK, COLS] repeated over their BLOCK rows -> [ROWS, COLS]."""
    repeated = tl.broadcast_to(values[:, None, :], [ROWS // BLOCK, BLOCK, COLS])
    return tl.reshape(repeated, [ROWS, COLS])


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
    BF16_BITS: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    MAX_CODE: tl.constexpr,
    RECIPROCAL_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    HW_CAST: tl.constexpr,
    E5M2: tl.constexpr,
    DIRECT_COLUMNS: tl.constexpr,
):
    """Tile (pid_m, pid_k) of one [M, K] tensor: rowwise and/or columnwise MXFP8 from a single
    load of x. Shared by _mxfp8_kernel and the multi-tensor kernel (kernels.mxfp8_multi), so both
    write the same bytes.

    Addresses are a 64-bit tile origin plus 32-bit offsets inside the tile (BLOCK_M * K < 2^31),
    which keeps per-element registers low.
    """
    row_start = pid_m * BLOCK_M
    col_start = pid_k * BLOCK_K
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    mask = ((row_start + rows)[:, None] < M) & ((col_start + cols)[None, :] < K)
    origin = row_start.to(tl.int64) * K + col_start
    offsets = rows[:, None] * K + cols[None, :]
    # Masked elements load as 0: they cannot raise a block's amax, and M, K are multiples of 32,
    # so blocks are either entirely inside the tensor or entirely outside (never stored).
    x = load_as_float(x_ptr + origin, offsets, mask, BF16_BITS)
    magnitude = magnitude_bits(x)

    if ROWWISE:
        runs = tl.reshape(magnitude, [BLOCK_M, BLOCK_K // SCALE_BLOCK, SCALE_BLOCK])
        block_amax = tl.max(runs, axis=2).to(tl.float32, bitcast=True)
        scale = e8m0_from_amax(block_amax, RECIPROCAL_BITS)  # [BLOCK_M, BLOCK_K // 32]
        if HW_CAST:
            # products exact wherever they are fp32 normals; below that the FP8 result is a
            # signed zero either way; cvt.rn.satfinite saturates infinities like the reference
            f, h = _hw_factors(scale)
            y = x * expand_blocks(f, BLOCK_M, BLOCK_K, SCALE_BLOCK)
            data = cvt_sat_rne_fp8(y * expand_blocks(h, BLOCK_M, BLOCK_K, SCALE_BLOCK), E5M2)
        else:
            element_scale = expand_blocks(scale, BLOCK_M, BLOCK_K, SCALE_BLOCK)
            data = _fp8_codes(x, element_scale, MANTISSA_BITS, MIN_EXPONENT, MAX_CODE)
        tl.store(row_data_ptr + origin + offsets, data, mask=mask)
        scale_cols = tl.arange(0, BLOCK_K // SCALE_BLOCK)
        scale_origin = row_start.to(tl.int64) * (K // SCALE_BLOCK) + col_start // SCALE_BLOCK
        scale_offsets = rows[:, None] * (K // SCALE_BLOCK) + scale_cols[None, :]
        scale_mask = ((row_start + rows)[:, None] < M) & (
            (col_start // SCALE_BLOCK + scale_cols)[None, :] < K // SCALE_BLOCK
        )
        tl.store(
            row_scale_ptr + scale_origin + scale_offsets, scale.to(tl.uint8), mask=scale_mask
        )

    if COLUMNWISE and DIRECT_COLUMNS:  # BLOCK_M == SCALE_BLOCK: one block per column
        scale = e8m0_from_amax(tl.max(magnitude, axis=0).to(tl.float32, bitcast=True),
                               RECIPROCAL_BITS)  # [BLOCK_K]
        if HW_CAST:
            f, h = _hw_factors(scale)
            data = cvt_sat_rne_fp8(x * f[None, :] * h[None, :], E5M2)
        else:
            data = _fp8_codes(x, scale[None, :], MANTISSA_BITS, MIN_EXPONENT, MAX_CODE)
        tl.store(col_data_ptr + origin + offsets, data, mask=mask)
        tl.store(col_scale_ptr + (row_start // SCALE_BLOCK).to(tl.int64) * K + col_start + cols,
                 scale.to(tl.uint8), mask=(col_start + cols) < K)
    elif COLUMNWISE:
        runs = tl.reshape(magnitude, [BLOCK_M // SCALE_BLOCK, SCALE_BLOCK, BLOCK_K])
        block_amax = tl.max(runs, axis=1).to(tl.float32, bitcast=True)
        scale = e8m0_from_amax(block_amax, RECIPROCAL_BITS)  # [BLOCK_M // 32, BLOCK_K]
        if HW_CAST:
            f, h = _hw_factors(scale)
            y = x * _expand_rows(f, BLOCK_M, BLOCK_K, SCALE_BLOCK)
            data = cvt_sat_rne_fp8(y * _expand_rows(h, BLOCK_M, BLOCK_K, SCALE_BLOCK), E5M2)
        else:
            element_scale = _expand_rows(scale, BLOCK_M, BLOCK_K, SCALE_BLOCK)
            data = _fp8_codes(x, element_scale, MANTISSA_BITS, MIN_EXPONENT, MAX_CODE)
        tl.store(col_data_ptr + origin + offsets, data, mask=mask)
        scale_rows = tl.arange(0, BLOCK_M // SCALE_BLOCK)
        scale_origin = (row_start // SCALE_BLOCK).to(tl.int64) * K + col_start
        scale_offsets = scale_rows[:, None] * K + cols[None, :]
        scale_mask = ((row_start // SCALE_BLOCK + scale_rows)[:, None] < M // SCALE_BLOCK) & (
            (col_start + cols)[None, :] < K
        )
        tl.store(
            col_scale_ptr + scale_origin + scale_offsets, scale.to(tl.uint8), mask=scale_mask
        )


@triton.jit
def _mxfp8_kernel(
    x_ptr,
    row_data_ptr,
    row_scale_ptr,
    col_data_ptr,
    col_scale_ptr,
    M,
    K,
    BF16_BITS: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    MAX_CODE: tl.constexpr,
    RECIPROCAL_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    HW_CAST: tl.constexpr,
    E5M2: tl.constexpr,
    DIRECT_COLUMNS: tl.constexpr,
):
    """Grid (M tiles, K tiles): one mxfp8_tile per program."""
    mxfp8_tile(
        x_ptr, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, M, K,
        tl.program_id(0), tl.program_id(1), BF16_BITS, ROWWISE, COLUMNWISE, MANTISSA_BITS,
        MIN_EXPONENT, MAX_CODE, RECIPROCAL_BITS, BLOCK_M, BLOCK_K, SCALE_BLOCK, HW_CAST, E5M2,
        DIRECT_COLUMNS,
    )


# ---------------------------------------------------------------------------------------------
# v3: words of four elements (bf16 input, 32-row tiles)
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
def _mxfp8_words_kernel(
    x_ptr,
    row_data_ptr,
    row_scale_ptr,
    col_data_ptr,
    col_scale_ptr,
    M,
    K,
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
):
    """Grid (M / 32, K tiles): one 32 x BLOCK_K tile of a bf16 [M, K] tensor, read as int64
    words of four elements (x_ptr: the input viewed as int64 [M, K/4]); both copies written as
    int32 words of four codes (row_data_ptr, col_data_ptr: int32 views [M, K/4]), columnwise
    scales as int32 words of four (col_scale_ptr: int32 view [M/32, K/4]), rowwise scales as
    bytes [M, K/32].

    Why words: in the element-wise kernel every code was a byte in its own register, unpacked
    from the cvt's packed result and repacked for the store, with a NaN fix-up per element:
    ~35 SASS instructions an element against ~14 here (counts in KERNEL_NOTES.md). Element k of a
    word is column 4j + k, so each of the four components is a [32, BLOCK_K / 4] tensor in the
    layout of the loaded words and every step is elementwise across them.

    HW_CAST: cvt by inline PTX (CUDA); PRODUCTS: the fp32-product algorithm that cvt needs
    (also run under the interpreter by tests, with an integer stand-in for the cvt);
    MAX_U16X2: max.u16x2 for the halfwise maxima (sm_90+; plain integer ops otherwise).

    Tiles are exactly one columnwise block high (M % 32 == 0), so no row mask; columns are
    masked only when K % BLOCK_K != 0 (MASK_K). Addresses are a 64-bit tile origin plus 32-bit
    in-tile offsets, as in mxfp8_tile.
    """
    WORDS_K: tl.constexpr = BLOCK_K // 4
    RUNS: tl.constexpr = BLOCK_K // SCALE_BLOCK  # rowwise blocks per tile row
    RUN_WORDS: tl.constexpr = SCALE_BLOCK // 4
    k_words = K // 4
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, SCALE_BLOCK)
    cols = tl.arange(0, WORDS_K)
    origin = (pid_m * SCALE_BLOCK).to(tl.int64) * k_words + pid_k * WORDS_K
    offsets = rows[:, None] * k_words + cols[None, :]
    if MASK_K:
        col_ok = pid_k * WORDS_K + cols < k_words
        mask = tl.broadcast_to(col_ok[None, :], [SCALE_BLOCK, WORDS_K])
        words = tl.load(x_ptr + origin + offsets, mask=mask, other=0)
    else:
        col_ok = None
        mask = None
        words = tl.load(x_ptr + origin + offsets)
    # |x| of two bf16 per int32 (sign bits cleared): as unsigned 16-bit halves they are ordered
    # like the values with every NaN above inf, so a halfwise max is torch.amax's NaN-propagating
    # absolute max, two elements per instruction (max.u16x2 on CUDA)
    low = words.to(tl.int32) & 0x7FFF7FFF
    high = (words >> 32).to(tl.int32) & 0x7FFF7FFF

    if ROWWISE:
        if MAX_U16X2:
            pairs = tl.reduce(tl.reshape(_max_u16x2(low, high), [SCALE_BLOCK, RUNS, RUN_WORDS]),
                              2, _max_u16x2)
        else:
            pairs = tl.reduce(tl.reshape(_max_halves(low, high), [SCALE_BLOCK, RUNS, RUN_WORDS]),
                              2, _max_halves)
        block_amax = (tl.maximum(pairs & 0xFFFF, pairs >> 16) << 16).to(tl.float32, bitcast=True)
        row_scale = _e8m0(block_amax, RECIPROCAL_BITS)  # [32, RUNS]
    if COLUMNWISE:
        if MAX_U16X2:
            low_max, high_max = tl.reduce((low, high), 0, _max_u16x2_pairs)
        else:
            low_max, high_max = tl.reduce((low, high), 0, _max_halves_pairs)
        e0 = _e8m0((low_max << 16).to(tl.float32, bitcast=True), RECIPROCAL_BITS)  # [WORDS_K]
        e1 = _e8m0((low_max & -65536).to(tl.float32, bitcast=True), RECIPROCAL_BITS)
        e2 = _e8m0((high_max << 16).to(tl.float32, bitcast=True), RECIPROCAL_BITS)
        e3 = _e8m0((high_max & -65536).to(tl.float32, bitcast=True), RECIPROCAL_BITS)

    # the elements as fp32 bits, taken from the words again here (not kept from above), so the
    # tile stays in registers as words until the casts
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

def _takes_words(x2d: torch.Tensor) -> bool:
    """Whether _mxfp8_words_kernel serves x2d: bf16 (four elements fill an int64 word), the
    input 8-byte aligned so it can be read as int64 words, WORDS on and a power-of-two
    WORDS_BLOCK_K of at least one block. Other inputs take _mxfp8_kernel."""
    width = WORDS_BLOCK_K
    return (WORDS and x2d.dtype == torch.bfloat16 and x2d.data_ptr() % 8 == 0
            and x2d.storage_offset() % 4 == 0 and width >= BLOCK and width & (width - 1) == 0)


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
    fmt = fp8_format(dtype)
    if not x.is_contiguous():
        raise ValueError("the MXFP8 kernel needs a contiguous input; call .contiguous() first")
    x2d = as_2d(x)
    m, k = x2d.shape
    require_divisible((m, k), BLOCK, "MXFP8")
    if BLOCK_M * k >= 2**31:  # in-tile offsets are 32-bit (registers); see mxfp8_tile
        raise ValueError(f"the MXFP8 kernel takes rows of fewer than {2**31 // BLOCK_M} "
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
        mantissa_bits, min_exponent, max_code = (
            E4M3_CONSTANTS if dtype == torch.float8_e4m3fn else E5M2_CONSTANTS
        )
        if _takes_words(x2d):
            words_k = WORDS_BLOCK_K
            hw = hw_cast(x2d)
            launch(
                _mxfp8_words_kernel, (m // BLOCK, cdiv(k, words_k)),
                x2d.view(torch.int64), _int32_view(row_data), row_scale, _int32_view(col_data),
                _int32_view(col_scale), m, k,
                ROWWISE=rowwise, COLUMNWISE=columnwise, MANTISSA_BITS=mantissa_bits,
                MIN_EXPONENT=min_exponent, MAX_CODE=max_code,
                RECIPROCAL_BITS=_reciprocal_bits(fmt.max_value), BLOCK_K=words_k,
                SCALE_BLOCK=BLOCK, HW_CAST=hw, PRODUCTS=hw or EMULATE_PRODUCTS,
                MAX_U16X2=hw and _capability(x.device.index or 0) >= (9, 0),
                E5M2=dtype == torch.float8_e5m2, MASK_K=k % words_k != 0,
                num_warps=WORDS_NUM_WARPS,
            )
            return out
        grid = (cdiv(m, BLOCK_M), cdiv(k, BLOCK_K))
        x_view, bf16_bits = kernel_view(x2d)
        launch(
            _mxfp8_kernel, grid, x_view, row_data, row_scale, col_data, col_scale, m, k,
            BF16_BITS=bf16_bits, ROWWISE=rowwise, COLUMNWISE=columnwise,
            MANTISSA_BITS=mantissa_bits, MIN_EXPONENT=min_exponent, MAX_CODE=max_code,
            RECIPROCAL_BITS=_reciprocal_bits(fmt.max_value),
            BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, SCALE_BLOCK=BLOCK, HW_CAST=hw_cast(x2d),
            E5M2=dtype == torch.float8_e5m2, DIRECT_COLUMNS=DIRECT_COLUMNS and BLOCK_M == BLOCK,
            num_warps=NUM_WARPS,
        )
    return out
