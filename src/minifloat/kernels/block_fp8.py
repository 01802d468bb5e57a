"""FP8 block-scaling kernels, DeepSeek style (NUMERICS.md §4): E4M3 elements, 128-long blocks.

Layouts follow numerics/block_fp8.py exactly (compact scale grids, partial edge blocks scaled by
the amax of the elements that exist):
- 1D rowwise: data [M, K], scale_inv [M, ceil(K/128)] (1x128 runs along K);
- 1D columnwise: data [K, M], scale_inv [K, ceil(M/128)] (x^T in 1x128 runs along M);
- 2D: data [M, K], scale_inv [ceil(M/128), ceil(K/128)]; its columnwise copy is the exact
  transpose of both (data [K, M], scale_inv [ceil(K/128), ceil(M/128)]).

Each program owns one aligned 128x128 tile of the [M, K] view, which holds whole blocks of both
directions, so one program writes both copies and the input crosses HBM once: the 1D kernel
takes row maxima (rowwise blocks) and column maxima (columnwise blocks) from the same loads; the
2D kernel takes the tile maximum and stores data and transpose. The 1D tile is swept in 32-row
chunks to bound registers: each chunk completes its rowwise blocks, and the columnwise copy,
whose scales need the whole tile, comes from a second sweep that re-reads the tile from cache.
The 2D kernel holds its whole tile in registers (8 warps). Scales follow numerics.scale_from_amax
with the input dtype's max as the overflow value (power-of-2 scales by default, computed from
exponent bits without a division; see pow2_scale).
"""

from __future__ import annotations

import torch

from .fp8_common import (
    abs_bits,
    cdiv,
    dtype_max_bits,
    float32_value,
    fp8_codes,
    hw_cast,
    jit,
    kernel_input,
    needs_wide_offsets,
    reciprocal_rn,
    scale_from_amax,
    tile_offsets,
    tl,
)
from .launch import launch

BLOCK = 128
# Launch constants, swept on an H100 with the hardware cast (benchmarks/KERNEL_NOTES.md, v2).
# CHUNK: rows or columns per sweep step (bounds registers, see _tile_1d; CHUNK == BLOCK holds
# the whole tile). The multi-tensor kernel sweeps block_1d_tile with CHUNK.
CHUNK = 32
# 1D tiles that write both copies: ROWS_FIRST_1D sweeps [CHUNK_1D, 128] row chunks (rowwise
# blocks complete, cast and stored at once, column maxima kept elementwise), then the columnwise
# copy from a second sweep of [CAST_CHUNK_1D, 128] chunks (from cache); otherwise the older
# order (column chunks, then the rowwise copy from cache), or with CHUNK_1D = 128 the whole
# tile in registers. 16384x8192 bf16: rows-first 32/32 w4 0.282 ms, 32/64 0.282, 64/64 0.287;
# whole tile w8 0.295; column chunks 64 w4 0.341 (all with the division-free scales).
# v3 (packed E4M3 conversion, _e4m3): 32/64 w4 predicted from SASS (KERNEL_NOTES.md, v3).
# WORDS_1D (rows-first, M % 4 == 0): the transposed copy as int32 words from four row slices
# (_columnwise_words) instead of a byte transpose; a variant to time, not the default (its
# word stores compile to 4-byte STG, the byte path's to 16-byte).
ROWS_FIRST_1D, CHUNK_1D, CAST_CHUNK_1D, NUM_WARPS_1D = True, 32, 64, 4
WORDS_1D = False
# 2D: whole tile in registers with 8 warps 0.201 ms; 64-row chunks 0.235; whole tile w4 0.254.
CHUNK_2D, NUM_WARPS_2D = 128, 8
# WORDS (v4): bf16 inputs with M, K % 4 == 0 take block_fp8_words._block_words_kernel (int64
# words of four bf16 in, int32 words of four codes out in both directions, one load of the tile,
# halfwise maxima; KERNEL_NOTES.md "block FP8 words"); WORDS_NUM_WARPS_1D / _2D its warps.
# Other inputs (and WORDS = False) take the element kernels above.
WORDS = True
WORDS_NUM_WARPS_1D, WORDS_NUM_WARPS_2D = 4, 4
# WORDS_APART_1D: the words kernel's 1x128 transposed copy unpacks the bf16 words again instead
# of reusing the rowwise copy's fp32 (fewer live registers, more instructions; KERNEL_NOTES.md
# "block FP8 words", 1x128 registers). A variant to time, not the default.
WORDS_APART_1D = False
# Four fp32 ($1..$4) to four E4M3 codes in one word ($0, $1's code in the low byte); see _e4m3.
_E4M3_ASM = ("{ .reg .b16 lo, hi; .reg .b32 c, s, t; "
             "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
             "mov.b32 c, {lo, hi}; prmt.b32 s, $1, $2, 0x0073; prmt.b32 t, $3, $4, 0x7300; "
             "prmt.b32 s, s, t, 0x7610; lop3.b32 $0, c, s, 0x80808080, 0xD8; }")
_E4M3_ASM = _E4M3_ASM if tl is None else tl.constexpr(_E4M3_ASM)
ScaledCopies = tuple[
    torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None
]


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


@jit
def _e4m3(y, HW_CAST: tl.constexpr):
    """E4M3 codes of fp32 y, the sat_rne_fp8 contract (NaN -> 0x7F | sign of y).

    The hardware path does the NaN fix-up inside the conversion's asm, on four packed codes at
    a time: cvt.rn.satfinite gives every non-NaN y its code with the sign of y already, and a NaN
    a code whose low seven bits are 0x7F (E4M3 has no other NaN), so copying each y's sign bit
    into bit 7 of its byte gives exactly fp8_codes' bytes (three byte permutes and one bit
    select per four codes, where the elementwise fix-up cost about six operations per code
    and unpacked the four codes to bytes and back)."""
    if HW_CAST:
        codes = tl.inline_asm_elementwise(_E4M3_ASM, "=r,r,r,r,r", [y], dtype=tl.uint8,
                                          is_pure=True, pack=4)
    else:
        codes = fp8_codes(y, False, False)
    return codes


@jit
def _e4m3_word(y0, y1, y2, y3, HW_CAST: tl.constexpr):
    """E4M3 codes of y0..y3 packed little-endian into one int32 (y0 in the low byte), the
    contract of _e4m3: the same asm with the four values from four tensors."""
    if HW_CAST:
        word = tl.inline_asm_elementwise(_E4M3_ASM, "=r,r,r,r,r", [y0, y1, y2, y3],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        word = (_e4m3(y0, False).to(tl.int32) | (_e4m3(y1, False).to(tl.int32) << 8)
                | (_e4m3(y2, False).to(tl.int32) << 16) | (_e4m3(y3, False).to(tl.int32) << 24))
    return word


@jit
def _columnwise_words(x_tile, col_data_ptr, scale, row0, col0, rows_left, cols_left, M, K,
                      BLOCK: tl.constexpr, CAST_CHUNK: tl.constexpr, WIDE: tl.constexpr,
                      HW_CAST: tl.constexpr, WORDS: tl.constexpr):
    """The transposed copy of a tile as int32 words (M % 4 == 0): each chunk is loaded as four
    row slices (slice j = rows 4i + j), so the four codes of rows 4i..4i+3 of a column sit in
    one thread and one conversion packs them in the transposed byte order; only words cross
    shared memory in Triton's layout conversion for the store, never single bytes. A partial
    tile ends on a multiple of 4 rows, so words are whole. WORDS > 1: M % 16 == 0 (hints)."""
    QUARTER: tl.constexpr = CAST_CHUNK // 4
    tile = tl.arange(0, BLOCK)
    quads = tl.arange(0, QUARTER)
    stride = M // 4
    if WORDS > 1:  # the host found M % 16 == 0: 16-byte aligned rows of words
        stride = tl.multiple_of(stride, WORDS)
    words_tile = col_data_ptr.to(tl.pointer_type(tl.int32)) + col0 * stride + row0 // 4
    if WORDS > 1:  # the pointer cast drops the alignment Triton knew of col_data_ptr
        words_tile = tl.multiple_of(words_tile, 16)
    for r in range(BLOCK // CAST_CHUNK):
        rows = r * CAST_CHUNK + 4 * quads
        x0, _ = _load_chunk(x_tile, rows, tile, rows_left, cols_left, K, WIDE)
        x1, _ = _load_chunk(x_tile, rows + 1, tile, rows_left, cols_left, K, WIDE)
        x2, _ = _load_chunk(x_tile, rows + 2, tile, rows_left, cols_left, K, WIDE)
        x3, _ = _load_chunk(x_tile, rows + 3, tile, rows_left, cols_left, K, WIDE)
        s = scale[None, :]
        words = _e4m3_word(x0 * s, x1 * s, x2 * s, x3 * s, HW_CAST)
        wq = r * QUARTER + quads
        mask_w = (4 * wq[:, None] < rows_left) & (tile[None, :] < cols_left)
        if WIDE:
            offsets = wq.to(tl.int64)[:, None] + tile.to(tl.int64)[None, :] * stride
        else:
            offsets = wq[:, None] + tile[None, :] * stride
        # stored from its [quads, columns] shape; Triton converts the layout for the
        # quads-contiguous store (on sm_90 it still emits 4-byte stores, see KERNEL_NOTES v3)
        tl.store(words_tile + offsets, words, mask=mask_w)


@jit
def _load_chunk(x_tile, rows, cols, rows_left, cols_left, K, WIDE: tl.constexpr):
    """Tile-local x[rows, cols] as fp32 (zeros past the tensor's edge) and its mask."""
    mask = (rows[:, None] < rows_left) & (cols[None, :] < cols_left)
    x = tl.load(x_tile + tile_offsets(rows, cols, K, WIDE), mask=mask, other=0.0)
    return x.to(tl.float32), mask


@jit
def _store_columnwise(data_t_tile, codes, rows, cols, rows_left, cols_left, M,
                      WIDE: tl.constexpr):
    """codes[rows, cols] into the transposed [K, M] layout (a register transpose first, so the
    store runs along M and stays coalesced)."""
    mask_t = (cols[:, None] < cols_left) & (rows[None, :] < rows_left)
    tl.store(data_t_tile + tile_offsets(cols, rows, M, WIDE), tl.trans(codes), mask=mask_t)


@jit
def block_1d_tile(x_ptr, row_data_ptr, row_si_ptr, col_data_ptr, col_si_ptr, eps, M, K, pid_m,
                  pid_k, POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr, ROWWISE: tl.constexpr,
                  COLUMNWISE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                  WIDE: tl.constexpr, HW_CAST: tl.constexpr):
    """Quantize tile (pid_m, pid_k) of a row-major [M, K] tensor in 1x128 blocks along K
    (ROWWISE) and along M into the transposed layout (COLUMNWISE): the multi-tensor kernel's
    entry, the rows-first order (see _tile_1d) with CHUNK-row chunks in both sweeps."""
    _tile_1d(x_ptr, row_data_ptr, row_si_ptr, col_data_ptr, col_si_ptr, eps, M, K, pid_m, pid_k,
             POW2, OVERFLOW_BITS, ROWWISE, COLUMNWISE, BLOCK, CHUNK, CHUNK, True, WIDE, HW_CAST,
             False)


@jit
def _tile_1d(x_ptr, row_data_ptr, row_si_ptr, col_data_ptr, col_si_ptr, eps, M, K, pid_m,
             pid_k, POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr, ROWWISE: tl.constexpr,
             COLUMNWISE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
             CAST_CHUNK: tl.constexpr, ROWS_FIRST: tl.constexpr, WIDE: tl.constexpr,
             HW_CAST: tl.constexpr, WORDS: tl.constexpr):
    """One 128x128 tile of the 1D quantization.

    The tile is walked in chunks to bound register use (a whole 128x128 fp32 tile held across a
    reduction spills). A [CHUNK, BLOCK] row chunk holds whole rowwise blocks, a [BLOCK, CHUNK]
    column chunk whole columnwise blocks, so one direction alone is a single sweep. Both
    directions need a second sweep over the same tile, read back from cache rather than HBM:
    - ROWS_FIRST: row chunks write the rowwise copy at once and fold their magnitudes into an
      elementwise running maximum (no cross-thread reduction per chunk); one reduction of it
      gives the column scales, and a sweep of [CAST_CHUNK, BLOCK] row chunks writes the
      transposed copy;
    - otherwise: column chunks write the columnwise copy and gather row maxima, and a second
      sweep writes the rowwise copy.
    """
    row0 = pid_m.to(tl.int64) * BLOCK
    col0 = pid_k.to(tl.int64) * BLOCK
    # clamped to the tile and narrowed: the masks compare in-tile indices in 32 bits
    rows_left = tl.minimum(M - row0, BLOCK).to(tl.int32)
    cols_left = tl.minimum(K - col0, BLOCK).to(tl.int32)
    x_tile = x_ptr + row0 * K + col0
    row_tile = row_data_ptr + row0 * K + col0
    col_tile = col_data_ptr + col0 * M + row0
    tile = tl.arange(0, BLOCK)
    chunk = tl.arange(0, CHUNK)
    k_blocks = tl.cdiv(K, BLOCK)
    m_blocks = tl.cdiv(M, BLOCK)
    if ROWWISE and COLUMNWISE and ROWS_FIRST:
        running = tl.zeros([CHUNK, BLOCK], dtype=tl.int32)
        for r in range(BLOCK // CHUNK):
            rows = r * CHUNK + chunk
            x, mask = _load_chunk(x_tile, rows, tile, rows_left, cols_left, K, WIDE)
            magnitude = abs_bits(x)  # zero padding cannot raise an amax; NaN dominates
            running = tl.maximum(running, magnitude)
            scale = _scale(tl.max(magnitude, axis=1), eps, POW2, OVERFLOW_BITS)
            tl.store(row_tile + tile_offsets(rows, tile, K, WIDE),
                     _e4m3(x * scale[:, None], HW_CAST), mask=mask)
            tl.store(row_si_ptr + (row0 + rows) * k_blocks + pid_k, _scale_inv(scale, POW2),
                     mask=rows < rows_left)
        scale = _scale(tl.max(running, axis=0), eps, POW2, OVERFLOW_BITS)
        tl.store(col_si_ptr + (col0 + tile) * m_blocks + pid_m, _scale_inv(scale, POW2),
                 mask=tile < cols_left)
        if WORDS:
            _columnwise_words(x_tile, col_data_ptr, scale, row0, col0, rows_left, cols_left, M,
                              K, BLOCK, CAST_CHUNK, WIDE, HW_CAST, WORDS)
        else:
            for r in range(BLOCK // CAST_CHUNK):
                rows = r * CAST_CHUNK + tl.arange(0, CAST_CHUNK)
                x, mask = _load_chunk(x_tile, rows, tile, rows_left, cols_left, K, WIDE)
                _store_columnwise(col_tile, _e4m3(x * scale[None, :], HW_CAST), rows,
                                  tile, rows_left, cols_left, M, WIDE)
    elif CHUNK == BLOCK:
        # whole tile in registers: one load, both maxima, both casts (no re-read)
        x, mask = _load_chunk(x_tile, tile, tile, rows_left, cols_left, K, WIDE)
        magnitude = abs_bits(x)
        if ROWWISE:
            scale = _scale(tl.max(magnitude, axis=1), eps, POW2, OVERFLOW_BITS)
            tl.store(row_tile + tile_offsets(tile, tile, K, WIDE),
                     _e4m3(x * scale[:, None], HW_CAST), mask=mask)
            tl.store(row_si_ptr + (row0 + tile) * k_blocks + pid_k, _scale_inv(scale, POW2),
                     mask=tile < rows_left)
        if COLUMNWISE:
            scale = _scale(tl.max(magnitude, axis=0), eps, POW2, OVERFLOW_BITS)
            _store_columnwise(col_tile, _e4m3(x * scale[None, :], HW_CAST), tile,
                              tile, rows_left, cols_left, M, WIDE)
            tl.store(col_si_ptr + (col0 + tile) * m_blocks + pid_m, _scale_inv(scale, POW2),
                     mask=tile < cols_left)
    elif COLUMNWISE:
        row_amax = tl.zeros([BLOCK], dtype=tl.int32)
        for c in range(BLOCK // CHUNK):
            cols = c * CHUNK + chunk
            x, mask = _load_chunk(x_tile, tile, cols, rows_left, cols_left, K, WIDE)
            magnitude = abs_bits(x)
            if ROWWISE:
                row_amax = tl.maximum(row_amax, tl.max(magnitude, axis=1))
            scale = _scale(tl.max(magnitude, axis=0), eps, POW2, OVERFLOW_BITS)
            _store_columnwise(col_tile, _e4m3(x * scale[None, :], HW_CAST), tile, cols,
                              rows_left, cols_left, M, WIDE)
            tl.store(col_si_ptr + (col0 + cols) * m_blocks + pid_m, _scale_inv(scale, POW2),
                     mask=cols < cols_left)
        if ROWWISE:
            scale = _scale(row_amax, eps, POW2, OVERFLOW_BITS)
            for c in range(BLOCK // CHUNK):
                cols = c * CHUNK + chunk
                x, mask = _load_chunk(x_tile, tile, cols, rows_left, cols_left, K, WIDE)
                tl.store(row_tile + tile_offsets(tile, cols, K, WIDE),
                         _e4m3(x * scale[:, None], HW_CAST), mask=mask)
            tl.store(row_si_ptr + (row0 + tile) * k_blocks + pid_k, _scale_inv(scale, POW2),
                     mask=tile < rows_left)
    else:
        for r in range(BLOCK // CHUNK):
            rows = r * CHUNK + chunk
            x, mask = _load_chunk(x_tile, rows, tile, rows_left, cols_left, K, WIDE)
            scale = _scale(tl.max(abs_bits(x), axis=1), eps, POW2, OVERFLOW_BITS)
            tl.store(row_tile + tile_offsets(rows, tile, K, WIDE),
                     _e4m3(x * scale[:, None], HW_CAST), mask=mask)
            tl.store(row_si_ptr + (row0 + rows) * k_blocks + pid_k, _scale_inv(scale, POW2),
                     mask=rows < rows_left)


@jit
def _block_1d_kernel(x_ptr, row_data_ptr, row_si_ptr, col_data_ptr, col_si_ptr, eps, M, K,
                     POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr, ROWWISE: tl.constexpr,
                     COLUMNWISE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                     CAST_CHUNK: tl.constexpr, ROWS_FIRST: tl.constexpr, WIDE: tl.constexpr,
                     HW_CAST: tl.constexpr, WORDS: tl.constexpr):
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK)
    _tile_1d(x_ptr, row_data_ptr, row_si_ptr, col_data_ptr, col_si_ptr, eps, M, K,
             pid // tiles_k, pid % tiles_k, POW2, OVERFLOW_BITS, ROWWISE, COLUMNWISE, BLOCK,
             CHUNK, CAST_CHUNK, ROWS_FIRST, WIDE, HW_CAST, WORDS)


@jit
def _block_2d_kernel(x_ptr, row_data_ptr, row_si_ptr, col_data_ptr, col_si_ptr, eps, M, K,
                     POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr, ROWWISE: tl.constexpr,
                     COLUMNWISE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                     WIDE: tl.constexpr, HW_CAST: tl.constexpr):
    """One scale per 128x128 tile: a sweep for the tile amax, a second (from cache) to cast;
    with CHUNK == BLOCK the whole tile is held in registers (one load)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK)
    tiles_k = tl.cdiv(K, BLOCK)
    pid_m = pid // tiles_k
    pid_k = pid % tiles_k
    row0 = pid_m.to(tl.int64) * BLOCK
    col0 = pid_k.to(tl.int64) * BLOCK
    rows_left = M - row0
    cols_left = K - col0
    x_tile = x_ptr + row0 * K + col0
    row_tile = row_data_ptr + row0 * K + col0
    col_tile = col_data_ptr + col0 * M + row0
    tile = tl.arange(0, BLOCK)
    chunk = tl.arange(0, CHUNK)
    if CHUNK == BLOCK:
        x, mask = _load_chunk(x_tile, tile, tile, rows_left, cols_left, K, WIDE)
        amax = tl.max(tl.max(abs_bits(x), axis=1), axis=0)
        scale = _scale(amax, eps, POW2, OVERFLOW_BITS)
        codes = fp8_codes(x * scale, False, HW_CAST)
        if ROWWISE:
            tl.store(row_tile + tile_offsets(tile, tile, K, WIDE), codes, mask=mask)
        if COLUMNWISE:
            _store_columnwise(col_tile, codes, tile, tile, rows_left, cols_left, M, WIDE)
    else:
        running = tl.zeros([CHUNK, BLOCK], dtype=tl.int32)
        for r in range(BLOCK // CHUNK):
            x, mask = _load_chunk(x_tile, r * CHUNK + chunk, tile, rows_left, cols_left, K, WIDE)
            running = tl.maximum(running, abs_bits(x))
        scale = _scale(tl.max(tl.max(running, axis=1), axis=0), eps, POW2, OVERFLOW_BITS)
        for r in range(BLOCK // CHUNK):
            rows = r * CHUNK + chunk
            x, mask = _load_chunk(x_tile, rows, tile, rows_left, cols_left, K, WIDE)
            codes = fp8_codes(x * scale, False, HW_CAST)
            if ROWWISE:
                tl.store(row_tile + tile_offsets(rows, tile, K, WIDE), codes, mask=mask)
            if COLUMNWISE:
                _store_columnwise(col_tile, codes, rows, tile, rows_left, cols_left, M, WIDE)
    scale_inv = _scale_inv(scale, POW2)
    if ROWWISE:
        tl.store(row_si_ptr + pid_m * tiles_k + pid_k, scale_inv)
    if COLUMNWISE:
        tl.store(col_si_ptr + pid_k * tiles_m + pid_m, scale_inv)


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


def _launch(kernel, x: torch.Tensor, row_grid: tuple[int, int], col_grid: tuple[int, int], *,
            rowwise: bool, columnwise: bool, power_2_scale: bool, amax_epsilon: float,
            chunk: int, num_warps: int, words_warps: int, **constexprs) -> ScaledCopies:
    m, k = _check(x, rowwise, columnwise)
    device = x.device

    def buffers(wanted: bool, data_shape: tuple[int, int], grid_shape: tuple[int, int]):
        if not wanted:
            return None, None
        return (torch.empty(data_shape, dtype=torch.uint8, device=device),
                torch.empty(grid_shape, dtype=torch.float32, device=device))

    row_data, row_si = buffers(rowwise, (m, k), row_grid)
    col_data, col_si = buffers(columnwise, (k, m), col_grid)
    present = next(t for t in (row_data, col_data) if t is not None)
    present_si = row_si if row_si is not None else col_si
    wide = needs_wide_offsets(m, k, BLOCK)
    x2d = x.view(m, k)
    if WORDS:
        from . import block_fp8_words  # imports this module: loaded on first use

        if block_fp8_words.takes_words(x2d, wide):
            block_fp8_words.launch_words(
                x2d, row_data if row_data is not None else present,
                row_si if row_si is not None else present_si,
                col_data if col_data is not None else present,
                col_si if col_si is not None else present_si, float32_value(amax_epsilon),
                tile_2d=kernel is _block_2d_kernel, rowwise=rowwise, columnwise=columnwise,
                power_2_scale=power_2_scale, overflow_bits=dtype_max_bits(x.dtype),
                num_warps=words_warps)
            return _views(row_data, row_si, col_data, col_si)
    grid = (cdiv(m, BLOCK) * cdiv(k, BLOCK),)
    launch(
        kernel,
        grid,
        x,
        row_data if row_data is not None else present,
        row_si if row_si is not None else present_si,
        col_data if col_data is not None else present,
        col_si if col_si is not None else present_si,
        float32_value(amax_epsilon),
        m,
        k,
        POW2=power_2_scale,
        OVERFLOW_BITS=dtype_max_bits(x.dtype),
        ROWWISE=rowwise,
        COLUMNWISE=columnwise,
        BLOCK=BLOCK,
        CHUNK=chunk,
        WIDE=wide,
        HW_CAST=hw_cast(x),
        num_warps=num_warps,
        **constexprs,
    )
    return _views(row_data, row_si, col_data, col_si)


def _views(row_data: torch.Tensor | None, row_si: torch.Tensor | None,
           col_data: torch.Tensor | None, col_si: torch.Tensor | None) -> ScaledCopies:
    """The uint8 data buffers as E4M3 tensors, with their scale grids."""
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
    numerics.quantize_block_1d and numerics.quantize_block_1d_columnwise.
    """
    m, k = _check(x, rowwise, columnwise)
    return _launch(_block_1d_kernel, x, (m, cdiv(k, BLOCK)), (k, cdiv(m, BLOCK)),
                   rowwise=rowwise, columnwise=columnwise, power_2_scale=power_2_scale,
                   amax_epsilon=amax_epsilon, chunk=CHUNK_1D, num_warps=NUM_WARPS_1D,
                   words_warps=WORDS_NUM_WARPS_1D,
                   CAST_CHUNK=CAST_CHUNK_1D, ROWS_FIRST=ROWS_FIRST_1D,
                   WORDS=(4 if m % 16 == 0 else 1) if WORDS_1D and m % 4 == 0 else 0)


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
    return _launch(_block_2d_kernel, x, (tiles_m, tiles_k), (tiles_k, tiles_m),
                   rowwise=rowwise, columnwise=columnwise, power_2_scale=power_2_scale,
                   amax_epsilon=amax_epsilon, chunk=CHUNK_2D, num_warps=NUM_WARPS_2D,
                   words_warps=WORDS_NUM_WARPS_2D)
