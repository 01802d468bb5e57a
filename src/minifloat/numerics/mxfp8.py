"""MXFP8 (NUMERICS.md §5): 32-element blocks, E8M0 scales, E4M3 (or E5M2) elements.

Both directions live on the same [M, K] layout (no transpose):
- rowwise: 1x32 blocks along K -> data [M, K], scale [M, K/32] (E8M0 as uint8)
- columnwise: 32x1 blocks along M -> data [M, K], scale [M/32, K] (E8M0 as uint8)
"""

from __future__ import annotations

import torch

from .blocks import as_2d, expand_tiles, require_divisible, tile_amax
from .formats import (
    E8M0_BIAS,
    cast_to_fp8,
    e8m0_to_float,
    exp2_exact,
    float_bits,
    fp8_format,
    fp32_round,
)

BLOCK = 32


def e8m0_exponent(block_amax: torch.Tensor, element_max: float = 448.0) -> torch.Tensor:
    """Biased E8M0 exponent (uint8) of round_up_pow2(block_amax * fp32(1/element_max)).

    From the fp32 bits of v: exponent field E, mantissa m; e = E + 1 when m > 0 and E != 0xFE
    and not (E == 0 and m <= 0x400000), else E. NaN -> 0xFF, inf -> 0xFE, 0 -> 0.
    """
    # R = fp32(1/element_max): the rule multiplies by this constant, it does not divide. A
    # Python number already rounded to fp32: an fp32 tensor times a Python scalar multiplies in
    # fp32 with the scalar cast to fp32 (exact here), the bits of a multiply by an fp32 tensor
    # holding R, without building that tensor (a device copy) per call.
    v = block_amax.float() * fp32_round(1.0 / element_max)
    bits = float_bits(v)
    exponent_field = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent_field != 0xFE) & ~(
        (exponent_field == 0) & (mantissa <= 0x400000)
    )
    e = exponent_field + round_up.to(torch.int32)
    e = torch.where(torch.isinf(v), torch.full_like(e, 0xFE), e)
    e = torch.where(torch.isnan(v), torch.full_like(e, 0xFF), e)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    return e.to(torch.uint8)


def _quantize_blocks(
    x2d: torch.Tensor, rows: int, cols: int, dtype: torch.dtype,
    block_amax: torch.Tensor | None = None, exponents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One E8M0 scale per rows x cols block: (data [M, K] in `dtype`, exponents uint8 grid)."""
    if exponents is None:
        if block_amax is None:
            block_amax = tile_amax(x2d, rows, cols)
        exponents = e8m0_exponent(block_amax, fp8_format(dtype).max_value)
    biased = exponents.to(torch.int32)
    # element scale 2^-(e-127) is exact from bits, even when subnormal; e = 255 gives NaN.
    encode = exp2_exact(E8M0_BIAS - torch.clamp(biased, max=254))
    encode = torch.where(biased == 255, torch.full_like(encode, float("nan")), encode)
    data = cast_to_fp8(x2d.float() * expand_tiles(encode, rows, cols, x2d.shape), dtype)
    return data, exponents


def quantize_mxfp8(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    dtype: torch.dtype = torch.float8_e4m3fn,
    rowwise_amax: torch.Tensor | None = None,
    columnwise_amax: torch.Tensor | None = None,
    rowwise_exponents: torch.Tensor | None = None,
    columnwise_exponents: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Quantize the requested directions from high precision in one call.

    Returns a dict with `rowwise_data`, `rowwise_scale` and/or `columnwise_data`,
    `columnwise_scale`. Both M and K must be multiples of 32. The block maxima ([M, K/32]
    rowwise, [M/32, K] columnwise) may be given when reduced across ranks that each hold part
    of x (distributed master-weight casts); they are computed from x otherwise. The E8M0
    exponents themselves may be given instead (`*_exponents`, uint8, the scale layouts): the
    exponent of a maximum of maxima is the maximum of their exponents (the rule is monotone),
    so ranks may reduce exponents, a quarter of the bytes.
    """
    x2d = as_2d(x)
    require_divisible(tuple(x2d.shape), BLOCK, "MXFP8")
    out: dict[str, torch.Tensor] = {}
    if rowwise:
        out["rowwise_data"], out["rowwise_scale"] = _quantize_blocks(
            x2d, 1, BLOCK, dtype, rowwise_amax, rowwise_exponents)
    if columnwise:
        out["columnwise_data"], out["columnwise_scale"] = _quantize_blocks(
            x2d, BLOCK, 1, dtype, columnwise_amax, columnwise_exponents)
    return out


def dequantize_mxfp8(
    data: torch.Tensor,
    scale: torch.Tensor,
    *,
    columnwise: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q * 2^(e-127) for either direction's layout (both are [M, K])."""
    rows, cols = (BLOCK, 1) if columnwise else (1, BLOCK)
    decode = expand_tiles(e8m0_to_float(scale), rows, cols, data.shape)
    return (data.float() * decode).to(dtype)
