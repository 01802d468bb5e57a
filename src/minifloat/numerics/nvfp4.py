"""NVFP4 (NUMERICS.md §6): E2M1 elements, UE4M3 scales per 16 elements, one fp32 global scale.

Storage layout (compact):
- rowwise: data [M, K/2] packed E2M1, scale [M, K/16] UE4M3 (float8_e4m3fn), amax_rowwise A
- columnwise: quantization of x^T: data [K, M/2], scale [K, M/16], amax_columnwise
- 2D (weights): 16x16 tiles; each tile's scale is replicated over its 16 scale rows, so the
  columnwise copy is the exact nibble transpose of the rowwise one (derivable both ways).
Tensors keep the global amax A, not S_enc: `global_encode_scale` recomputes the encode scale.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from .blocks import as_2d, expand_tiles, require_divisible, tile_amax
from .formats import (
    FLT_MAX,
    UE4M3,
    cast_to_e2m1,
    cast_to_fp8,
    e2m1_to_float,
    fp32_divide,
    fp32_round,
    pack_nibbles,
    unpack_nibbles,
)
from .hadamard import random_hadamard_transform
from .per_tensor import compute_amax

BLOCK = 16
GLOBAL_SCALE_NUMERATOR = 2688.0  # 448 (UE4M3 max) * 6 (E2M1 max)
ONE_SIXTH_FP32 = fp32_round(1.0 / 6.0)  # fp32(1/6) as a Python float: see quantize_blocks


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 2688 / A in fp32; 1 when A is 0 or the quotient is 0 (A = inf); capped at FLT_MAX."""
    amax = amax.float()
    s_enc = fp32_divide(GLOBAL_SCALE_NUMERATOR, amax)
    s_enc = torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)
    return torch.clamp(s_enc, max=FLT_MAX)  # clamp keeps NaN (a NaN amax poisons everything)


def global_decode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_dec = 1 / S_enc."""
    return torch.reciprocal(global_encode_scale(amax))


def quantize_blocks(
    x2d: torch.Tensor,
    amax: torch.Tensor,
    *,
    tile_rows: int,
    stochastic: bool,
    generator: torch.Generator | None = None,
    block_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [R, C] along C in 1x16 blocks (tile_rows=1) or 16x16 tiles (tile_rows=16):
    (packed data, compact scales). `amax` is the global amax: 0-dim, or one per block
    broadcast over the block grid [R / tile_rows, C / 16] (a grouped operand whose groups each
    have their own global scale: an [R / tile_rows, 1] column or a [1, C / 16] row)."""
    s_dec = torch.reciprocal(global_encode_scale(amax))
    if block_amax is None:
        block_amax = tile_amax(x2d, tile_rows, BLOCK)
    block_scale = block_scales(block_amax, amax)
    # q = e2m1(x * min(1 / (fp32(s_b) * S_dec), FLT_MAX))
    element_scale = torch.clamp(torch.reciprocal(block_scale.float() * s_dec), max=FLT_MAX)
    scaled = x2d.float() * expand_tiles(element_scale, tile_rows, BLOCK, x2d.shape)
    data = cast_to_e2m1(scaled, stochastic=stochastic, generator=generator)
    # compact scale layout: one scale per row and 16-column block (2D tiles replicate theirs)
    scale = expand_tiles(block_scale, tile_rows, 1, (x2d.shape[0], block_scale.shape[1]))
    return data, scale.contiguous()


def block_scales(block_amax: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Each block's UE4M3 scale from its absolute maximum and the global amax:
    s_b = ue4m3(min(block_amax * (S_enc * fp32(1/6)), FLT_MAX)), the product S_enc/6 first."""
    scale_factor = global_encode_scale(amax) * ONE_SIXTH_FP32  # fp32 * an fp32-exact scalar
    return cast_to_fp8(torch.clamp(block_amax * scale_factor, max=FLT_MAX), UE4M3.torch_dtype)


def scale_2d(tile_amaxes: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The rowwise scale layout of 2D quantization ([R, C/16], each 16x16 tile's scale repeated
    over its rows) from the tiles' maxima [R/16, C/16] and the global amax, without the data:
    what quantize_nvfp4 gives for a tensor whose tiles were reduced across ranks."""
    return expand_tiles(block_scales(tile_amaxes, amax), BLOCK, 1,
                        (tile_amaxes.shape[0] * BLOCK, tile_amaxes.shape[1])).contiguous()


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    two_dimensional: bool = False,
    with_rht: bool = False,
    stochastic_rounding: bool = False,
    reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    tile_amaxes: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Quantize the requested directions of x ([..., K] viewed as [M, K]; M, K multiples of 16).

    `reduce_amax` maps each local global-amax to the one to use (an all-reduce over ranks, or
    identity when None). The columnwise amax is taken after the RHT when it applies; without the
    RHT both directions share one amax. The RHT applies to the columnwise copy of 1D quantization
    only (2D with RHT is an error). Returns a dict with `rowwise_data`, `rowwise_scale`,
    `amax_rowwise` and/or `columnwise_data`, `columnwise_scale`, `amax_columnwise`.
    `tile_amaxes` ([M/16, K/16], 2D only): the 16x16 tiles' maxima when reduced across ranks
    that each hold part of x (distributed master-weight casts; `reduce_amax` then gives the
    reduced global amax).
    """
    if tile_amaxes is not None and not two_dimensional:
        raise ValueError("tile_amaxes are the 16x16 tiles of 2D quantization; set two_dimensional")
    if two_dimensional and with_rht:
        raise ValueError("NVFP4 2D (weight) quantization takes no RHT: disable one of them")
    x2d = as_2d(x)
    require_divisible(tuple(x2d.shape), BLOCK, "NVFP4")
    reduce_amax = reduce_amax or (lambda amax: amax)
    tile_rows = BLOCK if two_dimensional else 1
    quantize = partial(
        quantize_blocks, stochastic=stochastic_rounding, generator=generator
    )
    out: dict[str, torch.Tensor] = {}
    plain_amax = None
    if rowwise or two_dimensional or not with_rht:
        plain_amax = reduce_amax(compute_amax(x2d)).reshape(())
    if rowwise or (columnwise and two_dimensional):
        data, scale = quantize(x2d, plain_amax, tile_rows=tile_rows, block_amax=tile_amaxes)
        if rowwise:
            out["rowwise_data"], out["rowwise_scale"] = data, scale
            out["amax_rowwise"] = plain_amax.reshape(1)
        if columnwise and two_dimensional:
            out["columnwise_data"], out["columnwise_scale"] = transpose_nvfp4_2d(data, scale)
            out["amax_columnwise"] = plain_amax.reshape(1).clone()
    if columnwise and not two_dimensional:
        x_t = x2d.t()
        col_amax = plain_amax
        if with_rht:
            x_t = random_hadamard_transform(x_t)
            col_amax = reduce_amax(compute_amax(x_t)).reshape(())
        out["columnwise_data"], out["columnwise_scale"] = quantize(x_t, col_amax, tile_rows=1)
        out["amax_columnwise"] = col_amax.reshape(1).clone()
    return out


def transpose_nvfp4_2d(
    data: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nibble transpose of packed data [R, C/2] -> [C, R/2] and of the 2D scale layout.

    The scale of a 16x16 tile is replicated over its 16 rows, so the transposed layout takes one
    row per tile row ([R/16, C/16]), transposes it and replicates it over the new 16 rows.
    """
    codes = unpack_nibbles(data)
    return pack_nibbles(codes.t().contiguous()), transpose_scale_2d(scale)


def transpose_scale_2d(scale: torch.Tensor) -> torch.Tensor:
    """The columnwise copy's scale layout of a 2D rowwise scale layout (transpose_nvfp4_2d's)."""
    return scale[::BLOCK].t().repeat_interleave(BLOCK, dim=0).contiguous()


def dequantize_nvfp4_blocks(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * fp32(s_b) in fp32, without the global scale (exact in bf16: 4 significant bits)."""
    values = e2m1_to_float(data)
    return values * expand_tiles(scale.float(), 1, BLOCK, values.shape)


def dequantize_nvfp4(
    data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(q * fp32(s_b)) * S_dec in fp32, then cast to `dtype`. Columnwise gives x^T's layout."""
    return (dequantize_nvfp4_blocks(data, scale) * global_decode_scale(amax)).to(dtype)
