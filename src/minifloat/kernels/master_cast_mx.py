"""Partial master-weight casts of the microscaling formats, MXFP8 (1x32 and 32x1 blocks, E8M0
scales) and 2D NVFP4 (16x16 tiles and a global amax, UE4M3 scales): their maxima, scale and
cast kernels. master_cast.py holds the scheme (the plan's table, the maxima / all-reduce / cast
passes), the device functions every format shares, and the per-tensor and block FP8 kernels.

Why apart: these two formats write byte-coded scales of their own layouts and code their
elements with their own rules (E8M0 exponents and two copies for MXFP8; nibbles, a global scale
and a shared byte per element pair for NVFP4); the scheme around them is the same.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .element_cast import expand_blocks
from .fp8_common import abs_bits, cvt_sat_rne_fp8
from .master_cast import (
    _at,
    _full_offsets,
    _interior,
    _load_tile,
    _scale_run,
    _tile,
    _tile_range,
)
from .multi_tensor import _owner
from .mxfp8 import _e8m0, _fp8_codes, _hw_factors, _word_factor
from .nvfp4 import _e2m1_nibbles
from .nvfp4_scales import block_scales, global_scales
from .per_tensor_tile import codes_word

# ---- scales: every scale of every weight (master_cast.py: why each rank writes them all) ----


@triton.jit
def _mxfp8_scales_kernel(bytes_base, exponents, table_ptr, starts_ptr, n,
                         STEPS: tl.constexpr, FIELDS: tl.constexpr, BLOCK: tl.constexpr,
                         SCALES_ALIGNED: tl.constexpr):
    """The reduced E8M0 exponents into the scale tensors: the runs of the rowwise scales
    [rows held, K/32] (the storage's rows of [M, K/32]) come first, then those of the
    columnwise ones [M/32, K]; each laid out as the exponent vector, so a run copies a run.
    A whole run copies without a mask, 16 bytes an access where the host found every run's
    source and target 16-byte aligned (SCALES_ALIGNED): masked, every access was one byte."""
    row, M, K, first, index = _scale_run(table_ptr, starts_ptr, n, STEPS, FIELDS, BLOCK)
    row_scale = tl.load(row + 10)
    rowwise = tl.where(row_scale >= 0, tl.load(row + 7) * (K // 32), 0)
    row_runs = tl.cdiv(rowwise, BLOCK) * BLOCK  # the columnwise runs start after these
    lanes = tl.arange(0, BLOCK)
    if first < row_runs:
        source = tl.load(row + 6) // 32 + first  # the storage's first row of [M, K/32]
        target = row_scale + first
        left = rowwise - first
    else:
        source = M * (K // 32) + first - row_runs
        target = tl.load(row + 11) + first - row_runs
        left = (M // 32) * K - (first - row_runs)
    source = tl.load(row + 5) + source
    if left >= BLOCK:
        values = tl.load(_at(exponents, source, True, SCALES_ALIGNED) + lanes)
        tl.store(_at(bytes_base, target, True, SCALES_ALIGNED) + lanes, values)
    else:
        mask = lanes < left.to(tl.int32)
        tl.store(bytes_base + target + lanes, tl.load(exponents + source + lanes, mask=mask),
                 mask=mask)


@triton.jit
def _nvfp4_scales_kernel(bytes_base, floats_base, maxima, table_ptr, starts_ptr, n,
                         STEPS: tl.constexpr, FIELDS: tl.constexpr, BLOCK: tl.constexpr,
                         TILE_ROWS: tl.constexpr, SCALES_ALIGNED: tl.constexpr):
    """UE4M3 codes of the rowwise scales [rows held, K/16], one program per TILE_ROWS 16-row
    tile rows and BLOCK scale columns: the tiles' codes, each stored over its 16 rows (the rows
    the storage holds), a tile row after the other; and the global amax. A block of 16 held
    rows and BLOCK columns stores without a mask, 16 bytes an access where the host found the
    rows 16-byte aligned (SCALES_ALIGNED): masked, every store was one byte.

    Why several tile rows a program: with one (2 KB of stores at K = 2048), the 1b preset's
    scales took about 30,000 programs, each paying the weight lookup and the global scale's
    load before its few stores (0.053 ms on an H200; 8 tile rows 0.036, 32 rows 0.034).
    Storing 8 tile rows as one [128, BLOCK] block measured slower (0.046)."""
    pid = tl.program_id(0)
    i = _owner(starts_ptr, pid, n, STEPS)
    row = table_ptr + i * FIELDS
    K = tl.load(row + 4)
    blocks_k = K // 16
    runs_k = tl.cdiv(blocks_k, BLOCK)
    local = pid - tl.load(starts_ptr + i)
    first_row = tl.load(row + 6) // K
    rows_held = tl.load(row + 7)
    touched = tl.cdiv(first_row + rows_held, 16) - first_row // 16  # tile rows held rows touch
    first_tile = (local // runs_k) * TILE_ROWS
    first_block = (local % runs_k) * BLOCK
    segment = maxima + tl.load(row + 5)
    lanes = tl.arange(0, BLOCK)
    column_mask = lanes < (blocks_k - first_block).to(tl.int32)
    factor, s_dec = global_scales(segment)
    rows = tl.arange(0, 16)
    stride = blocks_k.to(tl.int32)
    if SCALES_ALIGNED:
        stride = tl.multiple_of(stride, 16)
    offsets = rows[:, None] * stride + lanes[None, :]
    for step in range(TILE_ROWS):
        if first_tile + step < touched:
            tile_row = first_row // 16 + first_tile + step
            tile_amax = tl.load(segment + (1 + tile_row * blocks_k + first_block) + lanes,
                                mask=column_mask, other=0.0)
            code, _ = block_scales(tile_amax, factor, s_dec)
            held = tile_row * 16 - first_row  # the storage row of the tile's first row
            codes = tl.broadcast_to(code.to(tl.uint8)[None, :], [16, BLOCK])
            start = tl.load(row + 10) + held * blocks_k + first_block
            if (first_block + BLOCK <= blocks_k) & (held >= 0) & (held + 16 <= rows_held):
                tl.store(_at(bytes_base, start, True, SCALES_ALIGNED) + offsets, codes)
            else:
                tl.store(bytes_base + start + offsets, codes,
                         mask=column_mask[None, :] & (rows[:, None] >= (-held).to(tl.int32))
                         & (rows[:, None] < (rows_held - held).to(tl.int32)))
    if local == 0:
        tl.store(floats_base + tl.load(row + 12), tl.load(segment))


# ---- MXFP8: 1x32 and 32x1 blocks, tiles of 32 rows ----


@triton.jit
def _mxfp8_maxima_kernel(master_base, exponents, bytes_base, table_ptr, starts_ptr, n,
                         BF16_BITS: tl.constexpr, STEPS: tl.constexpr, FIELDS: tl.constexpr,
                         COLUMNS: tl.constexpr, RECIPROCAL_BITS: tl.constexpr,
                         MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr,
                         MAX_CODE: tl.constexpr, E5M2: tl.constexpr, HW_CAST: tl.constexpr,
                         ALIGNED: tl.constexpr):
    """The E8M0 exponents of the blocks' partial maxima (uint8; master_weights reduces
    exponents, not maxima: the rule is monotone), and the codes of every tile the rank's range
    covers whole.

    Why cast here: every block of such a tile (1x32 and 32x1, aligned to the tile) lies inside
    this rank's range, so no other rank adds to its maximum, and the all-reduce (a MAX with the
    other ranks' zeros) returns these exponents unchanged. Casting while the tile is in
    registers reads most of the masters once instead of twice; _mxfp8_cast_kernel casts only
    the tiles that a range boundary or the weight's edge cuts."""
    row, M, K, tile_row, tile_col = _tile(table_ptr, starts_ptr, n, False, STEPS, FIELDS,
                                          COLUMNS)
    rows = tl.arange(0, 32)
    cols = tl.arange(0, COLUMNS)
    blocks = tl.arange(0, COLUMNS // 32)
    first_block = tile_col * (COLUMNS // 32)
    segment = exponents + tl.load(row + 5)
    row_grid = segment + (tile_row * 32) * (K // 32) + first_block  # [M, K/32] from the tile
    row_cells = rows[:, None] * (K // 32).to(tl.int32) + blocks[None, :]
    column_grid = segment + M * (K // 32) + tile_row * K + tile_col * COLUMNS  # [M/32, K]
    if _interior(row, M, K, tile_row * 32, tile_col * COLUMNS, 32, COLUMNS):
        origin = (tile_row * 32) * K + tile_col * COLUMNS
        offsets = _full_offsets(K, rows, cols, ALIGNED)
        x = _load_tile(master_base, row, origin, offsets, None, BF16_BITS, ALIGNED)
        if ALIGNED:
            _mxfp8_interior_words(x, bytes_base, row, origin, K, row_grid + row_cells,
                                  column_grid + cols, offsets, COLUMNS, RECIPROCAL_BITS,
                                  MANTISSA_BITS, MIN_EXPONENT, MAX_CODE, E5M2, HW_CAST)
        else:
            row_exponent, col_exponent = _mxfp8_exponents(abs_bits(x), COLUMNS,
                                                          RECIPROCAL_BITS)
            tl.store(row_grid + row_cells, row_exponent.to(tl.uint8))
            tl.store(column_grid + cols, col_exponent.to(tl.uint8))
            _mxfp8_store_copies(x, bytes_base, row, origin, offsets, None, row_exponent,
                                col_exponent, COLUMNS, MANTISSA_BITS, MIN_EXPONENT, MAX_CODE,
                                E5M2, HW_CAST, ALIGNED)
    else:
        origin, offsets, inside = _tile_range(row, M, K, tile_row * 32, tile_col * COLUMNS,
                                              rows, cols, ALIGNED)
        x = _load_tile(master_base, row, origin, offsets, inside, BF16_BITS, ALIGNED)
        row_exponent, col_exponent = _mxfp8_exponents(abs_bits(x), COLUMNS, RECIPROCAL_BITS)
        tl.store(row_grid + row_cells, row_exponent.to(tl.uint8),
                 mask=(rows[:, None] < (M - tile_row * 32).to(tl.int32))
                 & (blocks[None, :] < (K // 32 - first_block).to(tl.int32)))
        tl.store(column_grid + cols, col_exponent.to(tl.uint8),
                 mask=cols < (K - tile_col * COLUMNS).to(tl.int32))


@triton.jit
def _mxfp8_interior_words(x, bytes_base, row, origin, K, row_cells, column_cells, offsets,
                          COLUMNS: tl.constexpr, RECIPROCAL_BITS: tl.constexpr,
                          MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr,
                          MAX_CODE: tl.constexpr, E5M2: tl.constexpr, HW_CAST: tl.constexpr):
    """A tile inside the range and the weight, its starts 16-byte aligned (ALIGNED): the
    exponents into their cells and both copies' codes as int32 words of four elements.

    Why words (as per_tensor_tile): the tile is split into its four column components (x_c
    holds columns 4j + c), so a word's four codes come from one inline conversion of four
    products and go to memory as they are. Byte codes cost a PRMT an element to pack into the
    stores' words. The exponents and factors are the MXFP8 words kernel's (mxfp8._e8m0,
    mxfp8._word_factor: one product x * 2^(127 - e) is the reference's, an infinite block's
    subnormal factor included), so the two multiplies and the NaN select an element of each
    copy are needed only in a tile with a NaN (exponent 255: one scalar test a tile), where
    the byte path runs as before.

    The words reach memory as 16-byte vectors (Triton moves them through shared memory into
    that layout). Stored where they are computed, a word a thread a row, the kernel took
    0.332 ms instead of 0.295 on an H100 (1b, rank 0 of 8; KERNEL_NOTES.md). The exponents
    are those of the byte path (_mxfp8_exponents, one reduction of the whole tile for the
    columns), split into components after."""
    WORDS: tl.constexpr = COLUMNS // 4
    evens, odds = tl.split(tl.reshape(x, [32, WORDS, 2, 2]))
    x0, x2 = tl.split(evens)
    x1, x3 = tl.split(odds)
    row_exponent, col_exponent = _mxfp8_exponents(abs_bits(x), COLUMNS, RECIPROCAL_BITS)
    tl.store(row_cells, row_exponent.to(tl.uint8))
    tl.store(column_cells, col_exponent.to(tl.uint8))
    even_exponents, odd_exponents = tl.split(tl.reshape(col_exponent, [WORDS, 2, 2]))
    e0, e2 = tl.split(even_exponents)
    e1, e3 = tl.split(odd_exponents)
    if tl.max(tl.max(row_exponent, axis=1), axis=0) == 255:  # a NaN element
        _mxfp8_store_copies(x, bytes_base, row, origin, offsets, None, row_exponent,
                            col_exponent, COLUMNS, MANTISSA_BITS, MIN_EXPONENT, MAX_CODE, E5M2,
                            HW_CAST, True)
    else:
        rows = tl.arange(0, 32)
        word_offsets = (rows[:, None] * tl.multiple_of((K // 4).to(tl.int32), 4)
                        + tl.arange(0, WORDS)[None, :])
        row_data = tl.load(row + 8)
        if row_data >= 0:
            f = expand_blocks(_word_factor(row_exponent), 32, WORDS, 8)
            words = codes_word(x0 * f, x1 * f, x2 * f, x3 * f, E5M2, HW_CAST, False)
            tl.store(_words_at(bytes_base, row_data - tl.load(row + 6) + origin)
                     + word_offsets, words)
        col_data = tl.load(row + 9)
        if col_data >= 0:
            words = codes_word(x0 * _word_factor(e0)[None, :], x1 * _word_factor(e1)[None, :],
                               x2 * _word_factor(e2)[None, :], x3 * _word_factor(e3)[None, :],
                               E5M2, HW_CAST, False)
            tl.store(_words_at(bytes_base, col_data - tl.load(row + 6) + origin)
                     + word_offsets, words)


@triton.jit
def _words_at(bytes_base, offset):
    """The int32 words at bytes_base + offset, a 16-byte aligned offset (ALIGNED)."""
    return tl.multiple_of((bytes_base + offset).to(tl.pointer_type(tl.int32)), 16)


@triton.jit
def _mxfp8_exponents(magnitude, COLUMNS: tl.constexpr, RECIPROCAL_BITS: tl.constexpr):
    """E8M0 exponents (int32) of a 32-row tile's 1x32 blocks [32, COLUMNS / 32] and 32x1
    blocks [COLUMNS], from its magnitudes' bits, by the MXFP8 words kernel's rule (mxfp8._e8m0:
    the reference's for every fp32 maximum, in about half the instructions)."""
    row_max = tl.max(tl.reshape(magnitude, [32, COLUMNS // 32, 32]), axis=2)
    column_max = tl.max(magnitude, axis=0)
    return (_e8m0(row_max.to(tl.float32, bitcast=True), RECIPROCAL_BITS),
            _e8m0(column_max.to(tl.float32, bitcast=True), RECIPROCAL_BITS))


@triton.jit
def _mxfp8_codes(x, exponent, ROWS: tl.constexpr, COLUMNS: tl.constexpr,
                 EXPAND: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr,
                 MAX_CODE: tl.constexpr, E5M2: tl.constexpr, HW_CAST: tl.constexpr):
    """FP8 codes of x [ROWS, COLUMNS] * 2^(127 - e): mxfp8_tile's two paths, the per-block
    values computed once a block and then spread (EXPAND: exponents [ROWS, COLUMNS / 32] over
    their 32 columns; otherwise [1, COLUMNS], broadcast over the rows)."""
    if HW_CAST:
        f, h = _hw_factors(exponent)
        if EXPAND:
            f = expand_blocks(f, ROWS, COLUMNS, 32)
            h = expand_blocks(h, ROWS, COLUMNS, 32)
        codes = cvt_sat_rne_fp8(x * f * h, E5M2)
    else:
        if EXPAND:
            exponent = expand_blocks(exponent, ROWS, COLUMNS, 32)
        codes = _fp8_codes(x, exponent, MANTISSA_BITS, MIN_EXPONENT, MAX_CODE)
    return codes


@triton.jit
def _mxfp8_cast_kernel(master_base, bytes_base, exponents, table_ptr, starts_ptr, n,
                       BF16_BITS: tl.constexpr, STEPS: tl.constexpr, FIELDS: tl.constexpr,
                       COLUMNS: tl.constexpr, MANTISSA_BITS: tl.constexpr,
                       MIN_EXPONENT: tl.constexpr, MAX_CODE: tl.constexpr,
                       E5M2: tl.constexpr, HW_CAST: tl.constexpr, ALIGNED: tl.constexpr):
    """The rank's elements of one window tile that a range boundary or the weight's edge cuts,
    both copies, with the tile's reduced exponents (_mxfp8_maxima_kernel cast the others)."""
    row, M, K, tile_row, tile_col = _tile(table_ptr, starts_ptr, n, True, STEPS, FIELDS,
                                          COLUMNS)
    if not _interior(row, M, K, tile_row * 32, tile_col * COLUMNS, 32, COLUMNS):
        rows = tl.arange(0, 32)
        cols = tl.arange(0, COLUMNS)
        blocks = tl.arange(0, COLUMNS // 32)
        first_block = tile_col * (COLUMNS // 32)
        segment = exponents + tl.load(row + 5)
        block_mask = ((rows[:, None] < (M - tile_row * 32).to(tl.int32))
                      & (blocks[None, :] < (K // 32 - first_block).to(tl.int32)))
        row_grid = segment + (tile_row * 32) * (K // 32) + first_block
        row_exponent = tl.load(row_grid + rows[:, None] * (K // 32).to(tl.int32)
                               + blocks[None, :], mask=block_mask, other=0).to(tl.int32)
        column_grid = segment + M * (K // 32) + tile_row * K + tile_col * COLUMNS
        col_exponent = tl.load(column_grid + cols,
                               mask=cols < (K - tile_col * COLUMNS).to(tl.int32),
                               other=0).to(tl.int32)  # [COLUMNS]
        origin, offsets, inside = _tile_range(row, M, K, tile_row * 32, tile_col * COLUMNS,
                                              rows, cols, ALIGNED)
        x = _load_tile(master_base, row, origin, offsets, inside, BF16_BITS, ALIGNED)
        _mxfp8_store_copies(x, bytes_base, row, origin, offsets, inside, row_exponent,
                            col_exponent, COLUMNS, MANTISSA_BITS, MIN_EXPONENT, MAX_CODE, E5M2,
                            HW_CAST, ALIGNED)


@triton.jit
def _mxfp8_store_copies(x, bytes_base, row, origin, offsets, inside, row_exponent, col_exponent,
                        COLUMNS: tl.constexpr, MANTISSA_BITS: tl.constexpr,
                        MIN_EXPONENT: tl.constexpr, MAX_CODE: tl.constexpr,
                        E5M2: tl.constexpr, HW_CAST: tl.constexpr, ALIGNED: tl.constexpr):
    """A tile's codes into the copies the weight keeps (inside: the element mask, or None for
    a tile the range covers whole)."""
    row_data = tl.load(row + 8)
    if row_data >= 0:
        codes = _mxfp8_codes(x, row_exponent, 32, COLUMNS, True, MANTISSA_BITS, MIN_EXPONENT,
                             MAX_CODE, E5M2, HW_CAST)
        tl.store(_at(bytes_base, row_data - tl.load(row + 6) + origin, inside is None, ALIGNED)
                 + offsets, codes, mask=inside)
    col_data = tl.load(row + 9)
    if col_data >= 0:
        codes = _mxfp8_codes(x, col_exponent[None, :], 32, COLUMNS, False, MANTISSA_BITS,
                             MIN_EXPONENT, MAX_CODE, E5M2, HW_CAST)
        tl.store(_at(bytes_base, col_data - tl.load(row + 6) + origin, inside is None, ALIGNED)
                 + offsets, codes, mask=inside)


# ---- 2D NVFP4: 16x16 tiles and a global amax, tiles of 16 rows ----


@triton.jit
def _nvfp4_maxima_kernel(master_base, maxima_bits, table_ptr, starts_ptr, n,
                         BF16_BITS: tl.constexpr, STEPS: tl.constexpr, FIELDS: tl.constexpr,
                         COLUMNS: tl.constexpr, ALIGNED: tl.constexpr):
    row, M, K, tile_row, tile_col = _tile(table_ptr, starts_ptr, n, False, STEPS, FIELDS,
                                          COLUMNS)
    origin, offsets, inside = _tile_range(row, M, K, tile_row * 16, tile_col * COLUMNS,
                                          tl.arange(0, 16), tl.arange(0, COLUMNS), ALIGNED)
    x = _load_tile(master_base, row, origin, offsets, inside, BF16_BITS, ALIGNED)
    tiles = tl.max(tl.max(tl.reshape(abs_bits(x), [16, COLUMNS // 16, 16]), axis=2), axis=0)
    segment = maxima_bits + tl.load(row + 5)
    blocks = tl.arange(0, COLUMNS // 16)
    first_block = tile_col * (COLUMNS // 16)
    tl.store(segment + (1 + tile_row * (K // 16) + first_block) + blocks, tiles,
             mask=blocks < (K // 16 - first_block).to(tl.int32))
    tl.atomic_max(segment, tl.max(tiles, axis=0))


@triton.jit
def _nvfp4_cast_kernel(master_base, bytes_base, maxima, table_ptr, starts_ptr, n,
                       BF16_BITS: tl.constexpr, STEPS: tl.constexpr, FIELDS: tl.constexpr,
                       COLUMNS: tl.constexpr, ALIGNED: tl.constexpr):
    """The rank's elements of one window tile, nibble by nibble, with the tiles' scales from
    the reduced maxima. Byte j of a row takes element 2j (low nibble) and 2j + 1 (high): a tile
    inside the range loads its rows whole and splits the pairs; a tile the range cuts loads the
    even and the odd elements as two masked [16, COLUMNS / 2] halves."""
    row, M, K, tile_row, tile_col = _tile(table_ptr, starts_ptr, n, False, STEPS, FIELDS,
                                          COLUMNS)
    blocks = tl.arange(0, COLUMNS // 16)
    first_block = tile_col * (COLUMNS // 16)
    segment = maxima + tl.load(row + 5)
    factor, s_dec = global_scales(segment)
    tile_amax = tl.load(segment + (1 + tile_row * (K // 16) + first_block) + blocks,
                        mask=blocks < (K // 16 - first_block).to(tl.int32), other=0.0)
    _, element_scale = block_scales(tile_amax, factor, s_dec)  # [COLUMNS / 16]
    rows = tl.arange(0, 16)
    scale = expand_blocks(tl.broadcast_to(element_scale[None, :], [16, COLUMNS // 16]), 16,
                          COLUMNS // 2, 8)
    keep = scale == scale  # NaN tiles encode as +0 (the reference)
    if _interior(row, M, K, tile_row * 16, tile_col * COLUMNS, 16, COLUMNS):
        origin = (tile_row * 16) * K + tile_col * COLUMNS
        x = _load_tile(master_base, row, origin,
                       _full_offsets(K, rows, tl.arange(0, COLUMNS), ALIGNED), None, BF16_BITS,
                       ALIGNED)
        x_even, x_odd = tl.split(tl.reshape(x, [16, COLUMNS // 2, 2]))
        byte = _nvfp4_bytes(x_even, x_odd, scale, keep)
        first_byte = tl.load(row + 8) + (origin - tl.load(row + 6)) // 2
        columns = (K // 2).to(tl.int32)
        if ALIGNED:  # the plan checked the bytes' offset and K (master_cast_plan._aligned)
            first_byte = tl.multiple_of(first_byte, 8)
            columns = tl.multiple_of(columns, 8)
        tl.store(bytes_base + first_byte + rows[:, None] * columns
                 + tl.arange(0, COLUMNS // 2)[None, :], byte.to(tl.uint8))
    else:
        pairs = tl.arange(0, COLUMNS // 2) * 2
        origin, even, low_in = _tile_range(row, M, K, tile_row * 16, tile_col * COLUMNS, rows,
                                           pairs, ALIGNED)
        _odd_origin, odd, high_in = _tile_range(row, M, K, tile_row * 16, tile_col * COLUMNS,
                                                rows, pairs + 1, ALIGNED)
        x_even = _load_tile(master_base, row, origin, even, low_in, BF16_BITS, ALIGNED)
        x_odd = _load_tile(master_base, row, origin, odd, high_in, BF16_BITS, ALIGNED)
        packed = _nvfp4_bytes(x_even, x_odd, scale, keep)
        # origin and base are even (K is), so byte = (element - base) / 2
        target = bytes_base + (tl.load(row + 8) + (origin - tl.load(row + 6)) // 2) + even // 2
        # a byte the range covers half of keeps its other nibble
        old = tl.load(target, mask=low_in != high_in, other=0).to(tl.int32)
        byte = tl.where(low_in, packed & 0xF, old & 0xF) | tl.where(high_in, packed, old) & 0xF0
        tl.store(target, byte.to(tl.uint8), mask=low_in | high_in)


@triton.jit
def _nvfp4_bytes(x_even, x_odd, scale, keep):
    """Packed bytes (int32) of element pairs: the even element's nibble low, the odd's high;
    +0 where the tile's scale is NaN."""
    low = tl.where(keep, _e2m1_nibbles(x_even, scale, 0.0, False), 0)
    high = tl.where(keep, _e2m1_nibbles(x_odd, scale, 0.0, False), 0)
    return low | (high << 4)
