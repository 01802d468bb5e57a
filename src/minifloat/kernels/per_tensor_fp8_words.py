"""Per-tensor FP8 cast + transpose for bf16 inputs in words of four elements (v3).

Why a second kernel: the element kernel (per_tensor_fp8.cast_transpose_tile) holds every FP8
code as a byte in its own register: the cvt's packed pair is unpacked, each code gets a NaN
fix-up, the bytes are repacked for the rowwise store and transposed one byte at a time through
shared memory for the columnwise one. Here nothing is ever a lone byte (as in the MXFP8 words
kernel, benchmarks/KERNEL_NOTES.md "MXFP8 v3"):

- the input is read as int64 words of four bf16 (element c of word j is column 4j + c), in four
  row slices: slice r holds rows 4i + r of the tile, [BLOCK_M / 4, BLOCK_K / 4] words each;
- every element is unpacked to fp32 by one shift or mask and scaled by one fp32 product, shared
  by both copies (one scale for the whole tensor);
- rowwise word (row 4i + r, word j) = the codes of the four components of slice r;
  columnwise word (column 4j + c, rows 4i..4i+3) = the codes of component c of the four slices,
  so the transposed copy is built elementwise across slices and only int32 words go through
  the register transpose (a quarter of the moves of the byte transpose);
- each word is two cvt.rn.satfinite x2 in one inline asm.

NaN: the kernels' rule is code 0x7F | sign(y) for a NaN product y = x * scale (fp8_common.
cvt_sat_rne_fp8). Whatever byte the cvt writes for a NaN is replaced by that, but only in tiles
that can hold one (a NaN in the tile's input, or a zero, infinite or NaN scale): the check is one
scalar per tile (delayed scaling reduces the tile's amax anyway; current scaling from partial
maxima knows from the tensor's amax), so tiles without NaN spend nothing on it.

Imported by per_tensor_fp8, which chooses between the kernels (WORDS and its WORDS_* settings).
"""

from __future__ import annotations

from .amax import current_scale
from .fp8_common import jit, reciprocal_rn, sat_rne_fp8, tl
from .halfwise import max16 as _halfwise_max
from .halfwise import max_halves as _max_halves
from .halfwise import max_u16x2 as _max_u16x2

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


@jit
def _codes_word(y0, y1, y2, y3, E5M2: tl.constexpr, HW_CAST: tl.constexpr,
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
    """One code as int32 for the interpreter's paths of _codes_word."""
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
def _scaled(words, scale):
    """The four bf16 of int64 words as fp32 times the tensor's scale: element c is column
    4j + c (little-endian), unpacked by one shift or mask (bf16 -> fp32 is exact); the fp32
    product is the reference's x * scale."""
    low = words.to(tl.int32)
    high = (words >> 32).to(tl.int32)
    return ((low << 16).to(tl.float32, bitcast=True) * scale,
            (low & -65536).to(tl.float32, bitcast=True) * scale,
            (high << 16).to(tl.float32, bitcast=True) * scale,
            (high & -65536).to(tl.float32, bitcast=True) * scale)


@jit
def _magnitudes(words, MAX_U16X2: tl.constexpr):
    """|x| of the four bf16 of int64 words as two 16-bit halves of one int32, halfwise maximum:
    with the sign bits cleared, bf16 patterns order like their magnitudes with every NaN above
    inf, so this keeps torch.amax's NaN propagation."""
    return _halfwise_max(words.to(tl.int32) & 0x7FFF7FFF, (words >> 32).to(tl.int32) & 0x7FFF7FFF,
                         MAX_U16X2)


@jit
def _u16x2_combine(a, b):
    return _max_u16x2(a, b)


@jit
def _halves_combine(a, b):
    return _max_halves(a, b)


@jit
def _tile_amax_bits(w0, w1, w2, w3, MAX_U16X2: tl.constexpr):
    """max|x| over the tile as fp32 bits (int32): bf16 magnitude << 16, exact; NaN stays NaN
    (the bits abs_bits gives for the same element)."""
    pairs = _halfwise_max(_halfwise_max(_magnitudes(w0, MAX_U16X2), _magnitudes(w1, MAX_U16X2),
                                        MAX_U16X2),
                          _halfwise_max(_magnitudes(w2, MAX_U16X2), _magnitudes(w3, MAX_U16X2),
                                        MAX_U16X2), MAX_U16X2)
    if MAX_U16X2:
        pairs = tl.reduce(pairs, None, _u16x2_combine)
    else:
        pairs = tl.reduce(pairs, None, _halves_combine)
    return tl.maximum(pairs & 0xFFFF, pairs >> 16) << 16


@jit
def _load_slice(x_ptr, origin, rows, cols, r, rows_left, cols_left, k_words,
                MASK_M: tl.constexpr, MASK_K: tl.constexpr, VOLATILE: tl.constexpr = False):
    """Row slice r of the tile: int64 words of rows 4i + r, columns j (in words)."""
    offsets = (rows * 4 + r)[:, None] * k_words + cols[None, :]
    if MASK_M or MASK_K:
        mask = ((rows * 4 + r) < rows_left)[:, None] & (cols < cols_left)[None, :]
        words = tl.load(x_ptr + origin + offsets, mask=mask, other=0, volatile=VOLATILE)
    else:
        words = tl.load(x_ptr + origin + offsets, volatile=VOLATILE)
    return words


@jit
def _store_row_slice(data_ptr, origin, rows, cols, r, rows_left, cols_left, k_words, word,
                     MASK_M: tl.constexpr, MASK_K: tl.constexpr):
    """Rowwise words of row slice r (int32 view of data [M, K / 4])."""
    offsets = (rows * 4 + r)[:, None] * k_words + cols[None, :]
    if MASK_M or MASK_K:
        mask = ((rows * 4 + r) < rows_left)[:, None] & (cols < cols_left)[None, :]
        tl.store(data_ptr + origin + offsets, word, mask=mask)
    else:
        tl.store(data_ptr + origin + offsets, word)


@jit
def per_tensor_words_tile(x_ptr, data_ptr, data_t_ptr, amax_bits_ptr, scale, nan_possible, M, K,
                          pid_m, pid_k, E5M2: tl.constexpr, ROWWISE: tl.constexpr,
                          COLUMNWISE: tl.constexpr, RECORD_AMAX: tl.constexpr,
                          CHECK_NAN: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_K: tl.constexpr, HW_CAST: tl.constexpr,
                          PRODUCTS: tl.constexpr, MAX_U16X2: tl.constexpr,
                          MASK_M: tl.constexpr, MASK_K: tl.constexpr):
    """Tile (pid_m, pid_k) of a bf16 [M, K] tensor (x_ptr: int64 view [M, K / 4]) cast with one
    fp32 `scale`: rowwise words to data_ptr (int32 view [M, K / 4]), transposed words to
    data_t_ptr (int32 view [K, M / 4]; M % 4 == 0 when COLUMNWISE).

    RECORD_AMAX: fold the tile's max|x| into the int32 bits at amax_bits_ptr (delayed scaling).
    CHECK_NAN: derive from that amax whether the tile holds a NaN; otherwise `nan_possible`
    (a scalar from the caller) decides alone whether NaN bytes get the fix-up. Under the
    interpreter without PRODUCTS the integer rounding gives the NaN rule itself.

    In-tile offsets are 32-bit words (BLOCK_M * K / 4 and BLOCK_K * M / 4 < 2^31 are checked
    by the host), the tile origin 64-bit.
    """
    SLICE_M: tl.constexpr = BLOCK_M // 4
    WORDS_K: tl.constexpr = BLOCK_K // 4
    k_words = K // 4
    row0 = pid_m.to(tl.int64) * BLOCK_M
    col0 = pid_k.to(tl.int64) * BLOCK_K
    rows_left = tl.minimum(M - row0, BLOCK_M).to(tl.int32)
    cols_left = tl.minimum(k_words - col0 // 4, WORDS_K).to(tl.int32)
    rows = tl.arange(0, SLICE_M)
    cols = tl.arange(0, WORDS_K)
    origin = row0 * k_words + col0 // 4
    w0 = _load_slice(x_ptr, origin, rows, cols, 0, rows_left, cols_left, k_words, MASK_M, MASK_K)
    w1 = _load_slice(x_ptr, origin, rows, cols, 1, rows_left, cols_left, k_words, MASK_M, MASK_K)
    w2 = _load_slice(x_ptr, origin, rows, cols, 2, rows_left, cols_left, k_words, MASK_M, MASK_K)
    w3 = _load_slice(x_ptr, origin, rows, cols, 3, rows_left, cols_left, k_words, MASK_M, MASK_K)
    if RECORD_AMAX or CHECK_NAN:
        tile_amax = _tile_amax_bits(w0, w1, w2, w3, MAX_U16X2)
        if RECORD_AMAX:
            tl.atomic_max(amax_bits_ptr, tile_amax)
        if CHECK_NAN:
            nan_possible = nan_possible | (tile_amax > 0x7F800000)
    if HW_CAST or PRODUCTS:
        # Two copies of the cast; the rare one re-reads the tile (volatile loads, from L2) for
        # each copy separately. When the branches share the products and codes, the compiler
        # computes them before the branch and keeps the fix-up's operands live in every tile
        # (211 registers instead of 96 at 64 x 128, 4 warps; 148 with one re-read for both).
        if nan_possible:
            if ROWWISE:
                _reload_cast_and_store(x_ptr, origin, rows, cols, rows_left, cols_left, k_words,
                                       scale, data_ptr, data_t_ptr, M, K, row0, col0, E5M2,
                                       True, False, BLOCK_M, BLOCK_K, HW_CAST, PRODUCTS,
                                       MASK_M, MASK_K)
            if COLUMNWISE:
                _reload_cast_and_store(x_ptr, origin, rows, cols, rows_left, cols_left, k_words,
                                       scale, data_ptr, data_t_ptr, M, K, row0, col0, E5M2,
                                       False, True, BLOCK_M, BLOCK_K, HW_CAST, PRODUCTS,
                                       MASK_M, MASK_K)
        else:
            _cast_and_store(w0, w1, w2, w3, scale, data_ptr, data_t_ptr, M, K, row0, col0,
                            rows_left, cols_left, E5M2, ROWWISE, COLUMNWISE, BLOCK_M, BLOCK_K,
                            HW_CAST, PRODUCTS, False, MASK_M, MASK_K)
    else:  # integer rounding: the NaN rule is built in
        _cast_and_store(w0, w1, w2, w3, scale, data_ptr, data_t_ptr, M, K, row0, col0,
                        rows_left, cols_left, E5M2, ROWWISE, COLUMNWISE, BLOCK_M, BLOCK_K,
                        HW_CAST, PRODUCTS, False, MASK_M, MASK_K)


@jit
def _reload_cast_and_store(x_ptr, origin, rows, cols, rows_left, cols_left, k_words, scale,
                           data_ptr, data_t_ptr, M, K, row0, col0, E5M2: tl.constexpr,
                           ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HW_CAST: tl.constexpr,
                           PRODUCTS: tl.constexpr, MASK_M: tl.constexpr, MASK_K: tl.constexpr):
    """_cast_and_store with the NaN fix-up, on the tile loaded again (tiles that may hold NaN)."""
    v0 = _load_slice(x_ptr, origin, rows, cols, 0, rows_left, cols_left, k_words, MASK_M,
                     MASK_K, True)
    v1 = _load_slice(x_ptr, origin, rows, cols, 1, rows_left, cols_left, k_words, MASK_M,
                     MASK_K, True)
    v2 = _load_slice(x_ptr, origin, rows, cols, 2, rows_left, cols_left, k_words, MASK_M,
                     MASK_K, True)
    v3 = _load_slice(x_ptr, origin, rows, cols, 3, rows_left, cols_left, k_words, MASK_M,
                     MASK_K, True)
    _cast_and_store(v0, v1, v2, v3, scale, data_ptr, data_t_ptr, M, K, row0, col0, rows_left,
                    cols_left, E5M2, ROWWISE, COLUMNWISE, BLOCK_M, BLOCK_K, HW_CAST, PRODUCTS,
                    True, MASK_M, MASK_K)


@jit
def _cast_and_store(w0, w1, w2, w3, scale, data_ptr, data_t_ptr, M, K, row0, col0, rows_left,
                    cols_left, E5M2: tl.constexpr, ROWWISE: tl.constexpr,
                    COLUMNWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    HW_CAST: tl.constexpr, PRODUCTS: tl.constexpr, FIX_NAN: tl.constexpr,
                    MASK_M: tl.constexpr, MASK_K: tl.constexpr):
    """Cast the four row slices w0..w3 (int64 words) and store the copies asked for; FIX_NAN
    rewrites NaN bytes to the contract's (tiles that may hold a NaN)."""
    SLICE_M: tl.constexpr = BLOCK_M // 4
    WORDS_K: tl.constexpr = BLOCK_K // 4
    k_words = K // 4
    rows = tl.arange(0, SLICE_M)
    cols = tl.arange(0, WORDS_K)
    # y_rc: component c (column 4j + c) of slice r (row 4i + r)
    y00, y01, y02, y03 = _scaled(w0, scale)
    y10, y11, y12, y13 = _scaled(w1, scale)
    y20, y21, y22, y23 = _scaled(w2, scale)
    y30, y31, y32, y33 = _scaled(w3, scale)
    if ROWWISE:
        r0 = _codes_word(y00, y01, y02, y03, E5M2, HW_CAST, PRODUCTS)
        r1 = _codes_word(y10, y11, y12, y13, E5M2, HW_CAST, PRODUCTS)
        r2 = _codes_word(y20, y21, y22, y23, E5M2, HW_CAST, PRODUCTS)
        r3 = _codes_word(y30, y31, y32, y33, E5M2, HW_CAST, PRODUCTS)
        if FIX_NAN:
            r0 = _nan_fixed(r0, y00, y01, y02, y03)
            r1 = _nan_fixed(r1, y10, y11, y12, y13)
            r2 = _nan_fixed(r2, y20, y21, y22, y23)
            r3 = _nan_fixed(r3, y30, y31, y32, y33)
        origin = row0 * k_words + col0 // 4
        _store_row_slice(data_ptr, origin, rows, cols, 0, rows_left, cols_left, k_words, r0,
                         MASK_M, MASK_K)
        _store_row_slice(data_ptr, origin, rows, cols, 1, rows_left, cols_left, k_words, r1,
                         MASK_M, MASK_K)
        _store_row_slice(data_ptr, origin, rows, cols, 2, rows_left, cols_left, k_words, r2,
                         MASK_M, MASK_K)
        _store_row_slice(data_ptr, origin, rows, cols, 3, rows_left, cols_left, k_words, r3,
                         MASK_M, MASK_K)
    if COLUMNWISE:
        c0 = _codes_word(y00, y10, y20, y30, E5M2, HW_CAST, PRODUCTS)
        c1 = _codes_word(y01, y11, y21, y31, E5M2, HW_CAST, PRODUCTS)
        c2 = _codes_word(y02, y12, y22, y32, E5M2, HW_CAST, PRODUCTS)
        c3 = _codes_word(y03, y13, y23, y33, E5M2, HW_CAST, PRODUCTS)
        if FIX_NAN:
            c0 = _nan_fixed(c0, y00, y10, y20, y30)
            c1 = _nan_fixed(c1, y01, y11, y21, y31)
            c2 = _nan_fixed(c2, y02, y12, y22, y32)
            c3 = _nan_fixed(c3, y03, y13, y23, y33)
        # [SLICE_M, WORDS_K, 4] with column 4j + c last, as [SLICE_M, BLOCK_K]: join(a, b)
        # stacks on a new last axis, so the nested joins index c = 2p + q
        words = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [SLICE_M, BLOCK_K])
        m_words = M // 4
        kk = tl.arange(0, BLOCK_K)
        offsets = kk[:, None] * m_words + rows[None, :]
        origin_t = col0 * m_words + row0 // 4
        if MASK_M or MASK_K:
            mask = (kk < cols_left * 4)[:, None] & (rows * 4 < rows_left)[None, :]
            tl.store(data_t_ptr + origin_t + offsets, tl.trans(words), mask=mask)
        else:
            tl.store(data_t_ptr + origin_t + offsets, tl.trans(words))


@jit
def per_tensor_words_kernel(x_ptr, data_ptr, data_t_ptr, scale_ptr, amax_ptr, scale_inv_ptr, eps,
                            M, K, partial_count, E5M2: tl.constexpr, CURRENT: tl.constexpr,
                            POW2: tl.constexpr, ROWWISE: tl.constexpr,
                            COLUMNWISE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_K: tl.constexpr, HW_CAST: tl.constexpr,
                            PRODUCTS: tl.constexpr, MAX_U16X2: tl.constexpr,
                            MASK_M: tl.constexpr, MASK_K: tl.constexpr,
                            PARTIALS_BLOCK: tl.constexpr):
    """per_tensor_fp8._cast_transpose_kernel for bf16 in words: the same arguments and scale
    logic (x_ptr, data_ptr, data_t_ptr are the int64 / int32 views), the same bytes."""
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    pid_m = pid // tiles_k
    pid_k = pid % tiles_k
    if CURRENT:
        amax, scale = current_scale(amax_ptr, partial_count, eps, E5M2, POW2, PARTIALS_BLOCK)
    else:
        scale = tl.load(scale_ptr)
    # a NaN product needs a NaN input, or a zero, infinite or NaN scale (0 * inf)
    scale_mag = scale.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    nan_possible = (scale_mag == 0) | (scale_mag >= 0x7F800000)
    if CURRENT and PARTIALS_BLOCK > 0:
        # the partial maxima are this tensor's: its amax is NaN exactly when it holds a NaN
        nan_possible = nan_possible | ((amax.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
                                       > 0x7F800000)
        per_tensor_words_tile(x_ptr, data_ptr, data_t_ptr, amax_ptr, scale, nan_possible, M, K,
                              pid_m, pid_k, E5M2, ROWWISE, COLUMNWISE, False, False, BLOCK_M,
                              BLOCK_K, HW_CAST, PRODUCTS, MAX_U16X2, MASK_M, MASK_K)
    elif CURRENT:  # a given amax says nothing about this tensor's NaNs: check the tile
        per_tensor_words_tile(x_ptr, data_ptr, data_t_ptr, amax_ptr, scale, nan_possible, M, K,
                              pid_m, pid_k, E5M2, ROWWISE, COLUMNWISE, False,
                              HW_CAST or PRODUCTS, BLOCK_M, BLOCK_K, HW_CAST, PRODUCTS,
                              MAX_U16X2, MASK_M, MASK_K)
    else:
        per_tensor_words_tile(x_ptr, data_ptr, data_t_ptr, amax_ptr, scale, nan_possible, M, K,
                              pid_m, pid_k, E5M2, ROWWISE, COLUMNWISE, True, True, BLOCK_M,
                              BLOCK_K, HW_CAST, PRODUCTS, MAX_U16X2, MASK_M, MASK_K)
    if pid == 0:
        tl.store(scale_inv_ptr, reciprocal_rn(scale))
