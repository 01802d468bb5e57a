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

Layouts are the reference's compact ones: rowwise data [M, K/2] (element 2j in the low nibble),
scales [M, K/16]; columnwise data [K, M/2], scales [K, M/16]; 2D tile scales replicated over
their 16 scale rows. Stochastic rounding draws Philox bits (tl.randint4x, one call per four
elements) keyed by a seed that
torch's generator writes into a device tensor, one seed per direction (reproducible under
torch.manual_seed, statistically equivalent to the reference, not byte-equal: NUMERICS.md §7).

Imported lazily by the NVFP4 quantizer once `minifloat.kernels.available(x)` holds.
"""

import struct
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..numerics.blocks import as_2d, require_divisible
from ..numerics.nvfp4 import BLOCK, GLOBAL_SCALE_NUMERATOR, ONE_SIXTH_FP32
from .element_cast import (
    E2M1_CONSTANTS,
    E4M3_CONSTANTS,
    FP8_NAN_CODE,
    e4m3_code_to_float,
    expand_blocks,
    is_nan_bits,
    kernel_view,
    load_as_float,
    magnitude_bits,
    pack_nibbles,
    round_to_code,
    sign_bit,
    split_magnitude,
)
from .hadamard import rht16_rows

# 64 x 64 tiles: columnwise stores are 32-byte runs like the rowwise ones (a tile row packs 64
# elements). ptxas for sm_90, both directions with the RHT: 8 warps use about 128 registers (4
# warps hit 255), stochastic rounding about 190 with 8 warps and 104 with 16, no spills.
BLOCK_M = 64
BLOCK_K = 64
NUM_WARPS = 8
NUM_WARPS_2D = 4  # swept on an H100 (KERNEL_NOTES.md): 0.343 ms with 4 warps, 0.379 with 8
NUM_WARPS_STOCHASTIC = 8  # with the lean SR path: 1.49 ms with 8 warps, 1.94 with 16

E2M1_MANTISSA, E2M1_MIN_EXPONENT, E2M1_MAX_CODE = (tl.constexpr(c) for c in E2M1_CONSTANTS)
UE4M3_MANTISSA, UE4M3_MIN_EXPONENT, UE4M3_MAX_CODE = (tl.constexpr(c) for c in E4M3_CONSTANTS)
GLOBAL_NUMERATOR = tl.constexpr(GLOBAL_SCALE_NUMERATOR)
ONE_SIXTH_BITS = tl.constexpr(struct.unpack("<i", struct.pack("<f", ONE_SIXTH_FP32))[0])
FLT_MAX_BITS = tl.constexpr(0x7F7FFFFF)


# ---- device functions: scales and element codes ----


@triton.jit
def _flt_max_like(x):
    return tl.full(x.shape, FLT_MAX_BITS, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _cap_at_flt_max(x):
    """min(x, FLT_MAX) that keeps NaN (torch.clamp's rule; tl.minimum may drop NaN)."""
    return tl.where(x > _flt_max_like(x), _flt_max_like(x), x)


@triton.jit
def _global_scales(amax_ptr):
    """(S_enc * fp32(1/6), S_dec) from the global amax A in device memory.

    S_enc = 2688 / A as one correctly rounded division (div_rn, not Triton's default division);
    1 when A is 0 or the quotient is 0; capped at FLT_MAX keeping NaN. S_dec = 1 / S_enc.
    """
    amax = tl.load(amax_ptr)
    s_enc = tl.div_rn(tl.full([], GLOBAL_NUMERATOR, tl.float32), amax)
    s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    s_enc = _cap_at_flt_max(s_enc)
    s_dec = tl.div_rn(tl.full([], 1.0, tl.float32), s_enc)
    one_sixth = tl.full([], ONE_SIXTH_BITS, tl.int32).to(tl.float32, bitcast=True)
    return s_enc * one_sixth, s_dec


@triton.jit
def _block_scales(block_amax, factor, s_dec):
    """UE4M3 scale codes and fp32 element scales for block amaxes (any shape).

    s_b = ue4m3_sat_rne(min(block_amax * factor, FLT_MAX)); NaN gives the NaN code 0x7F.
    element scale = min(1 / (fp32(s_b) * S_dec), FLT_MAX), one correctly rounded division.
    """
    value = _cap_at_flt_max(block_amax * factor)
    magnitude = magnitude_bits(value)
    mantissa, exponent = split_magnitude(magnitude)
    code = round_to_code(mantissa, exponent, UE4M3_MANTISSA, UE4M3_MIN_EXPONENT, UE4M3_MAX_CODE)
    code = tl.where(is_nan_bits(magnitude), FP8_NAN_CODE, code)
    decoded = e4m3_code_to_float(code)
    element_scale = tl.div_rn(tl.full(decoded.shape, 1.0, tl.float32), decoded * s_dec)
    return code, _cap_at_flt_max(element_scale)


@triton.jit
def _e2m1_rne(a):
    """E2M1 magnitude codes (int32) of fp32 magnitudes a, round to nearest even, saturating:
    the count of rounding thresholds a lies past. The grid is 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes
    0..7); a tie goes to the even code, so a threshold below an even code is inclusive (>=) and
    one above it exclusive (>). NaN passes no threshold (code 0); infinities pass all (7).
    Seven float compares instead of integer rounding: same codes as round_to_code."""
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    return code + (a > 5.0).to(tl.int32)


@triton.jit
def _e2m1_stochastic(a, seed, offsets, ROWS: tl.constexpr, COLS: tl.constexpr):
    """E2M1 magnitude codes of fp32 magnitudes a [ROWS, COLS], rounded up with probability equal
    to the discarded fraction (NUMERICS.md §7), saturating at 6 (code 7).

    The lower neighbour is the count of grid points <= a; the fraction (a - lower) / step is
    exact in fp32 (Sterbenz subtraction, times a power of two) and compared with 24 uniform bits.
    One Philox call (tl.randint4x) serves four consecutive elements: offsets of a group of four
    (aligned, as every row starts at a multiple of 16) share the counter offset // 4 and take
    its four 32-bit outputs, so each element still gets its own independent draw."""
    lower_code = (a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
    lower_code += (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
    lower_code += (a >= 6.0).to(tl.int32)
    inverse_step = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
    lower = tl.where(lower_code < 4, lower_code.to(tl.float32) * 0.5,
                     tl.where(lower_code < 6, lower_code.to(tl.float32) - 2.0,
                              tl.where(lower_code == 6, 4.0, 6.0)))
    fraction = (a - lower) * inverse_step  # exact: a power of two
    quads = tl.reshape(offsets, [ROWS, COLS // 4, 2, 2])
    first, _ = tl.split(tl.split(quads)[0])
    r0, r1, r2, r3 = tl.randint4x(seed, first // 4)
    draws = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [ROWS, COLS])
    uniform = ((draws >> 8) & 0xFFFFFF).to(tl.float32)  # 24 bits, exact in fp32
    round_up = uniform < fraction * 16777216.0
    return tl.minimum(lower_code + round_up.to(tl.int32), E2M1_MAX_CODE)


@triton.jit
def _e2m1_codes(v, element_scale, seed, offsets, STOCHASTIC: tl.constexpr, ROWS: tl.constexpr,
                COLS: tl.constexpr):
    """E2M1 nibbles (int32) of v * element_scale (fp32 product), sign in bit 3.

    NaN (a NaN element, or a NaN block scale) encodes as +0, like numerics.encode_e2m1: the NaN
    lives in the block scale. With STOCHASTIC, Philox bits at `offsets` under `seed` pick the
    rounding direction.
    """
    y = v * element_scale
    magnitude = magnitude_bits(y)
    a = magnitude.to(tl.float32, bitcast=True)
    code = _e2m1_stochastic(a, seed, offsets, ROWS, COLS) if STOCHASTIC else _e2m1_rne(a)
    code = code | (sign_bit(y) << 3)
    return tl.where(is_nan_bits(magnitude), 0, code)


@triton.jit
def _load_seed(seed_ptr, STOCHASTIC: tl.constexpr):
    """The Philox seed of one direction; without stochastic rounding nothing is read (the
    pointer may then be any tensor)."""
    return tl.load(seed_ptr) if STOCHASTIC else 0


@triton.jit
def _quantize_rows_1x16(
    v,
    amax_ptr,
    seed,
    offsets,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """NVFP4 1x16 along the last dim of fp32 v [ROWS, COLS]:
    (packed data [ROWS, COLS // 2] uint8, scale codes [ROWS, COLS // 16] uint8)."""
    factor, s_dec = _global_scales(amax_ptr)
    runs = tl.reshape(magnitude_bits(v), [ROWS, COLS // 16, 16])
    block_amax = tl.max(runs, axis=2).to(tl.float32, bitcast=True)
    scale_code, element_scale = _block_scales(block_amax, factor, s_dec)
    codes = _e2m1_codes(
        v, expand_blocks(element_scale, ROWS, COLS, 16), seed, offsets, STOCHASTIC, ROWS, COLS
    )
    return pack_nibbles(codes, ROWS, COLS), scale_code.to(tl.uint8)


@triton.jit
def _load_tile(
    x_ptr,
    M,
    K,
    tile_m,
    tile_k,
    BF16_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
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
    x_ptr,
    amax_bits_ptr,
    M,
    K,
    tile_m,
    tile_k,
    BF16_BITS: tl.constexpr,
    PLAIN: tl.constexpr,
    RHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """amax_bits[0] = bits of max|x|; amax_bits[1] = bits of max|RHT(x^T)| (int32 atomics on
    non-negative float bits, which order like the floats, NaN on top)."""
    x, rows, cols, row_start, col_start = _load_tile(
        x_ptr, M, K, tile_m, tile_k, BF16_BITS, BLOCK_M, BLOCK_K
    )
    if PLAIN:
        tl.atomic_max(amax_bits_ptr, tl.max(tl.max(magnitude_bits(x), axis=1), axis=0))
    if RHT:
        transformed = rht16_rows(tl.trans(x), BLOCK_K, BLOCK_M)
        peak = tl.max(tl.max(magnitude_bits(transformed), axis=1), axis=0)
        tl.atomic_max(amax_bits_ptr + 1, peak)


@triton.jit
def quantize_1d_tile(
    x_ptr,
    row_data_ptr,
    row_scale_ptr,
    row_amax_ptr,
    col_data_ptr,
    col_scale_ptr,
    col_amax_ptr,
    seed_ptr,
    M,
    K,
    tile_m,
    tile_k,
    BF16_BITS: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    RHT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Rowwise 1x16 along K and columnwise 1x16 along M of x^T (optionally after the RHT), from
    one load of the tile. seed_ptr[0] keys the rowwise draws, seed_ptr[1] the columnwise ones."""
    x, rows, cols, row_start, col_start = _load_tile(
        x_ptr, M, K, tile_m, tile_k, BF16_BITS, BLOCK_M, BLOCK_K
    )
    if ROWWISE:
        seed = _load_seed(seed_ptr, STOCHASTIC)
        offsets = rows[:, None].to(tl.int64) * K + cols[None, :]
        data, scale = _quantize_rows_1x16(
            x, row_amax_ptr, seed, offsets, BLOCK_M, BLOCK_K, STOCHASTIC
        )
        _store_packed(row_data_ptr, row_scale_ptr, data, scale, rows, col_start, M, K, BLOCK_K)
    if COLUMNWISE:
        seed = _load_seed(seed_ptr + 1, STOCHASTIC)
        x_t = tl.trans(x)  # [BLOCK_K, BLOCK_M]: runs of 16 along M are now along the last dim
        if RHT:
            x_t = rht16_rows(x_t, BLOCK_K, BLOCK_M)
        offsets = cols[:, None].to(tl.int64) * M + rows[None, :]
        data, scale = _quantize_rows_1x16(
            x_t, col_amax_ptr, seed, offsets, BLOCK_K, BLOCK_M, STOCHASTIC
        )
        _store_packed(col_data_ptr, col_scale_ptr, data, scale, cols, row_start, K, M, BLOCK_M)


# ---- kernels: one program per tile, grid (M tiles, K tiles) ----


@triton.jit
def _nvfp4_amax_kernel(
    x_ptr,
    amax_bits_ptr,
    M,
    K,
    BF16_BITS: tl.constexpr,
    PLAIN: tl.constexpr,
    RHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    amax_tile(
        x_ptr, amax_bits_ptr, M, K, tl.program_id(0), tl.program_id(1),
        BF16_BITS, PLAIN, RHT, BLOCK_M, BLOCK_K,
    )


@triton.jit
def _nvfp4_1d_kernel(
    x_ptr,
    row_data_ptr,
    row_scale_ptr,
    row_amax_ptr,
    col_data_ptr,
    col_scale_ptr,
    col_amax_ptr,
    seed_ptr,
    M,
    K,
    BF16_BITS: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    RHT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    quantize_1d_tile(
        x_ptr, row_data_ptr, row_scale_ptr, row_amax_ptr, col_data_ptr, col_scale_ptr,
        col_amax_ptr, seed_ptr, M, K, tl.program_id(0), tl.program_id(1),
        BF16_BITS, ROWWISE, COLUMNWISE, RHT, STOCHASTIC, BLOCK_M, BLOCK_K,
    )


@triton.jit
def _nvfp4_2d_kernel(
    x_ptr,
    row_data_ptr,
    row_scale_ptr,
    col_data_ptr,
    col_scale_ptr,
    amax_ptr,
    seed_ptr,
    M,
    K,
    BF16_BITS: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """16x16 tiles: one scale per tile, replicated over its 16 scale rows; the columnwise copy is
    the nibble transpose of the rowwise codes (the same codes, even with stochastic rounding)."""
    x, rows, cols, row_start, col_start = _load_tile(
        x_ptr, M, K, tl.program_id(0), tl.program_id(1), BF16_BITS, BLOCK_M, BLOCK_K
    )
    factor, s_dec = _global_scales(amax_ptr)
    tiles = tl.reshape(magnitude_bits(x), [BLOCK_M // 16, 16, BLOCK_K // 16, 16])
    tile_amax = tl.max(tl.max(tiles, axis=3), axis=1).to(tl.float32, bitcast=True)
    scale_code, element_scale = _block_scales(tile_amax, factor, s_dec)  # [BM/16, BK/16]
    element_scale = tl.reshape(
        tl.broadcast_to(element_scale[:, None, :, None], [BLOCK_M // 16, 16, BLOCK_K // 16, 16]),
        [BLOCK_M, BLOCK_K],
    )
    seed = _load_seed(seed_ptr, STOCHASTIC)
    offsets = rows[:, None].to(tl.int64) * K + cols[None, :]
    codes = _e2m1_codes(x, element_scale, seed, offsets, STOCHASTIC, BLOCK_M, BLOCK_K)
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
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(k, BLOCK_K))

    x_view, bf16_bits = kernel_view(x2d)
    amax_bits = torch.zeros(2, dtype=torch.int32, device=device)
    if m * k and (need_plain or need_rht):
        _nvfp4_amax_kernel[grid](
            x_view, amax_bits, m, k, BF16_BITS=bf16_bits, PLAIN=need_plain, RHT=need_rht,
            BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
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
            STOCHASTIC=stochastic_rounding, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
            num_warps=NUM_WARPS_STOCHASTIC if stochastic_rounding else (
                NUM_WARPS_2D if two_dimensional else NUM_WARPS),
        )
        if two_dimensional:
            _nvfp4_2d_kernel[grid](
                x_view, row_data, row_scale, col_data, col_scale, plain_amax, seeds, m, k, **common
            )
        else:
            _nvfp4_1d_kernel[grid](
                x_view, row_data, row_scale, plain_amax if need_plain else col_amax,
                col_data, col_scale, col_amax, seeds, m, k, RHT=need_rht, **common,
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
