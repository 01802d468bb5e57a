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

This file holds the device functions every format shares and the per-tensor and block FP8
kernels; master_cast_mx.py holds the MXFP8 and NVFP4 kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .block_fp8 import _scale, _scale_inv
from .element_cast import load_as_float
from .fp8_common import abs_bits, fp8_codes, reciprocal_rn, scale_from_amax
from .multi_tensor import _owner

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
