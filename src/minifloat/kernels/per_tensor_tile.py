"""Per-tensor FP8: the cast of one tile into its rowwise and transposed copies (NUMERICS.md §2-3).

Every per-tensor cast runs `per_tensor_tile`: the single-tensor launches of per_tensor_fp8
(current scaling in one or two launches, delayed scaling) and the multi-tensor launches of
multi_tensor / multi_tensor_each, so all of them write the same bytes from the same code.

Why it is built around words of four elements (benchmarks/KERNEL_NOTES.md, "per-tensor FP8
v3"; the byte-per-register kernel it replaced unpacked every cvt pair, fixed up NaN per code and
transposed one byte at a time through shared memory):
- the tile is held as four row slices: slice r holds rows 4i + r of the tile, [BLOCK_M / 4,
  BLOCK_K / 4] words each (element c of word j is column 4j + c);
- every element is scaled by one fp32 product, x * scale (the reference's), shared by both
  copies (one scale for the whole tensor);
- rowwise word (row 4i + r, word j) = the codes of the four components of slice r; columnwise
  word (column 4j + c, rows 4i..4i+3) = the codes of component c of the four slices, so the
  transposed copy is built elementwise across slices and only int32 words go through the
  register transpose (a quarter of the moves of a byte transpose);
- each word is two cvt.rn.satfinite x2 in one inline asm.

What the input and shape decide (constexprs chosen by the host, as for block_fp8.block_tile):
- HALVES (bf16, K % 4 == 0, 8-byte aligned): the input is read as int64 words of four bf16,
  unpacked by one shift or mask each, and the tile's maximum is taken halfwise on int32 pairs of
  magnitudes (max.u16x2 on sm_90). Otherwise each word's four columns load as element tensors
  (fp32, fp16, unaligned views, any K) and the maximum is over fp32 bit patterns.
- ROW_WORDS (K % 4 == 0) / COL_WORDS (M % 4 == 0): whole int32 words are stored into that copy;
  otherwise its words are stored byte by byte (odd shapes, decode-sized inputs).
- MASK_M / MASK_K: the tensor has partial tiles along M / K. WIDE: 64-bit in-tile offsets.

NaN: the contract's code for a NaN product y = x * scale is 0x7F | sign(y) (fp8_common.
cvt_sat_rne_fp8). Whatever byte the cvt writes for a NaN is replaced by that, but only in tiles
that can hold one (a NaN in the tile's input, or a zero, infinite or NaN scale): the check is
one scalar per tile (delayed scaling reduces the tile's amax anyway; current scaling from
partial maxima knows from the tensor's amax), so tiles without NaN spend nothing on it.
"""

from __future__ import annotations

from .fp8_common import jit, sat_rne_fp8, tile_offsets, tl
from .halfwise import max16 as _halfwise_max
from .halfwise import reduce16

# cvt.rn.satfinite x2 writes its first source operand to the upper byte: $1 ends in byte 0.
_E4M3_WORD_ASM = ("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                  "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }")
_E5M2_WORD_ASM = ("{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; "
                  "cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }")
if tl is not None:
    _E4M3_WORD_ASM = tl.constexpr(_E4M3_WORD_ASM)
    _E5M2_WORD_ASM = tl.constexpr(_E5M2_WORD_ASM)
# Tests only: the byte the interpreter's stand-in for the cvt writes for a NaN, deliberately
# not the contract's, so that a tile skipping the NaN fix-up fails the byte comparison.
EMULATED_NAN_CODE = 0x5A


# ---------------------------------------------------------------------------------------------
# codes
# ---------------------------------------------------------------------------------------------


@jit
def codes_word(y0, y1, y2, y3, E5M2: tl.constexpr, HW_CAST: tl.constexpr,
               PRODUCTS: tl.constexpr):
    """int32 word of the FP8 codes of four fp32 values (y0 in byte 0).

    HW_CAST: the hardware conversion, NaN bytes left to _nan_fixed. Otherwise PRODUCTS (tests,
    under the interpreter) emulates it: sat_rne_fp8 for every non-NaN value (that is the cvt's
    contract) and EMULATED_NAN_CODE for NaN. Neither: sat_rne_fp8 itself, NaN rule included
    (the interpreter's path)."""
    if HW_CAST:
        if E5M2:
            word = tl.inline_asm_elementwise(_E5M2_WORD_ASM, "=r,r,r,r,r", [y0, y1, y2, y3],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            word = tl.inline_asm_elementwise(_E4M3_WORD_ASM, "=r,r,r,r,r", [y0, y1, y2, y3],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:
        word = (_code(y0, E5M2, PRODUCTS) | (_code(y1, E5M2, PRODUCTS) << 8)
                | (_code(y2, E5M2, PRODUCTS) << 16) | (_code(y3, E5M2, PRODUCTS) << 24))
    return word


@jit
def _code(y, E5M2: tl.constexpr, PRODUCTS: tl.constexpr):
    """One code as int32 for the interpreter's paths of codes_word."""
    code = sat_rne_fp8(y, E5M2).to(tl.int32)
    if PRODUCTS:
        is_nan = (y.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
        code = tl.where(is_nan, EMULATED_NAN_CODE, code)
    return code


@jit
def _nan_byte(y, SHIFT: tl.constexpr):
    """(byte mask, contract byte) of y at bit SHIFT: 0xFF and 0x7F | sign(y) where y is NaN."""
    bits = y.to(tl.int32, bitcast=True)
    mask = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0xFF, 0) << SHIFT
    return mask, (((bits >> 24) & 0x80) | 0x7F) << SHIFT


@jit
def _nan_fixed(word, y0, y1, y2, y3):
    """word with the byte of every NaN y_k set to 0x7F | sign(y_k), as fp8_common does: only
    run in tiles that may hold a NaN (about five operations an element)."""
    m0, f0 = _nan_byte(y0, 0)
    m1, f1 = _nan_byte(y1, 8)
    m2, f2 = _nan_byte(y2, 16)
    m3, f3 = _nan_byte(y3, 24)
    mask = m0 | m1 | m2 | m3
    return (word & ~mask) | ((f0 | f1 | f2 | f3) & mask)


@jit
def _word(y0, y1, y2, y3, E5M2: tl.constexpr, HW_CAST: tl.constexpr, PRODUCTS: tl.constexpr,
          FIX_NAN: tl.constexpr):
    """The codes word of four products, NaN bytes rewritten where FIX_NAN."""
    word = codes_word(y0, y1, y2, y3, E5M2, HW_CAST, PRODUCTS)
    if FIX_NAN:
        word = _nan_fixed(word, y0, y1, y2, y3)
    return word


@jit
def scale_makes_nan(scale):
    """Whether x * scale may be NaN for a finite x: a zero, infinite or NaN scale (0 * inf).
    Otherwise only a NaN input makes a NaN product (the tiles' NaN fix-up is skipped then)."""
    magnitude = scale.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return (magnitude == 0) | (magnitude >= 0x7F800000)


@jit
def nan_possible(scale, amax):
    """Whether x * scale may be NaN in a tensor whose own amax this is: scale_makes_nan, or a
    NaN input (the amax is NaN exactly then)."""
    return scale_makes_nan(scale) | ((amax.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000)


# ---------------------------------------------------------------------------------------------
# loads: a row slice, its products and its magnitudes
# ---------------------------------------------------------------------------------------------


@jit
def _load_slice(x_tile, rows, cols, r, rows_left, cols_left, cols_left_e, K,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, MASK_M: tl.constexpr,
                MASK_K: tl.constexpr, HALVES: tl.constexpr, ROW_WORDS: tl.constexpr,
                WIDE: tl.constexpr, VOLATILE: tl.constexpr = False):
    """Row slice r of the tile (rows 4i + r, word columns j), as four values s0..s3.

    HALVES: the slice's int64 words, the same value four times (the components are unpacked
    where they are used, _products and _magnitudes: the registers hold packed words until
    then). Otherwise its columns 4j + c as element tensors, zeros where masked."""
    slice_rows = rows * 4 + r
    row_ok = slice_rows < rows_left
    if HALVES:
        offsets = tile_offsets(slice_rows, cols, K // 4, WIDE)
        if MASK_M or MASK_K:
            mask = row_ok[:, None] & (cols < cols_left)[None, :]
            words = tl.load(x_tile + offsets, mask=mask, other=0, volatile=VOLATILE)
        else:
            words = tl.load(x_tile + offsets, volatile=VOLATILE)
        s0 = words
        s1 = words
        s2 = words
        s3 = words
    else:
        # one load along the rows (coalesced; 16-byte vectors where rows are whole aligned
        # words), the four components split off in registers: element 4j + 2p + q of the
        # slice is quads[i, j, p, q]. Where K % 4 == 0 (ROW_WORDS) the mask compares word
        # indices, constant over a vector.
        columns = tl.arange(0, BLOCK_K)
        offsets = tile_offsets(slice_rows, columns, K, WIDE)
        if MASK_M or MASK_K:
            col_ok = columns // 4 < cols_left if ROW_WORDS else columns < cols_left_e
            values = tl.load(x_tile + offsets, mask=row_ok[:, None] & col_ok[None, :],
                             other=0.0, volatile=VOLATILE)
        else:
            values = tl.load(x_tile + offsets, volatile=VOLATILE)
        even, odd = tl.split(tl.reshape(values, [BLOCK_M // 4, BLOCK_K // 4, 2, 2]))
        s0, s2 = tl.split(even)
        s1, s3 = tl.split(odd)
    return s0, s1, s2, s3


@jit
def _products(s0, s1, s2, s3, scale, HALVES: tl.constexpr):
    """The slice's four components as fp32 times the tensor's scale (the reference's x * scale;
    the conversion to fp32 is exact). HALVES: element c of word j is column 4j + c
    (little-endian), unpacked by one shift or mask."""
    if HALVES:
        low = s0.to(tl.int32)
        high = (s0 >> 32).to(tl.int32)
        y0 = (low << 16).to(tl.float32, bitcast=True) * scale
        y1 = (low & -65536).to(tl.float32, bitcast=True) * scale
        y2 = (high << 16).to(tl.float32, bitcast=True) * scale
        y3 = (high & -65536).to(tl.float32, bitcast=True) * scale
    else:
        y0 = s0.to(tl.float32) * scale
        y1 = s1.to(tl.float32) * scale
        y2 = s2.to(tl.float32) * scale
        y3 = s3.to(tl.float32) * scale
    return y0, y1, y2, y3


@jit
def _magnitudes(s0, s1, s2, s3, HALVES: tl.constexpr, MAX_U16X2: tl.constexpr):
    """The slice's |x|, ordered like the values with every NaN above inf (so maxima keep
    torch.amax's NaN propagation). HALVES: two bf16 magnitudes per int32, their halfwise
    maximum (a pattern with its sign bit cleared orders like the magnitude); otherwise the
    maximum over the four columns of fp32 bit patterns."""
    if HALVES:
        magnitudes = _halfwise_max(s0.to(tl.int32) & 0x7FFF7FFF,
                                   (s0 >> 32).to(tl.int32) & 0x7FFF7FFF, MAX_U16X2)
    else:
        magnitudes = tl.maximum(tl.maximum(_abs_bits(s0), _abs_bits(s1)),
                                tl.maximum(_abs_bits(s2), _abs_bits(s3)))
    return magnitudes


@jit
def _abs_bits(values):
    return values.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@jit
def _tile_amax_bits(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
                    HALVES: tl.constexpr, MAX_U16X2: tl.constexpr):
    """max|x| over the four slices as fp32 bits (int32); NaN stays NaN (the bits abs_bits gives
    for the same element). HALVES: bf16 magnitude << 16, exact."""
    if HALVES:
        pairs = _halfwise_max(
            _halfwise_max(_magnitudes(a0, a1, a2, a3, True, MAX_U16X2),
                          _magnitudes(b0, b1, b2, b3, True, MAX_U16X2), MAX_U16X2),
            _halfwise_max(_magnitudes(c0, c1, c2, c3, True, MAX_U16X2),
                          _magnitudes(d0, d1, d2, d3, True, MAX_U16X2), MAX_U16X2), MAX_U16X2)
        pairs = reduce16(pairs, None, MAX_U16X2)
        amax = tl.maximum(pairs & 0xFFFF, pairs >> 16) << 16
    else:
        magnitudes = tl.maximum(
            tl.maximum(_magnitudes(a0, a1, a2, a3, False, False),
                       _magnitudes(b0, b1, b2, b3, False, False)),
            tl.maximum(_magnitudes(c0, c1, c2, c3, False, False),
                       _magnitudes(d0, d1, d2, d3, False, False)))
        amax = tl.max(tl.max(magnitudes, axis=1), axis=0)
    return amax


# ---------------------------------------------------------------------------------------------
# stores
# ---------------------------------------------------------------------------------------------


@jit
def _store_row_slice(data_tile, rows, cols, r, rows_left, cols_left, cols_left_e, K, word,
                     BLOCK_K: tl.constexpr, MASK_M: tl.constexpr, MASK_K: tl.constexpr,
                     ROW_WORDS: tl.constexpr, WIDE: tl.constexpr):
    """Rowwise codes of row slice r: int32 words (ROW_WORDS: data_tile is the int32 view of
    data [M, K / 4] at the tile), or each word's four bytes split off in registers and stored
    along the row (data_tile: the bytes at the tile; a row need not start on a word)."""
    slice_rows = rows * 4 + r
    if ROW_WORDS:
        offsets = tile_offsets(slice_rows, cols, K // 4, WIDE)
        if MASK_M or MASK_K:
            mask = (slice_rows < rows_left)[:, None] & (cols < cols_left)[None, :]
            tl.store(data_tile + offsets, word, mask=mask)
        else:
            tl.store(data_tile + offsets, word)
    else:
        columns = tl.arange(0, BLOCK_K)
        tl.store(data_tile + tile_offsets(slice_rows, columns, K, WIDE), _word_bytes(word),
                 mask=(slice_rows < rows_left)[:, None] & (columns < cols_left_e)[None, :])


@jit
def _word_bytes(words):
    """int32 words [A, B] as their bytes [A, 4B], byte c of word j at 4j + c: the nested joins
    stack on new last axes, so join(join(b0, b2), join(b1, b3)) indexes c = 2p + q."""
    b0 = (words & 0xFF).to(tl.uint8)
    b1 = ((words >> 8) & 0xFF).to(tl.uint8)
    b2 = ((words >> 16) & 0xFF).to(tl.uint8)
    b3 = ((words >> 24) & 0xFF).to(tl.uint8)
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)),
                      [words.shape[0], 4 * words.shape[1]])


@jit
def _store_columns(data_t_tile, rows, cols, rows_left, cols_left, cols_left_e, M, c0, c1, c2,
                   c3, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, MASK_M: tl.constexpr,
                   MASK_K: tl.constexpr, ROW_WORDS: tl.constexpr, COL_WORDS: tl.constexpr,
                   WIDE: tl.constexpr):
    """Columnwise codes: c_k holds rows 4i..4i+3 of columns 4j + k. One register transpose of
    whole words, [BLOCK_K, BLOCK_M / 4], so that the store runs along M and stays coalesced:
    into the int32 view of data_t [K, M / 4] (COL_WORDS), or with each word's four bytes split
    off in registers into data_t's bytes (a row of data_t need not start on a word)."""
    # [BLOCK_M / 4, BLOCK_K / 4, 4] with column 4j + c last, as [BLOCK_M / 4, BLOCK_K]:
    # join(a, b) stacks on a new last axis, so the nested joins index c = 2p + q
    words = tl.trans(tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)),
                                [BLOCK_M // 4, BLOCK_K]))
    kk = tl.arange(0, BLOCK_K)
    columns = cols_left * 4 if ROW_WORDS else cols_left_e
    if COL_WORDS:
        offsets = tile_offsets(kk, rows, M // 4, WIDE)
        if MASK_M or MASK_K:
            mask = (kk < columns)[:, None] & (rows * 4 < rows_left)[None, :]
            tl.store(data_t_tile + offsets, words, mask=mask)
        else:
            tl.store(data_t_tile + offsets, words)
    else:
        mm = tl.arange(0, BLOCK_M)
        tl.store(data_t_tile + tile_offsets(kk, mm, M, WIDE), _word_bytes(words),
                 mask=(kk < columns)[:, None] & (mm < rows_left)[None, :])


# ---------------------------------------------------------------------------------------------
# the tile
# ---------------------------------------------------------------------------------------------


@jit
def per_tensor_tile(x_ptr, data_ptr, data_t_ptr, amax_bits_ptr, scale, nan_possible, M, K,
                    pid_m, pid_k, E5M2: tl.constexpr, ROWWISE: tl.constexpr,
                    COLUMNWISE: tl.constexpr, RECORD_AMAX: tl.constexpr,
                    CHECK_NAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    HALVES: tl.constexpr, ROW_WORDS: tl.constexpr, COL_WORDS: tl.constexpr,
                    MASK_M: tl.constexpr, MASK_K: tl.constexpr, WIDE: tl.constexpr,
                    HW_CAST: tl.constexpr, PRODUCTS: tl.constexpr, MAX_U16X2: tl.constexpr):
    """Tile (pid_m, pid_k) of a row-major [M, K] tensor cast with one fp32 `scale`.

    x_ptr: int64 words [M, K / 4] (HALVES) or the elements [M, K]; data_ptr: int32 words
    [M, K / 4] (ROW_WORDS) or bytes [M, K]; data_t_ptr: int32 words [K, M / 4] (COL_WORDS) or
    bytes [K, M]. ROW_WORDS says K % 4 == 0 and COL_WORDS M % 4 == 0 whether or not that copy
    is written.

    RECORD_AMAX: fold the tile's max|x| into the int32 bits at amax_bits_ptr (delayed scaling).
    CHECK_NAN: derive from that amax whether the tile holds a NaN; otherwise `nan_possible`
    (a scalar from the caller) decides alone whether NaN bytes get the fix-up. Under the
    interpreter without PRODUCTS the integer rounding gives the NaN rule itself.
    """
    SLICE_M: tl.constexpr = BLOCK_M // 4
    WORDS_K: tl.constexpr = BLOCK_K // 4
    row0 = pid_m.to(tl.int64) * BLOCK_M
    col0 = pid_k.to(tl.int64) * BLOCK_K
    rows_left = tl.minimum(M - row0, BLOCK_M).to(tl.int32)
    cols_left_e = tl.minimum(K - col0, BLOCK_K).to(tl.int32)  # elements
    cols_left = tl.minimum(K // 4 - col0 // 4, WORDS_K).to(tl.int32)  # words (K % 4 == 0)
    rows = tl.arange(0, SLICE_M)
    cols = tl.arange(0, WORDS_K)
    x_tile = x_ptr + (row0 * (K // 4) + col0 // 4 if HALVES else row0 * K + col0)
    a0, a1, a2, a3 = _load_slice(x_tile, rows, cols, 0, rows_left, cols_left, cols_left_e, K,
                                 BLOCK_M, BLOCK_K, MASK_M, MASK_K, HALVES, ROW_WORDS, WIDE)
    b0, b1, b2, b3 = _load_slice(x_tile, rows, cols, 1, rows_left, cols_left, cols_left_e, K,
                                 BLOCK_M, BLOCK_K, MASK_M, MASK_K, HALVES, ROW_WORDS, WIDE)
    c0, c1, c2, c3 = _load_slice(x_tile, rows, cols, 2, rows_left, cols_left, cols_left_e, K,
                                 BLOCK_M, BLOCK_K, MASK_M, MASK_K, HALVES, ROW_WORDS, WIDE)
    d0, d1, d2, d3 = _load_slice(x_tile, rows, cols, 3, rows_left, cols_left, cols_left_e, K,
                                 BLOCK_M, BLOCK_K, MASK_M, MASK_K, HALVES, ROW_WORDS, WIDE)
    if RECORD_AMAX or CHECK_NAN:
        tile_amax = _tile_amax_bits(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3,
                                    d0, d1, d2, d3, HALVES, MAX_U16X2)
        if RECORD_AMAX:
            tl.atomic_max(amax_bits_ptr, tile_amax)
        if CHECK_NAN:
            nan_possible = nan_possible | (tile_amax > 0x7F800000)
    data_tile = data_ptr + (row0 * (K // 4) + col0 // 4 if ROW_WORDS else row0 * K + col0)
    data_t_tile = data_t_ptr + (col0 * (M // 4) + row0 // 4 if COL_WORDS else col0 * M + row0)
    if HW_CAST or PRODUCTS:
        # Two copies of the cast; the rare one re-reads the tile (volatile loads, from L2) for
        # each copy separately. When the branches share the products and codes, the compiler
        # computes them before the branch and keeps the fix-up's operands live in every tile
        # (211 registers instead of 96 at 64 x 128, 4 warps; 148 with one re-read for both).
        if nan_possible:
            if ROWWISE:
                _reload_cast_and_store(x_tile, data_tile, data_t_tile, rows, cols, rows_left,
                                       cols_left, cols_left_e, M, K, scale, E5M2, True, False,
                                       BLOCK_M, BLOCK_K, HALVES, ROW_WORDS, COL_WORDS, MASK_M,
                                       MASK_K, WIDE, HW_CAST, PRODUCTS)
            if COLUMNWISE:
                _reload_cast_and_store(x_tile, data_tile, data_t_tile, rows, cols, rows_left,
                                       cols_left, cols_left_e, M, K, scale, E5M2, False, True,
                                       BLOCK_M, BLOCK_K, HALVES, ROW_WORDS, COL_WORDS, MASK_M,
                                       MASK_K, WIDE, HW_CAST, PRODUCTS)
        else:
            _cast_and_store(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
                            scale, data_tile, data_t_tile, rows, cols, rows_left, cols_left,
                            cols_left_e, M, K, E5M2, ROWWISE, COLUMNWISE, BLOCK_M, BLOCK_K,
                            HALVES, ROW_WORDS, COL_WORDS, MASK_M, MASK_K, WIDE, HW_CAST,
                            PRODUCTS, False)
    else:  # integer rounding: the NaN rule is built in
        _cast_and_store(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
                        scale, data_tile, data_t_tile, rows, cols, rows_left, cols_left,
                        cols_left_e, M, K, E5M2, ROWWISE, COLUMNWISE, BLOCK_M, BLOCK_K,
                        HALVES, ROW_WORDS, COL_WORDS, MASK_M, MASK_K, WIDE, HW_CAST,
                        PRODUCTS, False)


@jit
def _reload_cast_and_store(x_tile, data_tile, data_t_tile, rows, cols, rows_left, cols_left,
                           cols_left_e, M, K, scale, E5M2: tl.constexpr, ROWWISE: tl.constexpr,
                           COLUMNWISE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr, HALVES: tl.constexpr,
                           ROW_WORDS: tl.constexpr, COL_WORDS: tl.constexpr,
                           MASK_M: tl.constexpr, MASK_K: tl.constexpr, WIDE: tl.constexpr,
                           HW_CAST: tl.constexpr, PRODUCTS: tl.constexpr):
    """_cast_and_store with the NaN fix-up, on the tile loaded again (tiles that may hold NaN)."""
    a0, a1, a2, a3 = _load_slice(x_tile, rows, cols, 0, rows_left, cols_left, cols_left_e, K,
                                 BLOCK_M, BLOCK_K, MASK_M, MASK_K, HALVES, ROW_WORDS, WIDE, True)
    b0, b1, b2, b3 = _load_slice(x_tile, rows, cols, 1, rows_left, cols_left, cols_left_e, K,
                                 BLOCK_M, BLOCK_K, MASK_M, MASK_K, HALVES, ROW_WORDS, WIDE, True)
    c0, c1, c2, c3 = _load_slice(x_tile, rows, cols, 2, rows_left, cols_left, cols_left_e, K,
                                 BLOCK_M, BLOCK_K, MASK_M, MASK_K, HALVES, ROW_WORDS, WIDE, True)
    d0, d1, d2, d3 = _load_slice(x_tile, rows, cols, 3, rows_left, cols_left, cols_left_e, K,
                                 BLOCK_M, BLOCK_K, MASK_M, MASK_K, HALVES, ROW_WORDS, WIDE, True)
    _cast_and_store(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, scale,
                    data_tile, data_t_tile, rows, cols, rows_left, cols_left, cols_left_e, M, K,
                    E5M2, ROWWISE, COLUMNWISE, BLOCK_M, BLOCK_K, HALVES, ROW_WORDS, COL_WORDS,
                    MASK_M, MASK_K, WIDE, HW_CAST, PRODUCTS, True)


@jit
def _cast_and_store(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, scale,
                    data_tile, data_t_tile, rows, cols, rows_left, cols_left, cols_left_e, M, K,
                    E5M2: tl.constexpr, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HALVES: tl.constexpr,
                    ROW_WORDS: tl.constexpr, COL_WORDS: tl.constexpr, MASK_M: tl.constexpr,
                    MASK_K: tl.constexpr, WIDE: tl.constexpr, HW_CAST: tl.constexpr,
                    PRODUCTS: tl.constexpr, FIX_NAN: tl.constexpr):
    """Cast the four row slices (a: rows 4i, b: 4i + 1, c: 4i + 2, d: 4i + 3; as _load_slice
    gives them) and store the copies asked for; FIX_NAN rewrites NaN bytes to the contract's
    (tiles that may hold a NaN)."""
    # y_rc: component c (column 4j + c) of slice r (row 4i + r)
    y00, y01, y02, y03 = _products(a0, a1, a2, a3, scale, HALVES)
    y10, y11, y12, y13 = _products(b0, b1, b2, b3, scale, HALVES)
    y20, y21, y22, y23 = _products(c0, c1, c2, c3, scale, HALVES)
    y30, y31, y32, y33 = _products(d0, d1, d2, d3, scale, HALVES)
    if ROWWISE:
        r0 = _word(y00, y01, y02, y03, E5M2, HW_CAST, PRODUCTS, FIX_NAN)
        r1 = _word(y10, y11, y12, y13, E5M2, HW_CAST, PRODUCTS, FIX_NAN)
        r2 = _word(y20, y21, y22, y23, E5M2, HW_CAST, PRODUCTS, FIX_NAN)
        r3 = _word(y30, y31, y32, y33, E5M2, HW_CAST, PRODUCTS, FIX_NAN)
        _store_row_slice(data_tile, rows, cols, 0, rows_left, cols_left, cols_left_e, K, r0,
                         BLOCK_K, MASK_M, MASK_K, ROW_WORDS, WIDE)
        _store_row_slice(data_tile, rows, cols, 1, rows_left, cols_left, cols_left_e, K, r1,
                         BLOCK_K, MASK_M, MASK_K, ROW_WORDS, WIDE)
        _store_row_slice(data_tile, rows, cols, 2, rows_left, cols_left, cols_left_e, K, r2,
                         BLOCK_K, MASK_M, MASK_K, ROW_WORDS, WIDE)
        _store_row_slice(data_tile, rows, cols, 3, rows_left, cols_left, cols_left_e, K, r3,
                         BLOCK_K, MASK_M, MASK_K, ROW_WORDS, WIDE)
    if COLUMNWISE:
        k0 = _word(y00, y10, y20, y30, E5M2, HW_CAST, PRODUCTS, FIX_NAN)
        k1 = _word(y01, y11, y21, y31, E5M2, HW_CAST, PRODUCTS, FIX_NAN)
        k2 = _word(y02, y12, y22, y32, E5M2, HW_CAST, PRODUCTS, FIX_NAN)
        k3 = _word(y03, y13, y23, y33, E5M2, HW_CAST, PRODUCTS, FIX_NAN)
        _store_columns(data_t_tile, rows, cols, rows_left, cols_left, cols_left_e, M, k0, k1,
                       k2, k3, BLOCK_M, BLOCK_K, MASK_M, MASK_K, ROW_WORDS, COL_WORDS, WIDE)
