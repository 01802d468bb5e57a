"""MXFP8 quantization in Triton (NUMERICS.md §5), bit-exact against numerics.mxfp8.

One pass over the input: each program loads a BLOCK_M x BLOCK_K tile once and writes whichever
copies are asked for. Both copies keep the [M, K] layout of the input (no transpose):
- rowwise: 1x32 blocks along K -> data [M, K], E8M0 scales [M, K/32]
- columnwise: 32x1 blocks along M -> data [M, K], E8M0 scales [M/32, K]
Scales are compact (no padding), as numerics stores them. Elements are rounded with the integer
casts of element_cast (Triton's float8 conversions do not match the contract everywhere).

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
from .fp8_common import cvt_sat_rne_fp8, hw_cast
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
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(k, BLOCK_K))
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
