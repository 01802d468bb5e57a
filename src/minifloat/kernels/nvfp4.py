"""NVFP4 quantization in Triton (NUMERICS.md §6), bit-exact against numerics.nvfp4 (RNE).

Two launches per call, no host synchronisation:
1. `_nvfp4_amax_kernel` reads x once and writes the global amax (max|x|) and, with the random
   Hadamard transform, the amax of RHT(x^T), each into a device scalar through an integer
   atomic max over the magnitude bits (order-free, NaN-propagating).
2. The caller's `reduce_amax` (an all-reduce when a group is set) runs on those device scalars.
3. `_nvfp4_1d_kernel` or `_nvfp4_2d_kernel` reads x once more and writes every requested copy
   from the same tile: rowwise 1x16 along K, and the columnwise copy (x^T in 1x16 blocks along
   M, through the RHT when asked: both are aligned runs of 16 along M, so a quantization block is
   exactly one transform run) or, for 16x16 tiles, the nibble transpose of the rowwise copy.
   The columnwise copy reads the tile as 16 row slices (slice j = rows 16 r + j), so runs along
   M are elementwise across slices: no transpose of values (see hadamard.py).

Layouts are the reference's compact ones: rowwise data [M, K/2] (element 2j in the low nibble),
scales [M, K/16]; columnwise data [K, M/2], scales [K, M/16]; 2D tile scales replicated over
their 16 scale rows. Stochastic rounding draws Philox bits (tl.randint4x, one call per eight
elements, 16 bits per decision) keyed by element offsets and a seed that torch's generator
writes into a device tensor, one seed per direction (reproducible under torch.manual_seed and
independent of the launch tile; statistically equivalent to the reference, not byte-equal:
NUMERICS.md §7).

Imported lazily by the NVFP4 quantizer once `minifloat.kernels.available(x)` holds.
"""

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..numerics.blocks import as_2d, require_divisible
from ..numerics.nvfp4 import BLOCK
from .element_cast import expand_blocks, kernel_view, load_as_float, magnitude_bits, pack_nibbles
from .fp8_common import cdiv, hw_cast
from .hadamard import rht16_peak_bits, rht16_slices
from .launch import launch
from .nvfp4_scales import MAGIC, block_scales, e2m1_magic_bits, global_scales
from .nvfp4_words import launch_2d_words, takes_words_2d

# Launch shapes (module globals, read at call time, so benchmarks/tune_kernels.py can sweep
# them). The cast kernels are instruction-bound, so bigger tiles per thread (fixed costs:
# addresses, global scales, per-block scale divisions) win until registers cut occupancy; see
# KERNEL_NOTES.md for the sweep. The 1D tile also serves the amax launch and nvfp4_multi.
BLOCK_M = 64
BLOCK_K = 128
NUM_WARPS = 8
AMAX_NUM_WARPS = 4
NUM_WARPS_STOCHASTIC = 4
BLOCK_M_2D = 64
BLOCK_K_2D = 64
NUM_WARPS_2D = 2
# WORDS_2D (v3): bf16 16x16 quantization with round-to-nearest takes nvfp4_words's kernel
# (int64 words in, packed nibble words out, ~16 SASS an element against ~28, KERNEL_NOTES.md
# "NVFP4 v3"). H200 sweep (tune_kernels --only nv/2d, bytes equal): 64x128 w2 0.226 ms against
# 0.273 for the v2 kernel; the 16-row tiles that need no shared memory were slower (16x512 w2
# 0.401: their columnwise stores are 8 bytes a column, a quarter of a sector).
WORDS_2D = True
WORDS_BLOCK_M_2D = 64
WORDS_BLOCK_K_2D = 128
WORDS_NUM_WARPS_2D = 2

# No fp contraction: a product rounded by the reference (x * element scale) must stay rounded
# before it is added to (_e2m1_nibbles); intended fused products are explicit tl.fma.
FP_FUSION = False

DITHER_BIAS = tl.constexpr(1.0 + 32767.5 / 65536.0)  # exact in fp32


# ---- device functions: scales and element codes ----


@triton.jit
def _e2m1_nibbles(v, element_scale, dither, STOCHASTIC: tl.constexpr):
    """E2M1 nibbles (int32, sign in bit 3) of y = v * element_scale (element_scale > 0, from
    block_scales), saturating at 6. Where y is NaN the nibble is garbage: that happens exactly
    where the block's element scale is NaN (v NaN makes its block amax NaN; the scale is never
    0 or inf), so callers zero whole packed words of NaN blocks (numerics.encode_e2m1 writes +0
    there: the NaN lives in the block scale), which is cheaper than a select per element.

    Why no compares against the grid: E2M1 is fixed point on three pieces (steps 0.5 below 2,
    1 below 4, 2 above), and the code before rounding is the concave c(a) = min(2a, a + 2,
    a / 2 + 4) of a = |y|. Adding MAGIC (2^23 + 8) rounds c to nearest-even in the fp32 add and
    leaves the code in the low 3 bits; ties keep their parity because MAGIC is even; rounding is
    monotone, so the min of the rounded pieces (as int bits, all positive floats) is the rounded
    min, and each piece is one exact product plus one rounding (tl.fma; the interpreter's
    unfused form gives the same). The kernels are compiled without fp contraction
    (FP_FUSION): fusing the rounded product |v| * scale into a piece's add would skip the
    rounding of y that the reference performs. Stochastic rounding adds a dither d in
    (-1/2, 1/2) to c (16 random bits, d = (u - 32767.5) / 2^16, exact) before the integer
    rounding: up with probability frac(c) to within 2^-16 (NUMERICS.md §7 fixes no
    resolution); grid values never move, and every result is one of the two neighbours even
    where a + 2 or a / 2 + 4 rounded."""
    a = tl.abs(v) * element_scale  # |y|: the scale is positive, the sign comes from v
    if STOCHASTIC:
        c = tl.minimum(tl.minimum(a * 2.0, a + 2.0), tl.minimum(tl.fma(a, 0.5, 4.0), 7.0))
        bits = ((c + dither) + MAGIC).to(tl.int32, bitcast=True)
    else:
        bits = e2m1_magic_bits(a)
    return (bits & 7) | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _dither(draw, HIGH: tl.constexpr):
    """Dither (u - 32767.5) / 2^16 from the 16-bit half u of a uint32 Philox draw: u becomes
    the top of an fp32 mantissa in [1, 2), then one exact subtraction."""
    field = ((draw >> 9) if HIGH else (draw << 7)) & 0x7FFF80
    return (field | 0x3F800000).to(tl.float32, bitcast=True) - DITHER_BIAS


@triton.jit
def _row_dithers(seed, rows, col_start, C, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Dithers of the elements (rows, col_start + arange(COLS)) of an [R, C] layout.

    One Philox call (tl.randint4x) per eight consecutive elements: counter = offset // 8 (every
    row starts at a multiple of 16), its four 32-bit outputs split into 16-bit halves, element
    2k + h taking half h of output k, so every element has its own independent 16 bits."""
    groups = col_start // 8 + tl.arange(0, COLS // 8)
    counters = rows[:, None].to(tl.int64) * (C // 8) + groups[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, counters)
    low = tl.join(tl.join(_dither(r0, False), _dither(r2, False)),
                  tl.join(_dither(r1, False), _dither(r3, False)))
    high = tl.join(tl.join(_dither(r0, True), _dither(r2, True)),
                   tl.join(_dither(r1, True), _dither(r3, True)))
    return tl.reshape(tl.join(low, high), [ROWS, COLS])


@triton.jit
def _column_dithers(seed, cols, row_start, M, R: tl.constexpr):
    """Dithers of the 16 row slices of a tile in the columnwise [K, M] layout (slice j holds
    rows 16 r + j): the same counter rule as _row_dithers (offset c * M + m, divided by 8), so
    run (r, c) takes two Philox calls, slices 8q + 2k + h half h of output k of call q."""
    runs = row_start // 8 + 2 * tl.arange(0, R)
    counters = cols[None, :].to(tl.int64) * (M // 8) + runs[:, None]
    dithers = ()
    for q in tl.static_range(2):
        draws = tl.randint4x(seed, counters + q)
        for k in tl.static_range(4):
            dithers = dithers + (_dither(draws[k], False), _dither(draws[k], True))
    return dithers


@triton.jit
def _load_seed(seed_ptr, STOCHASTIC: tl.constexpr):
    """The Philox seed of one direction; without stochastic rounding nothing is read (the
    pointer may then be any tensor)."""
    return tl.load(seed_ptr) if STOCHASTIC else 0


@triton.jit
def _quantize_rows_1x16(
    v, amax_ptr, seed, rows, col_start, C, ROWS: tl.constexpr, COLS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """NVFP4 1x16 along the last dim of fp32 v [ROWS, COLS] (rows `rows`, columns from
    col_start of an [R, C] tensor): (packed data [ROWS, COLS // 2] uint8, scale codes
    [ROWS, COLS // 16] uint8)."""
    factor, s_dec = global_scales(amax_ptr)
    runs = tl.reshape(magnitude_bits(v), [ROWS, COLS // 16, 16])
    block_amax = tl.max(runs, axis=2).to(tl.float32, bitcast=True)
    scale_code, element_scale = block_scales(block_amax, factor, s_dec)
    dither = _row_dithers(seed, rows, col_start, C, ROWS, COLS) if STOCHASTIC else 0.0
    codes = _e2m1_nibbles(v, expand_blocks(element_scale, ROWS, COLS, 16), dither, STOCHASTIC)
    keep = expand_blocks(element_scale == element_scale, ROWS, COLS // 2, 8)  # not NaN
    return tl.where(keep, pack_nibbles(codes, ROWS, COLS), 0), scale_code.to(tl.uint8)


@triton.jit
def _load_tile(
    x_ptr, M, K, tile_m, tile_k, BF16_BITS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Tile (tile_m, tile_k) of x as fp32, with its row/column indices and origin. Masked
    elements load as 0: they cannot raise an amax (nor change a transform run), and with M, K
    multiples of 16 every 16-element block or run is entirely inside the tensor or entirely
    outside (never stored)."""
    row_start = tile_m * BLOCK_M
    col_start = tile_k * BLOCK_K
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = col_start + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    offsets = rows[:, None].to(tl.int64) * K + cols[None, :]
    x = load_as_float(x_ptr, offsets, mask, BF16_BITS)
    return x, rows, cols, row_start, col_start


@triton.jit
def _load_slices(
    x_ptr, M, K, tile_m, tile_k, BF16_BITS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Tile (tile_m, tile_k) of x as a 16-tuple of fp32 slices [BLOCK_M // 16, BLOCK_K], slice j
    holding rows row_start + 16 r + j, so that element (r, c) across the slices is the aligned
    run of 16 along M that a columnwise block (and an RHT run) covers; with its column indices
    and origin. Masking as in _load_tile (a run is inside the tensor or outside)."""
    row_start = tile_m * BLOCK_M
    col_start = tile_k * BLOCK_K
    run_rows = row_start + 16 * tl.arange(0, BLOCK_M // 16)
    cols = col_start + tl.arange(0, BLOCK_K)
    mask = (run_rows[:, None] < M) & (cols[None, :] < K)
    offsets = run_rows[:, None].to(tl.int64) * K + cols[None, :]
    slices = ()
    for j in tl.static_range(16):
        slices = slices + (load_as_float(x_ptr, offsets + j * K, mask, BF16_BITS),)
    return slices, cols, row_start, col_start


@triton.jit
def _slices_peak_bits(slices):
    """Elementwise max of the magnitude bits of a 16-tuple of fp32 tensors: each run's amax."""
    peak = magnitude_bits(slices[0])
    for j in tl.static_range(1, 16):
        peak = tl.maximum(peak, magnitude_bits(slices[j]))
    return peak


@triton.jit
def _quantize_column_slices(
    slices, amax_ptr, seed, cols, row_start, M, R: tl.constexpr, BLOCK_K: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """NVFP4 1x16 along M of the runs held across 16 row slices [R, BLOCK_K]: the 16 nibbles of
    run (r, c) as two int32 words (rows 16 r .. 16 r + 7 in the low word, element 2i in the low
    nibble of byte i, as the [K, M / 2] layout stores them) and its scale code, all [R, BLOCK_K].
    Every step is elementwise across the slices: no transpose."""
    factor, s_dec = global_scales(amax_ptr)
    run_amax = _slices_peak_bits(slices).to(tl.float32, bitcast=True)
    scale_code, element_scale = block_scales(run_amax, factor, s_dec)
    dithers = _column_dithers(seed, cols, row_start, M, R) if STOCHASTIC else slices
    low = tl.zeros([R, BLOCK_K], tl.int32)
    high = tl.zeros([R, BLOCK_K], tl.int32)
    for j in tl.static_range(16):
        nibble = _e2m1_nibbles(slices[j], element_scale, dithers[j], STOCHASTIC)
        if j < 8:
            low = low | (nibble << (4 * j))
        else:
            high = high | (nibble << (4 * (j - 8)))
    keep = element_scale == element_scale  # a NaN run encodes as +0 nibbles
    return tl.where(keep, low, 0), tl.where(keep, high, 0), scale_code.to(tl.uint8)


@triton.jit
def _store_column_words(
    data_ptr, scale_ptr, low, high, scale, cols, row_start, K, M, R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Store the words and scales of _quantize_column_slices into the [K, M / 2] data and
    [K, M / 16] scale layouts. A run is 8 bytes (two aligned int32 words) at byte c * M / 2 +
    m / 2 of its column c, so a column's R runs are 8 R contiguous bytes: the words are turned
    to [BLOCK_K, 2 R] first (a small transpose of packed words, not of the values) so that the
    stores are contiguous runs rather than one scattered word per run."""
    words = tl.reshape(tl.permute(tl.join(low, high), [1, 0, 2]), [BLOCK_K, 2 * R])
    word_cols = row_start // 8 + tl.arange(0, 2 * R)
    word_mask = (cols[:, None] < K) & (word_cols[None, :] < M // 8)
    offsets = cols[:, None].to(tl.int64) * (M // 8) + word_cols[None, :]
    tl.store(data_ptr.to(tl.pointer_type(tl.int32)) + offsets, words, mask=word_mask)
    runs = row_start // 16 + tl.arange(0, R)
    scale_mask = (cols[:, None] < K) & (runs[None, :] < M // 16)
    scale_offsets = cols[:, None].to(tl.int64) * (M // 16) + runs[None, :]
    tl.store(scale_ptr + scale_offsets, tl.trans(scale), mask=scale_mask)


@triton.jit
def _store_packed(data_ptr, scale_ptr, data, scale, rows, col_start, R, C, COLS: tl.constexpr):
    """Store a tile's packed data [len(rows), COLS / 2] and scale bytes [len(rows), COLS / 16]
    into the [R, C / 2] and [R, C / 16] layouts; the tile starts at unpacked column col_start."""
    byte_cols = col_start // 2 + tl.arange(0, COLS // 2)
    data_offsets = rows[:, None].to(tl.int64) * (C // 2) + byte_cols[None, :]
    data_mask = (rows[:, None] < R) & (byte_cols[None, :] < C // 2)
    tl.store(data_ptr + data_offsets, data, mask=data_mask)
    scale_cols = col_start // 16 + tl.arange(0, COLS // 16)
    scale_offsets = rows[:, None].to(tl.int64) * (C // 16) + scale_cols[None, :]
    scale_mask = (rows[:, None] < R) & (scale_cols[None, :] < C // 16)
    tl.store(scale_ptr + scale_offsets, scale, mask=scale_mask)


# ---- per-tile bodies (shared with the multi-tensor kernels) ----


@triton.jit
def amax_tile(
    x_ptr, amax_bits_ptr, M, K, tile_m, tile_k, BF16_BITS: tl.constexpr, PLAIN: tl.constexpr,
    RHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """amax_bits[0] = bits of max|x|; amax_bits[1] = bits of max|RHT(x^T)| (int32 atomics on
    non-negative float bits, which order like the floats, NaN on top). With the RHT the tile is
    read as row slices, whose butterflies are elementwise (hadamard.py)."""
    if RHT:
        slices, cols, row_start, col_start = _load_slices(
            x_ptr, M, K, tile_m, tile_k, BF16_BITS, BLOCK_M, BLOCK_K
        )
        if PLAIN:
            peak = _slices_peak_bits(slices)
            tl.atomic_max(amax_bits_ptr, tl.max(tl.max(peak, axis=1), axis=0))
        tl.atomic_max(amax_bits_ptr + 1, rht16_peak_bits(slices))
    else:
        x, rows, cols, row_start, col_start = _load_tile(
            x_ptr, M, K, tile_m, tile_k, BF16_BITS, BLOCK_M, BLOCK_K
        )
        tl.atomic_max(amax_bits_ptr, tl.max(tl.max(magnitude_bits(x), axis=1), axis=0))


@triton.jit
def quantize_1d_tile(
    x_ptr, row_data_ptr, row_scale_ptr, row_amax_ptr, col_data_ptr, col_scale_ptr, col_amax_ptr,
    seed_ptr, M, K, tile_m, tile_k, BF16_BITS: tl.constexpr, ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr, RHT: tl.constexpr, STOCHASTIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HW: tl.constexpr,
):
    """Rowwise 1x16 along K (from the tile) and columnwise 1x16 along M of x^T, optionally after
    the RHT (from the tile's row slices: elementwise runs, no transpose of the values).
    seed_ptr[0] keys the rowwise draws, seed_ptr[1] the columnwise ones."""
    if ROWWISE:
        x, rows, cols, row_start, col_start = _load_tile(
            x_ptr, M, K, tile_m, tile_k, BF16_BITS, BLOCK_M, BLOCK_K
        )
        seed = _load_seed(seed_ptr, STOCHASTIC)
        data, scale = _quantize_rows_1x16(
            x, row_amax_ptr, seed, rows, col_start, K, BLOCK_M, BLOCK_K, STOCHASTIC
        )
        _store_packed(row_data_ptr, row_scale_ptr, data, scale, rows, col_start, M, K, BLOCK_K)
    if COLUMNWISE:
        slices, cols, row_start, col_start = _load_slices(
            x_ptr, M, K, tile_m, tile_k, BF16_BITS, BLOCK_M, BLOCK_K
        )
        if RHT:
            slices = rht16_slices(slices, HW)
        seed = _load_seed(seed_ptr + 1, STOCHASTIC)
        low, high, scale = _quantize_column_slices(
            slices, col_amax_ptr, seed, cols, row_start, M, BLOCK_M // 16, BLOCK_K, STOCHASTIC
        )
        _store_column_words(
            col_data_ptr, col_scale_ptr, low, high, scale, cols, row_start, K, M, BLOCK_M // 16,
            BLOCK_K,
        )


# ---- kernels: one program per tile, grid (M tiles, K tiles) ----


@triton.jit
def _nvfp4_amax_kernel(
    x_ptr, amax_bits_ptr, M, K, BF16_BITS: tl.constexpr, PLAIN: tl.constexpr, RHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    amax_tile(
        x_ptr, amax_bits_ptr, M, K, tl.program_id(0), tl.program_id(1),
        BF16_BITS, PLAIN, RHT, BLOCK_M, BLOCK_K,
    )


@triton.jit
def _nvfp4_1d_kernel(
    x_ptr, row_data_ptr, row_scale_ptr, row_amax_ptr, col_data_ptr, col_scale_ptr, col_amax_ptr,
    seed_ptr, M, K, BF16_BITS: tl.constexpr, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
    RHT: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    HW: tl.constexpr,
):
    quantize_1d_tile(
        x_ptr, row_data_ptr, row_scale_ptr, row_amax_ptr, col_data_ptr, col_scale_ptr,
        col_amax_ptr, seed_ptr, M, K, tl.program_id(0), tl.program_id(1),
        BF16_BITS, ROWWISE, COLUMNWISE, RHT, STOCHASTIC, BLOCK_M, BLOCK_K, HW,
    )


@triton.jit
def _nvfp4_2d_kernel(
    x_ptr, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, amax_ptr, seed_ptr, M, K,
    BF16_BITS: tl.constexpr, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
    STOCHASTIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """16x16 tiles: one scale per tile, replicated over its 16 scale rows; the columnwise copy is
    the nibble transpose of the rowwise codes (the same codes, even with stochastic rounding)."""
    x, rows, cols, row_start, col_start = _load_tile(
        x_ptr, M, K, tl.program_id(0), tl.program_id(1), BF16_BITS, BLOCK_M, BLOCK_K
    )
    factor, s_dec = global_scales(amax_ptr)
    tiles = tl.reshape(magnitude_bits(x), [BLOCK_M // 16, 16, BLOCK_K // 16, 16])
    tile_amax = tl.max(tl.max(tiles, axis=3), axis=1).to(tl.float32, bitcast=True)
    scale_code, element_scale = block_scales(tile_amax, factor, s_dec)  # [BM/16, BK/16]
    element_scale = tl.reshape(
        tl.broadcast_to(element_scale[:, None, :, None], [BLOCK_M // 16, 16, BLOCK_K // 16, 16]),
        [BLOCK_M, BLOCK_K],
    )
    seed = _load_seed(seed_ptr, STOCHASTIC)
    dither = _row_dithers(seed, rows, col_start, K, BLOCK_M, BLOCK_K) if STOCHASTIC else 0.0
    codes = _e2m1_nibbles(x, element_scale, dither, STOCHASTIC)
    codes = tl.where(element_scale == element_scale, codes, 0)  # NaN tiles encode as +0
    scale_code = scale_code.to(tl.uint8)
    if ROWWISE:
        row_scale = tl.reshape(
            tl.broadcast_to(scale_code[:, None, :], [BLOCK_M // 16, 16, BLOCK_K // 16]),
            [BLOCK_M, BLOCK_K // 16],
        )
        data = pack_nibbles(codes, BLOCK_M, BLOCK_K)
        _store_packed(
            row_data_ptr, row_scale_ptr, data, row_scale, rows, col_start, M, K, BLOCK_K
        )
    if COLUMNWISE:
        col_scale = tl.reshape(
            tl.broadcast_to(tl.trans(scale_code)[:, None, :], [BLOCK_K // 16, 16, BLOCK_M // 16]),
            [BLOCK_K, BLOCK_M // 16],
        )
        data = pack_nibbles(tl.trans(codes), BLOCK_K, BLOCK_M)
        _store_packed(
            col_data_ptr, col_scale_ptr, data, col_scale, cols, row_start, K, M, BLOCK_M
        )


# ---- host entry ----


def empty_buffers(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised packed data [rows, cols/2] and scale bytes [rows, cols/16]."""
    data = torch.empty((rows, cols // 2), dtype=torch.uint8, device=device)
    scale = torch.empty((rows, cols // BLOCK), dtype=torch.uint8, device=device)
    return data, scale


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    two_dimensional: bool = False,
    with_rht: bool = False,
    stochastic_rounding: bool = False,
    reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Drop-in for numerics.quantize_nvfp4 on a contiguous float32/bfloat16/float16 tensor: the
    same dict of buffers and, with round-to-nearest, the same bytes.

    `reduce_amax` is applied to each device amax between the amax kernel and the cast kernel,
    in the reference's order (plain amax first, then the post-RHT amax). Stochastic rounding takes
    two seeds from torch's generator on x's device (one per direction) without a host sync.
    """
    if two_dimensional and with_rht:
        raise ValueError("NVFP4 2D (weight) quantization takes no RHT: disable one of them")
    if not x.is_contiguous():
        raise ValueError("the NVFP4 kernel needs a contiguous input; call .contiguous() first")
    x2d = as_2d(x)
    m, k = x2d.shape
    require_divisible((m, k), BLOCK, "NVFP4")
    reduce_amax = reduce_amax or (lambda amax: amax)
    device = x.device
    need_plain = rowwise or two_dimensional or not with_rht
    need_rht = columnwise and with_rht and not two_dimensional
    grid = (cdiv(m, BLOCK_M), cdiv(k, BLOCK_K))

    x_view, bf16_bits = kernel_view(x2d)
    amax_bits = torch.zeros(2, dtype=torch.int32, device=device)
    if m * k and (need_plain or need_rht):
        launch(
            _nvfp4_amax_kernel, grid, x_view, amax_bits, m, k, BF16_BITS=bf16_bits,
            PLAIN=need_plain, RHT=need_rht, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
            num_warps=AMAX_NUM_WARPS, options={"enable_fp_fusion": FP_FUSION},
        )
    amaxes = amax_bits.view(torch.float32)
    plain_amax = reduce_amax(amaxes[0]).float().reshape(()) if need_plain else None
    col_amax = reduce_amax(amaxes[1]).float().reshape(()) if need_rht else plain_amax

    # one Philox seed per direction from torch's generator (no host sync); unread without SR
    seeds = amax_bits
    if stochastic_rounding:
        seeds = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)
    dummy = torch.empty(0, dtype=torch.uint8, device=device)
    row_data = row_scale = col_data = col_scale = dummy
    if rowwise:
        row_data, row_scale = empty_buffers(m, k, device)
    if columnwise:
        col_data, col_scale = empty_buffers(k, m, device)
    if m * k and (rowwise or columnwise):
        common = dict(
            BF16_BITS=bf16_bits, ROWWISE=rowwise, COLUMNWISE=columnwise,
            STOCHASTIC=stochastic_rounding,
        )
        if two_dimensional and WORDS_2D and takes_words_2d(
            x2d, stochastic_rounding, WORDS_BLOCK_M_2D, WORDS_BLOCK_K_2D
        ):
            launch_2d_words(
                x2d, row_data, row_scale, col_data, col_scale, plain_amax, rowwise, columnwise,
                WORDS_BLOCK_M_2D, WORDS_BLOCK_K_2D, WORDS_NUM_WARPS_2D, hw_cast(x2d), FP_FUSION,
            )
        elif two_dimensional:
            grid_2d = (cdiv(m, BLOCK_M_2D), cdiv(k, BLOCK_K_2D))
            launch(
                _nvfp4_2d_kernel, grid_2d, x_view, row_data, row_scale, col_data, col_scale,
                plain_amax, seeds, m, k,
                BLOCK_M=BLOCK_M_2D, BLOCK_K=BLOCK_K_2D,
                num_warps=NUM_WARPS_STOCHASTIC if stochastic_rounding else NUM_WARPS_2D,
                options={"enable_fp_fusion": FP_FUSION}, **common,
            )
        else:
            launch(
                _nvfp4_1d_kernel, grid, x_view, row_data, row_scale,
                plain_amax if need_plain else col_amax,
                col_data, col_scale, col_amax, seeds, m, k, RHT=need_rht, HW=hw_cast(x),
                BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
                num_warps=NUM_WARPS_STOCHASTIC if stochastic_rounding else NUM_WARPS,
                options={"enable_fp_fusion": FP_FUSION}, **common,
            )

    out: dict[str, torch.Tensor] = {}
    if rowwise:
        out["rowwise_data"] = row_data
        out["rowwise_scale"] = row_scale.view(torch.float8_e4m3fn)
        out["amax_rowwise"] = plain_amax.reshape(1)
    if columnwise:
        out["columnwise_data"] = col_data
        out["columnwise_scale"] = col_scale.view(torch.float8_e4m3fn)
        out["amax_columnwise"] = col_amax.reshape(1).clone()
    return out
