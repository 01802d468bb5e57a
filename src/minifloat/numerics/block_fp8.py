"""FP8 block scaling, DeepSeek style (NUMERICS.md §4): E4M3, 128-element blocks.

1D (inputs, gradients): rowwise blocks of 1x128 along K; the columnwise copy quantizes x^T
([K, M]) in 1x128 runs along M from high precision. 2D (weights): one scale per 128x128 tile, and
the columnwise copy is the exact transpose of data and scale grid.

Storage layout (compact, NUMERICS.md §8):
- 1D rowwise: data [M, K], scale_inv [M, ceil(K/128)]
- 1D columnwise: data [K, M], scale_inv [K, ceil(M/128)]
- 2D rowwise: data [M, K], scale_inv [ceil(M/128), ceil(K/128)]
- 2D columnwise: data [K, M], scale_inv [ceil(K/128), ceil(M/128)]
"""

from __future__ import annotations

import torch

from .blocks import as_2d, expand_tiles, tile_amax
from .formats import E4M3, cast_to_fp8
from .per_tensor import scale_from_amax

BLOCK = 128


def _quantize_tiles(
    x2d: torch.Tensor, rows: int, cols: int, power_2_scale: bool, amax_epsilon: float,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [M, K] with one scale per rows x cols tile -> (E4M3 data, fp32 scale_inv grid).
    `amax` (the tile grid) may be given when it was reduced across ranks that each hold part
    of the tensor (distributed master-weight casts)."""
    if amax is None:
        amax = tile_amax(x2d, rows, cols)
    scale = _tile_scale(amax, power_2_scale, amax_epsilon, x2d.dtype)
    data = cast_to_fp8(x2d.float() * expand_tiles(scale, rows, cols, x2d.shape), E4M3.torch_dtype)
    return data, torch.reciprocal(scale)


def _tile_scale(amax: torch.Tensor, power_2_scale: bool, amax_epsilon: float,
                input_dtype: torch.dtype) -> torch.Tensor:
    """Each tile's scale from its absolute maximum (overflowing to the input dtype's max)."""
    return scale_from_amax(amax, E4M3.max_value, amax_epsilon=amax_epsilon,
                           power_2_scale=power_2_scale,
                           overflow_value=float(torch.finfo(input_dtype).max))


def block_scale_inv(tile_amaxes: torch.Tensor, *, power_2_scale: bool = True,
                    amax_epsilon: float = 0.0, input_dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
    """The scale_inv grid quantize_block_1d/2d derive from these tile maxima (for an input of
    `input_dtype`): the scales of a tensor whose tiles were reduced across ranks, computed
    without the tensor (a sharded weight's gathered scale grid)."""
    return torch.reciprocal(_tile_scale(tile_amaxes, power_2_scale, amax_epsilon, input_dtype))


def quantize_block_1d(
    x: torch.Tensor, *, power_2_scale: bool = True, amax_epsilon: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise 1x128 blocks along K of the 2D view -> (data [M, K], scale_inv [M, ceil(K/128)])."""
    return _quantize_tiles(as_2d(x), 1, BLOCK, power_2_scale, amax_epsilon)


def quantize_block_1d_columnwise(
    x: torch.Tensor, *, power_2_scale: bool = True, amax_epsilon: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Columnwise copy: x^T [K, M] in 1x128 runs along M.

    Returns (data [K, M], scale_inv [K, ceil(M/128)]).
    """
    return _quantize_tiles(as_2d(x).t(), 1, BLOCK, power_2_scale, amax_epsilon)


def quantize_block_2d(
    x: torch.Tensor, *, power_2_scale: bool = True, amax_epsilon: float = 0.0,
    tile_amaxes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 tiles -> (data [M, K], scale_inv [ceil(M/128), ceil(K/128)]). `tile_amaxes`:
    the tiles' absolute maxima when reduced elsewhere (computed from x otherwise)."""
    return _quantize_tiles(as_2d(x), BLOCK, BLOCK, power_2_scale, amax_epsilon, tile_amaxes)


def transpose_block_2d(
    data: torch.Tensor, scale_inv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact columnwise copy of a 2D-quantized tensor (or back): transpose data and grid."""
    return data.t().contiguous(), scale_inv.t().contiguous()


def dequantize_block_1d(
    data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize 1x128 blocks of a 2D data tensor (either direction's layout)."""
    return (data.float() * expand_tiles(scale_inv, 1, BLOCK, data.shape)).to(dtype)


def dequantize_block_2d(
    data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize 128x128 tiles of a 2D data tensor (either direction's layout)."""
    return (data.float() * expand_tiles(scale_inv, BLOCK, BLOCK, data.shape)).to(dtype)
