"""Block FP8 (1x128 and 128x128) for bf16 inputs, four elements per word end to end.

Why a second kernel: the element kernels of block_fp8.py are issue-bound on an H200 (1x128 at
0.64 of copy, 128x128 at 0.67): every code is a byte in its own register, the transposed copy
moves bytes through shared memory, and the 1x128 kernel reads its tile twice (the second sweep
from L2). The MXFP8 words kernel (mxfp8.py) reached 0.85 of copy with the ideas used here
(benchmarks/KERNEL_NOTES.md, "MXFP8 v3" and "block FP8 words"):
- the bf16 input is read as int64 words of four elements; a 128x128 tile is loaded once, as four
  row slices (slice j holds rows 4i + j, [32, 32] words each), so a thread holds a 4x4 block of
  elements for every (i, w) it owns: rows 4i..4i+3, columns 4w..4w+3;
- rowwise codes leave as int32 words of four columns (row 4i + j, columns 4w..4w+3), transposed
  codes as int32 words of four rows (column 4w + c, rows 4i..4i+3): both words are assembled in
  registers by one conversion each, and only whole words cross shared memory (Triton's layout
  conversion for the coalesced transposed store); no lone byte is ever stored;
- magnitudes as halfwise maxima of |x| (two bf16 per int32 with the sign bits cleared, ordered
  like the values with NaN above inf), two elements per max.u16x2 on sm_90;
- one fp32 product per element and direction (x * scale, exactly the reference's product; the
  128x128 kernel shares one product between both directions) and cvt.rn.satfinite.e4m3x2 into
  the word. No NaN fix-up at all: a block scale is 1 when its block holds a NaN, the NaN product
  converts to a NaN code (low bits 0x7F), and the NaN sign is not part of the contract (CUDA
  arithmetic returns the canonical NaN anyway).

Under the interpreter the same algorithm runs with sat_rne_fp8 standing in for the cvt and plain
integer ops for max.u16x2 (both bit-exact), so the interpreter tests check the algorithm.

Served inputs (see takes_words): bf16, M and K multiples of 4, 8-byte aligned, offsets within
int32 (block_fp8's needs_wide_offsets false). The host entry and the module constants that pick
this kernel live in block_fp8.py (WORDS, WORDS_NUM_WARPS_1D / _2D) so tune_kernels.py can
override them there.
"""

from __future__ import annotations

import torch

from . import block_fp8
from .block_fp8 import _scale, _scale_inv
from .fp8_common import _capability, cdiv, hw_cast, jit, sat_rne_fp8, tl
from .launch import launch

TILE = 128  # the block length: one tile holds whole blocks of both directions
QUADS = TILE // 4  # words of four along either side of the tile
QUADS = QUADS if tl is None else tl.constexpr(QUADS)

# Four fp32 ($1..$4) to the E4M3 codes of one int32 word ($1's code in the low byte).
_CVT_ASM = ("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }")
_CVT_ASM = _CVT_ASM if tl is None else tl.constexpr(_CVT_ASM)


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
def _max16(a, b, MAX_U16X2: tl.constexpr):
    """Halfwise unsigned max of int32 words whose bits 15 and 31 are clear (two magnitudes per
    word): max.u16x2 on sm_90+, two masked maxima otherwise (interpreter, sm_89)."""
    if MAX_U16X2:
        m = tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        m = tl.maximum(a & 0xFFFF, b & 0xFFFF) | tl.maximum(a & 0x7FFF0000, b & 0x7FFF0000)
    return m


@jit
def _max16_hw(a, b):
    """Combine function of a max.u16x2 reduction."""
    return _max16(a, b, True)


@jit
def _max16_int(a, b):
    """Combine function of the plain-integer halfwise reduction."""
    return _max16(a, b, False)


@jit
def _max16_hw_pairs(a0, a1, b0, b1):
    """Combine function of a two-tensor max.u16x2 reduction (one shared-memory round)."""
    return _max16(a0, b0, True), _max16(a1, b1, True)


@jit
def _max16_int_pairs(a0, a1, b0, b1):
    """Combine function of a two-tensor plain-integer halfwise reduction."""
    return _max16(a0, b0, False), _max16(a1, b1, False)


@jit
def _reduce16(pairs, axis: tl.constexpr, MAX_U16X2: tl.constexpr):
    """Halfwise maxima of a word tensor along `axis`."""
    return tl.reduce(pairs, axis, _max16_hw) if MAX_U16X2 else tl.reduce(pairs, axis, _max16_int)


@jit
def _halves_amax(pairs):
    """fp32 bits of the larger bf16 magnitude of each word (both halves folded)."""
    return tl.maximum(pairs & 0xFFFF, pairs >> 16) << 16


@jit
def _floats(words):
    """The four bf16 elements of int64 words as fp32 (element 0 from the low 16 bits): one shift
    or mask each, exact."""
    low = words.to(tl.int32)
    high = (words >> 32).to(tl.int32)
    return ((low << 16).to(tl.float32, bitcast=True), (low & -65536).to(tl.float32, bitcast=True),
            (high << 16).to(tl.float32, bitcast=True), (high & -65536).to(tl.float32, bitcast=True))


# bf16 element 0 / 1 of an int32 ($1) as fp32 bits ($0): byte permutes, opaque to the compilers'
# common-subexpression elimination (see _floats_apart).
_ELEM0_ASM = "prmt.b32 $0, $1, 0, 0x1044;"
_ELEM0_ASM = _ELEM0_ASM if tl is None else tl.constexpr(_ELEM0_ASM)
_ELEM1_ASM = "prmt.b32 $0, $1, 0, 0x3244;"
_ELEM1_ASM = _ELEM1_ASM if tl is None else tl.constexpr(_ELEM1_ASM)


@jit
def _float_asm(half, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=r,r", [half], dtype=tl.int32, is_pure=True,
                                     pack=1).to(tl.float32, bitcast=True)


@jit
def _floats_apart(words, APART: tl.constexpr):
    """_floats(words), computed apart from _floats (APART, CUDA only): the same bits from byte
    permutes in inline asm, so no compiler merges them with the rowwise copy's unpacking. The
    1x128 kernel unpacks the tile twice then, once per direction: the merged unpack kept all
    128 fp32 of a thread live from the rowwise stores to the transposed ones (161 registers at
    4 warps), the apart one keeps the int64 words only (half as many registers)."""
    if APART:
        low = words.to(tl.int32)
        high = (words >> 32).to(tl.int32)
        f0 = _float_asm(low, _ELEM0_ASM)
        f1 = _float_asm(low, _ELEM1_ASM)
        f2 = _float_asm(high, _ELEM0_ASM)
        f3 = _float_asm(high, _ELEM1_ASM)
    else:
        f0, f1, f2, f3 = _floats(words)
    return f0, f1, f2, f3


@jit
def _magnitudes(words):
    """|x| of the four bf16 of int64 words as two int32 words of two halves (sign bits clear)."""
    return words.to(tl.int32) & 0x7FFF7FFF, (words >> 32).to(tl.int32) & 0x7FFF7FFF


@jit
def _load(pointers, mask, MASKED: tl.constexpr):
    """Words at `pointers`, zeros where masked (MASKED: the tile has a partial edge)."""
    return tl.load(pointers, mask=mask, other=0) if MASKED else tl.load(pointers)


@jit
def _block_words_kernel(x_ptr, row_data_ptr, row_si_ptr, col_data_ptr, col_si_ptr, eps,
                        M_WORDS, K_WORDS, POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr,
                        ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
                        TILE_2D: tl.constexpr, HW_CAST: tl.constexpr,
                        MAX_U16X2: tl.constexpr, MASK_M: tl.constexpr, MASK_K: tl.constexpr,
                        APART: tl.constexpr = False):
    """One 128x128 tile of a bf16 [M, K] tensor per program (grid: tiles, K fastest).

    x_ptr: the input as int64 [M, K/4]; row_data_ptr: int32 [M, K/4]; col_data_ptr: int32
    [K, M/4]; M_WORDS = M / 4, K_WORDS = K / 4 (passed as words so Triton sees their
    divisibility). TILE_2D: one scale per tile (quantize_block_2d, the columnwise copy being its
    exact transpose), else 1x128 blocks along K (rowwise) and along M (columnwise).
    MASK_M / MASK_K: the tensor has partial tiles along M / K (masks compiled in only then).
    APART (1x128 with both copies, CUDA): the transposed copy unpacks the words again
    (_floats_apart) instead of reusing the rowwise copy's fp32 (block_fp8.WORDS_APART_1D).
    """
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K_WORDS, QUADS)
    tiles_m = tl.cdiv(M_WORDS, QUADS)
    pid_m = pid // tiles_k
    pid_k = pid % tiles_k
    quad0 = pid_m * QUADS  # first row quad (row 4 * quad0) and first word column of the tile
    word0 = pid_k * QUADS
    i = tl.arange(0, QUADS)  # row quad: rows 4i..4i+3 of the tile
    w = tl.arange(0, QUADS)  # word column: columns 4w..4w+3 of the tile
    quads_left = tl.minimum(M_WORDS - quad0, QUADS)
    words_left = tl.minimum(K_WORDS - word0, QUADS)
    x_tile = x_ptr + (4 * quad0).to(tl.int64) * K_WORDS + word0
    offsets = i[:, None] * (4 * K_WORDS) + w[None, :]  # slice j adds j * K_WORDS
    mask = None
    if MASK_M or MASK_K:
        mask = (i[:, None] < quads_left) & (w[None, :] < words_left)
    # four row slices; the tile stays in registers as int64 words until the casts
    x0 = _load(x_tile + offsets, mask, MASK_M or MASK_K)
    x1 = _load(x_tile + K_WORDS + offsets, mask, MASK_M or MASK_K)
    x2 = _load(x_tile + 2 * K_WORDS + offsets, mask, MASK_M or MASK_K)
    x3 = _load(x_tile + 3 * K_WORDS + offsets, mask, MASK_M or MASK_K)
    # masked words load as 0: a zero cannot raise an amax, and M % 4 == 0 keeps row quads whole
    lo0, hi0 = _magnitudes(x0)
    lo1, hi1 = _magnitudes(x1)
    lo2, hi2 = _magnitudes(x2)
    lo3, hi3 = _magnitudes(x3)

    if TILE_2D:
        pairs = _max16(_max16(_max16(lo0, hi0, MAX_U16X2), _max16(lo1, hi1, MAX_U16X2),
                              MAX_U16X2),
                       _max16(_max16(lo2, hi2, MAX_U16X2), _max16(lo3, hi3, MAX_U16X2),
                              MAX_U16X2), MAX_U16X2)
        pairs = _reduce16(_reduce16(pairs, 1, MAX_U16X2), 0, MAX_U16X2)
        scale = _scale(_halves_amax(pairs), eps, POW2, OVERFLOW_BITS)
        f00, f01, f02, f03 = _floats(x0)
        f10, f11, f12, f13 = _floats(x1)
        f20, f21, f22, f23 = _floats(x2)
        f30, f31, f32, f33 = _floats(x3)
        y00, y01, y02, y03 = f00 * scale, f01 * scale, f02 * scale, f03 * scale
        y10, y11, y12, y13 = f10 * scale, f11 * scale, f12 * scale, f13 * scale
        y20, y21, y22, y23 = f20 * scale, f21 * scale, f22 * scale, f23 * scale
        y30, y31, y32, y33 = f30 * scale, f31 * scale, f32 * scale, f33 * scale
        scale_inv = _scale_inv(scale, POW2)
        if ROWWISE:
            row_tile = row_data_ptr + (4 * quad0).to(tl.int64) * K_WORDS + word0
            tl.store(row_tile + offsets, _e4m3_word(y00, y01, y02, y03, HW_CAST), mask=mask)
            tl.store(row_tile + K_WORDS + offsets, _e4m3_word(y10, y11, y12, y13, HW_CAST),
                     mask=mask)
            tl.store(row_tile + 2 * K_WORDS + offsets, _e4m3_word(y20, y21, y22, y23, HW_CAST),
                     mask=mask)
            tl.store(row_tile + 3 * K_WORDS + offsets, _e4m3_word(y30, y31, y32, y33, HW_CAST),
                     mask=mask)
            tl.store(row_si_ptr + pid_m * tiles_k + pid_k, scale_inv)
        if COLUMNWISE:
            col_tile = col_data_ptr + (4 * word0).to(tl.int64) * M_WORDS + quad0
            col_offsets = i[:, None] + w[None, :] * (4 * M_WORDS)  # column c adds c * M_WORDS
            tl.store(col_tile + col_offsets, _e4m3_word(y00, y10, y20, y30, HW_CAST), mask=mask)
            tl.store(col_tile + M_WORDS + col_offsets, _e4m3_word(y01, y11, y21, y31, HW_CAST),
                     mask=mask)
            tl.store(col_tile + 2 * M_WORDS + col_offsets,
                     _e4m3_word(y02, y12, y22, y32, HW_CAST), mask=mask)
            tl.store(col_tile + 3 * M_WORDS + col_offsets,
                     _e4m3_word(y03, y13, y23, y33, HW_CAST), mask=mask)
            tl.store(col_si_ptr + pid_k * tiles_m + pid_m, scale_inv)
    else:
        if ROWWISE:
            # row 4i + j: both halves of both words, then along the tile row
            r0 = _scale(_halves_amax(_reduce16(_max16(lo0, hi0, MAX_U16X2), 1, MAX_U16X2)), eps,
                        POW2, OVERFLOW_BITS)
            r1 = _scale(_halves_amax(_reduce16(_max16(lo1, hi1, MAX_U16X2), 1, MAX_U16X2)), eps,
                        POW2, OVERFLOW_BITS)
            r2 = _scale(_halves_amax(_reduce16(_max16(lo2, hi2, MAX_U16X2), 1, MAX_U16X2)), eps,
                        POW2, OVERFLOW_BITS)
            r3 = _scale(_halves_amax(_reduce16(_max16(lo3, hi3, MAX_U16X2), 1, MAX_U16X2)), eps,
                        POW2, OVERFLOW_BITS)
        if COLUMNWISE:
            # column 4w + c: the four slices elementwise, then down the tile (both words of a
            # pair in one reduction)
            low = _max16(_max16(lo0, lo1, MAX_U16X2), _max16(lo2, lo3, MAX_U16X2), MAX_U16X2)
            high = _max16(_max16(hi0, hi1, MAX_U16X2), _max16(hi2, hi3, MAX_U16X2), MAX_U16X2)
            if MAX_U16X2:
                low, high = tl.reduce((low, high), 0, _max16_hw_pairs)
            else:
                low, high = tl.reduce((low, high), 0, _max16_int_pairs)
            c0 = _scale(low << 16, eps, POW2, OVERFLOW_BITS)
            c1 = _scale(low & -65536, eps, POW2, OVERFLOW_BITS)
            c2 = _scale(high << 16, eps, POW2, OVERFLOW_BITS)
            c3 = _scale(high & -65536, eps, POW2, OVERFLOW_BITS)
        f00, f01, f02, f03 = _floats(x0)
        f10, f11, f12, f13 = _floats(x1)
        f20, f21, f22, f23 = _floats(x2)
        f30, f31, f32, f33 = _floats(x3)
        if ROWWISE:
            row_tile = row_data_ptr + (4 * quad0).to(tl.int64) * K_WORDS + word0
            s = r0[:, None]
            tl.store(row_tile + offsets, _e4m3_word(f00 * s, f01 * s, f02 * s, f03 * s, HW_CAST),
                     mask=mask)
            s = r1[:, None]
            tl.store(row_tile + K_WORDS + offsets,
                     _e4m3_word(f10 * s, f11 * s, f12 * s, f13 * s, HW_CAST), mask=mask)
            s = r2[:, None]
            tl.store(row_tile + 2 * K_WORDS + offsets,
                     _e4m3_word(f20 * s, f21 * s, f22 * s, f23 * s, HW_CAST), mask=mask)
            s = r3[:, None]
            tl.store(row_tile + 3 * K_WORDS + offsets,
                     _e4m3_word(f30 * s, f31 * s, f32 * s, f33 * s, HW_CAST), mask=mask)
            k_blocks = tiles_k
            si_rows = (4 * quad0 + 4 * i).to(tl.int64) * k_blocks + pid_k
            row_ok = None
            if MASK_M:
                row_ok = i < quads_left
            tl.store(row_si_ptr + si_rows, _scale_inv(r0, POW2), mask=row_ok)
            tl.store(row_si_ptr + si_rows + k_blocks, _scale_inv(r1, POW2), mask=row_ok)
            tl.store(row_si_ptr + si_rows + 2 * k_blocks, _scale_inv(r2, POW2), mask=row_ok)
            tl.store(row_si_ptr + si_rows + 3 * k_blocks, _scale_inv(r3, POW2), mask=row_ok)
        if COLUMNWISE:
            if APART and ROWWISE:  # unpacked again, apart from the rowwise copy's fp32
                f00, f01, f02, f03 = _floats_apart(x0, True)
                f10, f11, f12, f13 = _floats_apart(x1, True)
                f20, f21, f22, f23 = _floats_apart(x2, True)
                f30, f31, f32, f33 = _floats_apart(x3, True)
            col_tile = col_data_ptr + (4 * word0).to(tl.int64) * M_WORDS + quad0
            col_offsets = i[:, None] + w[None, :] * (4 * M_WORDS)  # column c adds c * M_WORDS
            t = c0[None, :]
            tl.store(col_tile + col_offsets,
                     _e4m3_word(f00 * t, f10 * t, f20 * t, f30 * t, HW_CAST), mask=mask)
            t = c1[None, :]
            tl.store(col_tile + M_WORDS + col_offsets,
                     _e4m3_word(f01 * t, f11 * t, f21 * t, f31 * t, HW_CAST), mask=mask)
            t = c2[None, :]
            tl.store(col_tile + 2 * M_WORDS + col_offsets,
                     _e4m3_word(f02 * t, f12 * t, f22 * t, f32 * t, HW_CAST), mask=mask)
            t = c3[None, :]
            tl.store(col_tile + 3 * M_WORDS + col_offsets,
                     _e4m3_word(f03 * t, f13 * t, f23 * t, f33 * t, HW_CAST), mask=mask)
            m_blocks = tiles_m
            si_cols = (4 * word0 + 4 * w).to(tl.int64) * m_blocks + pid_m
            col_ok = None
            if MASK_K:
                col_ok = w < words_left
            tl.store(col_si_ptr + si_cols, _scale_inv(c0, POW2), mask=col_ok)
            tl.store(col_si_ptr + si_cols + m_blocks, _scale_inv(c1, POW2), mask=col_ok)
            tl.store(col_si_ptr + si_cols + 2 * m_blocks, _scale_inv(c2, POW2), mask=col_ok)
            tl.store(col_si_ptr + si_cols + 3 * m_blocks, _scale_inv(c3, POW2), mask=col_ok)


def takes_words(x2d: torch.Tensor, wide: bool) -> bool:
    """Whether _block_words_kernel serves the [M, K] view x2d: bf16 (four elements fill an int64
    word), M and K multiples of 4 (whole words in both copies), the input 8-byte aligned, and
    in-tile offsets within int32 (`wide` false). Other inputs take the element kernels."""
    m, k = x2d.shape
    return (x2d.dtype == torch.bfloat16 and m % 4 == 0 and k % 4 == 0 and not wide
            and x2d.data_ptr() % 8 == 0)


def _words(buffer: torch.Tensor) -> torch.Tensor:
    """A uint8 [rows, cols] output buffer as int32 words [rows, cols / 4]."""
    return buffer.view(torch.int32)


def launch_words(x2d: torch.Tensor, row_data: torch.Tensor, row_si: torch.Tensor,
                 col_data: torch.Tensor, col_si: torch.Tensor, eps: float, *, tile_2d: bool,
                 rowwise: bool, columnwise: bool, power_2_scale: bool, overflow_bits: int,
                 num_warps: int) -> None:
    """Launch _block_words_kernel on x2d (takes_words(x2d) must hold) into the uint8 data and
    fp32 scale buffers allocated by block_fp8 (placeholders for a copy not asked for)."""
    m, k = x2d.shape
    hw = hw_cast(x2d)
    launch(
        _block_words_kernel, (cdiv(m, TILE) * cdiv(k, TILE),),
        x2d.view(torch.int64), _words(row_data), row_si, _words(col_data), col_si, eps,
        m // 4, k // 4,
        POW2=power_2_scale, OVERFLOW_BITS=overflow_bits, ROWWISE=rowwise, COLUMNWISE=columnwise,
        TILE_2D=tile_2d, HW_CAST=hw,
        MAX_U16X2=hw and _capability(x2d.device.index or 0) >= (9, 0),
        MASK_M=m % TILE != 0, MASK_K=k % TILE != 0,
        APART=bool(block_fp8.WORDS_APART_1D) and hw and not tile_2d and rowwise and columnwise,
        num_warps=num_warps,
    )
