"""Partial master-weight casts (ZeRO ranges) into quantized weights: every weight of a format
in two or three launches (issue 16: "one launch per step for all weights").

A ZeRO rank owns a flat element range [start, end) of each weight's master copy
(distributed.master_weights). Every scale depends on an absolute maximum: of the tensor
(per-tensor FP8), of a 128x128 tile (block FP8), of 1x32 and 32x1 blocks (MXFP8), of 16x16 tiles
and the tensor (2D NVFP4); a block cut by a range boundary is shared by ranks. So a cast is:

1. `maxima`: every rank writes the maxima of what its range touches into one flat fp32 vector,
   laid out per weight as the reference (master_weights._partial_maxima) lays it out; elements
   outside the range count as zeros, blocks it does not touch stay zero.
2. the caller reduces the vector (one MAX all-reduce over the data-parallel group).
3. `cast`: the per-tensor kernel casts the range in flat runs (its first run writes scale_inv);
   delayed scaling, whose scale is the recipe state's and known before the all-reduce, cast
   already in step 1 and only folds the reduced amax into the state here.
   A block format writes every scale of every weight in flat runs of the scale tensors (every
   rank writes every scale: they are the same everywhere; the tensors are laid out as their
   maxima, so a run reads a run), then casts the tiles of the rank's window that are still
   uncast (NVFP4: all of them; block FP8 and MXFP8: those a range boundary or the weight's edge
   cuts, master_cast_tiles.cut_tile_rows), each tile's scales derived from the reduced maxima
   again. Scales come from the single-tensor kernels' device
   functions, so the bytes are theirs and so numerics'. NVFP4 packs two elements a byte: where
   the range starts or ends inside a byte, the other nibble is left as it was. Transposed
   copies that the format derives (block FP8, 2D NVFP4) are left to post_all_gather_processing,
   scales included.

Why scales apart from the cast: a first version had every cast program take one tile of the
full weight and write its scales, casting where the tile met the range; seven of eight ranks'
tiles wrote only scales, and those programs left the launch latency-bound (1b over 8 ranks on
an H200: 1.8 ms for MXFP8, 1.4 ms for NVFP4).

Each program finds its weight in one int64 table (master_cast_plan.py builds it; multi_tensor's
scheme: a binary search over the running program counts). Destinations are addressed as offsets
from one byte base and one fp32 base (pointer differences from the lowest address), so one
launch writes into every weight's own tensors, whether a full-size weight or an FSDP2 shard of
rows (`base`: the element where the storage starts, `rows_held`: its rows). Inside a tile,
offsets are int32 from the tile's origin (one int64 scalar a program): int64 arithmetic per
element made the first version instruction-bound.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .block_fp8 import _scale, _scale_inv
from .element_cast import e8m0_exponent as e8m0_from_amax
from .element_cast import expand_blocks, load_as_float
from .fp8_common import abs_bits, cvt_sat_rne_fp8, fp8_codes, reciprocal_rn, scale_from_amax
from .multi_tensor import _owner
from .mxfp8 import _fp8_codes, _hw_factors
from .nvfp4 import _e2m1_nibbles
from .nvfp4_scales import block_scales, global_scales

# Each program reads its weight's row of the plan's int64 table (master_cast_plan.py names the
# fields): 0 master offset, 1 start, 2 end, 3 M, 4 K, 5 maxima offset, 6 base, 7 rows held,
# 8 rowwise bytes, 9 columnwise bytes, 10 rowwise scale, 11 columnwise scale, 12 amax slot,
# 13 first cut tile row, 14 first window tile row, 15 delayed scaling's scale, 16 the cut tile
# row after the first (offsets from the byte or fp32 base; -1: none).
_INT32_REACH = tl.constexpr(2**30)  # range bounds relative to a tile, clamped into int32


# ---- device functions ----


@triton.jit
def _tile(table_ptr, starts_ptr, n, CUT: tl.constexpr, STEPS: tl.constexpr,
          FIELDS: tl.constexpr, COLUMNS: tl.constexpr):
    """This program's weight (its table row), M, K and tile (row, column) index: over the tile
    rows of the rank's window, or (CUT) over those of them that a range boundary or the
    weight's edge may cut: the first such tile row, then the rows from field 16 on (the plan
    lists at most the window's first and last, or every one where K leaves a narrow tile)."""
    pid = tl.program_id(0)
    i = _owner(starts_ptr, pid, n, STEPS)
    row = table_ptr + i * FIELDS
    M = tl.load(row + 3)
    K = tl.load(row + 4)
    tiles_k = tl.cdiv(K, COLUMNS)
    local = pid - tl.load(starts_ptr + i)
    band = local // tiles_k
    if CUT:
        tile_row = tl.where(band == 0, tl.load(row + 13), tl.load(row + 16) + band - 1)
    else:
        tile_row = band + tl.load(row + 14)
    return row, M, K, tile_row, local % tiles_k


@triton.jit
def _tile_range(row, M, K, row0, col0, rows, cols, ALIGNED: tl.constexpr):
    """For a tile whose element (0, 0) is (row0, col0) of the weight: its flat origin (int64)
    and, for local indices rows x cols (int32), the int32 offsets from it and the mask of the
    elements inside the weight and inside the rank's range."""
    origin = row0 * K + col0
    lo = tl.maximum(tl.minimum(tl.load(row + 1) - origin, _INT32_REACH), -1).to(tl.int32)
    hi = tl.maximum(tl.minimum(tl.load(row + 2) - origin, _INT32_REACH), -1).to(tl.int32)
    offsets = _full_offsets(K, rows, cols, ALIGNED)
    inside = ((rows[:, None] < (M - row0).to(tl.int32)) & (cols[None, :] < (K - col0).to(tl.int32))
              & (offsets >= lo) & (offsets < hi))
    return origin, offsets, inside


@triton.jit
def _load_tile(master_base, row, origin, offsets, inside, BF16_BITS: tl.constexpr,
               ALIGNED: tl.constexpr):
    """The tile's elements from the rank's master range, zero outside it (a zero never raises a
    maximum); inside=None for a tile the range and the weight cover whole (no mask, so the
    loads are vectors). ALIGNED: the host found every master's element (0, 0) 16 elements
    aligned, so 16-byte loads may be used."""
    start = tl.load(row) + origin - tl.load(row + 1)
    if ALIGNED:
        start = tl.multiple_of(start, 16)
    return load_as_float(master_base + start, offsets, inside, BF16_BITS)


@triton.jit
def _interior(row, M, K, row0, col0, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """Whether the tile of ROWS x COLUMNS at (row0, col0) lies inside the weight and inside the
    rank's range. Such a tile (most of a rank's window) is cast without element masks: a mask
    built from the range's bounds, which the compiler cannot prove aligned, made every load and
    store one element wide (the fast path's loads and stores are vectors)."""
    origin = row0 * K + col0
    return ((tl.load(row + 1) <= origin) & (origin + (ROWS - 1) * K + COLUMNS <= tl.load(row + 2))
            & (row0 + ROWS <= M) & (col0 + COLUMNS <= K))


@triton.jit
def _full_offsets(K, rows, cols, ALIGNED: tl.constexpr):
    """int32 offsets rows x cols from a tile's origin (rows of K elements)."""
    columns = K.to(tl.int32)
    if ALIGNED:  # the host found every K a multiple of 16 (rows of 16-element runs)
        columns = tl.multiple_of(columns, 16)
    return rows[:, None] * columns + cols[None, :]


@triton.jit
def _at(base, offset, WHOLE: tl.constexpr, ALIGNED: tl.constexpr):
    """base + offset, hinted 16-byte aligned where the host found it so and the access is
    unmasked (WHOLE). The hint goes on the pointer made here: `tl.multiple_of` on a jit
    function's scalar parameter is silently lost (it annotates the op that defines a value, and
    a parameter has none), which had left every store of these kernels one byte wide (sm_90
    PTX). No hint for a masked access: the hint makes each thread's elements contiguous, and
    with a mask that is not constant over them the accesses stay scalar and no longer coalesce
    (the flat FP8 casts ran at half speed that way on an H100)."""
    pointer = base + offset
    if WHOLE and ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


# ---- per-tensor FP8 (current and delayed scaling): flat runs of the range ----


@triton.jit
def _flat(table_ptr, starts_ptr, n, STEPS: tl.constexpr, FIELDS: tl.constexpr,
          BLOCK: tl.constexpr):
    """This program's weight (table row), its run index, the run's first element (from the
    range's start) and the mask of the run's elements inside the range."""
    pid = tl.program_id(0)
    i = _owner(starts_ptr, pid, n, STEPS)
    row = table_ptr + i * FIELDS
    run = pid - tl.load(starts_ptr + i)
    first = run * BLOCK
    left = tl.minimum(tl.load(row + 2) - tl.load(row + 1) - first, BLOCK).to(tl.int32)
    lanes = tl.arange(0, BLOCK)
    return row, run, first, lanes, lanes < left


@triton.jit
def _per_tensor_maxima_kernel(master_base, maxima_bits, table_ptr, starts_ptr, n,
                              BF16_BITS: tl.constexpr, STEPS: tl.constexpr,
                              FIELDS: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    row, _, first, lanes, inside = _flat(table_ptr, starts_ptr, n, STEPS, FIELDS, BLOCK)
    x = load_as_float(master_base + tl.load(row) + first, lanes, inside,
                      BF16_BITS)
    tl.atomic_max(maxima_bits + tl.load(row + 5), tl.max(abs_bits(x), axis=0))


@triton.jit
def _per_tensor_cast_kernel(master_base, bytes_base, floats_base, maxima, table_ptr, starts_ptr,
                            n, eps, BF16_BITS: tl.constexpr, STEPS: tl.constexpr,
                            FIELDS: tl.constexpr, BLOCK: tl.constexpr, E5M2: tl.constexpr,
                            POW2: tl.constexpr, HW_CAST: tl.constexpr,
                            ALIGNED: tl.constexpr):
    """Current scaling: the scale from the reduced amax (numerics.scale_from_amax, FLT_MAX on
    overflow); the first run writes scale_inv."""
    row, run, first, lanes, inside = _flat(table_ptr, starts_ptr, n, STEPS, FIELDS, BLOCK)
    scale = scale_from_amax(tl.load(maxima + tl.load(row + 5)), eps, E5M2, POW2, 0x7F7FFFFF)
    if run == 0:
        tl.store(floats_base + tl.load(row + 10), reciprocal_rn(scale))
    x = load_as_float(master_base + tl.load(row) + first, lanes, inside,
                      BF16_BITS)
    data = tl.load(row + 8)
    target = bytes_base + data + tl.load(row + 1) - tl.load(row + 6) + first
    tl.store(target + lanes, fp8_codes(x * scale, E5M2, HW_CAST), mask=inside & (data >= 0))


@triton.jit
def _delayed_cast_kernel(master_base, bytes_base, floats_base, maxima_bits, table_ptr,
                         starts_ptr, n, BF16_BITS: tl.constexpr, STEPS: tl.constexpr,
                         FIELDS: tl.constexpr, BLOCK: tl.constexpr, E5M2: tl.constexpr,
                         HW_CAST: tl.constexpr, ALIGNED: tl.constexpr):
    """Delayed scaling in one pass over the masters: the scale is the recipe state's, known
    before any all-reduce, so each run casts its elements and records their amax at once (the
    reduced amax only updates the state's slot afterwards, _delayed_fold_kernel). The first run
    writes scale_inv; a weight whose range is empty gets that one run."""
    row, run, first, lanes, inside = _flat(table_ptr, starts_ptr, n, STEPS, FIELDS, BLOCK)
    scale = tl.load(floats_base + tl.load(row + 15))
    if run == 0:
        tl.store(floats_base + tl.load(row + 10), reciprocal_rn(scale))
    x = load_as_float(master_base + tl.load(row) + first, lanes, inside,
                      BF16_BITS)
    tl.atomic_max(maxima_bits + tl.load(row + 5), tl.max(abs_bits(x), axis=0))
    data = tl.load(row + 8)
    target = bytes_base + data + tl.load(row + 1) - tl.load(row + 6) + first
    tl.store(target + lanes, fp8_codes(x * scale, E5M2, HW_CAST), mask=inside & (data >= 0))


@triton.jit
def _delayed_fold_kernel(floats_base, maxima, table_ptr, FIELDS: tl.constexpr):
    """One program a weight: the reduced amax folded into the recipe state's slot
    (torch.maximum: NaN wins)."""
    row = table_ptr + tl.program_id(0) * FIELDS
    amax = tl.load(maxima + tl.load(row + 5))
    slot = floats_base + tl.load(row + 12)
    old = tl.load(slot)
    tl.store(slot, tl.where(old != old, old, tl.where(amax != amax, amax, tl.maximum(old, amax))))


# ---- block formats: every scale in flat runs of the scale tensors ----


@triton.jit
def _scale_run(table_ptr, starts_ptr, n, STEPS: tl.constexpr, FIELDS: tl.constexpr,
               BLOCK: tl.constexpr):
    """This program's weight (table row), M, K, the first index of its run of scale entries
    and the run's indices."""
    pid = tl.program_id(0)
    i = _owner(starts_ptr, pid, n, STEPS)
    row = table_ptr + i * FIELDS
    first = (pid - tl.load(starts_ptr + i)) * BLOCK
    return (row, tl.load(row + 3), tl.load(row + 4), first,
            first + tl.arange(0, BLOCK).to(tl.int64))


@triton.jit
def _block_scales_kernel(floats_base, maxima_bits, table_ptr, starts_ptr, n, eps,
                         STEPS: tl.constexpr, FIELDS: tl.constexpr, BLOCK: tl.constexpr,
                         POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr):
    """scale_inv of every 128x128 tile: the grid [ceil(M/128), ceil(K/128)] is laid out as its
    maxima are."""
    row, M, K, first, index = _scale_run(table_ptr, starts_ptr, n, STEPS, FIELDS, BLOCK)
    mask = index < tl.cdiv(M, 128) * tl.cdiv(K, 128)
    scale = _scale(tl.load(maxima_bits + tl.load(row + 5) + index, mask=mask, other=0), eps,
                   POW2, OVERFLOW_BITS)
    tl.store(floats_base + tl.load(row + 10) + index, _scale_inv(scale, POW2), mask=mask)


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
                         SCALES_ALIGNED: tl.constexpr):
    """UE4M3 codes of the rowwise scales [rows held, K/16], one program per 16-row tile row and
    BLOCK scale columns: the tiles' codes, each stored over its 16 rows (the rows the storage
    holds); and the global amax. A block of 16 held rows and BLOCK columns stores without a
    mask, 16 bytes an access where the host found the rows 16-byte aligned (SCALES_ALIGNED):
    masked, every store was one byte."""
    pid = tl.program_id(0)
    i = _owner(starts_ptr, pid, n, STEPS)
    row = table_ptr + i * FIELDS
    K = tl.load(row + 4)
    blocks_k = K // 16
    runs_k = tl.cdiv(blocks_k, BLOCK)
    local = pid - tl.load(starts_ptr + i)
    first_row = tl.load(row + 6) // K
    tile_row = first_row // 16 + local // runs_k
    first_block = (local % runs_k) * BLOCK
    segment = maxima + tl.load(row + 5)
    lanes = tl.arange(0, BLOCK)
    column_mask = lanes < (blocks_k - first_block).to(tl.int32)
    tile_amax = tl.load(segment + (1 + tile_row * blocks_k + first_block) + lanes,
                        mask=column_mask, other=0.0)
    factor, s_dec = global_scales(segment)
    code, _ = block_scales(tile_amax, factor, s_dec)
    held = tile_row * 16 - first_row  # the storage row of the tile's first row
    rows = tl.arange(0, 16)
    rows_held = tl.load(row + 7)
    codes = tl.broadcast_to(code.to(tl.uint8)[None, :], [16, BLOCK])
    start = tl.load(row + 10) + held * blocks_k + first_block
    stride = blocks_k.to(tl.int32)
    if SCALES_ALIGNED:
        stride = tl.multiple_of(stride, 16)
    offsets = rows[:, None] * stride + lanes[None, :]
    if (first_block + BLOCK <= blocks_k) & (held >= 0) & (held + 16 <= rows_held):
        tl.store(_at(bytes_base, start, True, SCALES_ALIGNED) + offsets, codes)
    else:
        tl.store(bytes_base + start + offsets, codes,
                 mask=column_mask[None, :] & (rows[:, None] >= (-held).to(tl.int32))
                 & (rows[:, None] < (rows_held - held).to(tl.int32)))
    if local == 0:
        tl.store(floats_base + tl.load(row + 12), tl.load(segment))


# ---- block FP8, 128x128 tiles ----


@triton.jit
def _block_maxima_kernel(master_base, maxima_bits, bytes_base, table_ptr, starts_ptr, n, eps,
                         BF16_BITS: tl.constexpr, STEPS: tl.constexpr, FIELDS: tl.constexpr,
                         CHUNK: tl.constexpr, POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr,
                         HW_CAST: tl.constexpr, ALIGNED: tl.constexpr):
    """The partial maximum of one window tile, and the codes of a tile that the rank's range
    covers whole: no other rank adds to its maximum, so the all-reduce (a MAX with the other
    ranks' zeros) returns it unchanged and its scale is final here. Its chunks are read a second
    time right after the first (from L2, a 128 x 128 tile is 64 KiB of fp32), so the masters
    are read from memory once instead of twice; _block_cast_kernel casts only the tiles that a
    range boundary or the weight's edge cuts."""
    row, M, K, tile_row, tile_col = _tile(table_ptr, starts_ptr, n, False, STEPS, FIELDS, 128)
    cols = tl.arange(0, 128)
    chunk_rows = tl.arange(0, CHUNK)
    slot = maxima_bits + tl.load(row + 5) + tile_row * tl.cdiv(K, 128) + tile_col
    running = tl.zeros([CHUNK, 128], dtype=tl.int32)
    if _interior(row, M, K, tile_row * 128, tile_col * 128, 128, 128):
        origin = (tile_row * 128) * K + tile_col * 128
        offsets = _full_offsets(K, chunk_rows, cols, ALIGNED)
        for step in range(128 // CHUNK):
            x = _load_tile(master_base, row, origin + (step * CHUNK) * K, offsets, None,
                           BF16_BITS, ALIGNED)
            running = tl.maximum(running, abs_bits(x))
        tile_max = tl.max(tl.max(running, axis=1), axis=0)
        tl.store(slot, tile_max)
        scale = _scale(tile_max, eps, POW2, OVERFLOW_BITS)
        data = tl.load(row + 8) - tl.load(row + 6)
        for step in range(128 // CHUNK):
            chunk = origin + (step * CHUNK) * K
            x = _load_tile(master_base, row, chunk, offsets, None, BF16_BITS, ALIGNED)
            tl.store(_at(bytes_base, data + chunk, True, ALIGNED) + offsets,
                     fp8_codes(x * scale, False, HW_CAST))
    else:
        for step in range(128 // CHUNK):
            origin, offsets, inside = _tile_range(row, M, K, tile_row * 128 + step * CHUNK,
                                                  tile_col * 128, chunk_rows, cols, ALIGNED)
            x = _load_tile(master_base, row, origin, offsets, inside, BF16_BITS, ALIGNED)
            running = tl.maximum(running, abs_bits(x))
        tl.store(slot, tl.max(tl.max(running, axis=1), axis=0))


@triton.jit
def _block_cast_kernel(master_base, bytes_base, maxima_bits, table_ptr, starts_ptr, n, eps,
                       BF16_BITS: tl.constexpr, STEPS: tl.constexpr, FIELDS: tl.constexpr,
                       CHUNK: tl.constexpr, POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr,
                       HW_CAST: tl.constexpr, ALIGNED: tl.constexpr):
    """The rank's elements of one window tile that a range boundary or the weight's edge cuts,
    with the tile's scale from the reduced maximum (_block_maxima_kernel cast the others)."""
    row, M, K, tile_row, tile_col = _tile(table_ptr, starts_ptr, n, True, STEPS, FIELDS, 128)
    if not _interior(row, M, K, tile_row * 128, tile_col * 128, 128, 128):
        scale = _scale(tl.load(maxima_bits + tl.load(row + 5) + tile_row * tl.cdiv(K, 128)
                               + tile_col), eps, POW2, OVERFLOW_BITS)
        data = tl.load(row + 8) - tl.load(row + 6)
        cols = tl.arange(0, 128)
        for step in range(128 // CHUNK):
            origin, offsets, inside = _tile_range(row, M, K, tile_row * 128 + step * CHUNK,
                                                  tile_col * 128, tl.arange(0, CHUNK), cols,
                                                  ALIGNED)
            x = _load_tile(master_base, row, origin, offsets, inside, BF16_BITS, ALIGNED)
            tl.store(bytes_base + data + origin + offsets,
                     fp8_codes(x * scale, False, HW_CAST), mask=inside)


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
        row_exponent, col_exponent = _mxfp8_exponents(abs_bits(x), COLUMNS, RECIPROCAL_BITS)
        tl.store(row_grid + row_cells, row_exponent.to(tl.uint8))
        tl.store(column_grid + cols, col_exponent.to(tl.uint8))
        _mxfp8_store_copies(x, bytes_base, row, origin, offsets, None, row_exponent,
                            col_exponent, COLUMNS, MANTISSA_BITS, MIN_EXPONENT, MAX_CODE, E5M2,
                            HW_CAST, ALIGNED)
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
def _mxfp8_exponents(magnitude, COLUMNS: tl.constexpr, RECIPROCAL_BITS: tl.constexpr):
    """E8M0 exponents (int32) of a 32-row tile's 1x32 blocks [32, COLUMNS / 32] and 32x1
    blocks [COLUMNS], from its magnitudes' bits."""
    row_max = tl.max(tl.reshape(magnitude, [32, COLUMNS // 32, 32]), axis=2)
    column_max = tl.max(magnitude, axis=0)
    return (e8m0_from_amax(row_max.to(tl.float32, bitcast=True), RECIPROCAL_BITS),
            e8m0_from_amax(column_max.to(tl.float32, bitcast=True), RECIPROCAL_BITS))


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
