"""Shared block helpers: 2D views and per-block absolute maxima, vectorised (no Python loops).

A tensor of any rank is viewed as [M, K] with M the product of the leading dims and K the last
dim. Blocks run along K ("rowwise") or, for a transposed tensor, along M.
"""

from __future__ import annotations

import torch


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [M, K] view (a 1-D tensor becomes [1, K]; a 0-dim tensor is an error)."""
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-dim tensor: give it at least one dimension")
    return x.reshape(-1, x.shape[-1])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pad_to_multiple(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2D tensor at the bottom/right so its dims are multiples of (rows, cols)."""
    m, k = x.shape
    pad_m, pad_k = ceil_div(m, rows) * rows - m, ceil_div(k, cols) * cols - k
    if pad_m or pad_k:
        x = torch.nn.functional.pad(x, (0, pad_k, 0, pad_m))
    return x


def tile_amax(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Absolute max of each rows x cols tile of a 2D tensor -> [ceil(M/rows), ceil(K/cols)] fp32.

    Edge tiles use the elements that exist (zero padding cannot raise an absolute max). NaN in a
    tile propagates to that tile's amax.
    """
    padded = pad_to_multiple(x.float().abs(), rows, cols)
    m, k = padded.shape
    tiles = padded.reshape(m // rows, rows, k // cols, cols)
    return torch.amax(tiles, dim=(1, 3))


def expand_tiles(
    values: torch.Tensor, rows: int, cols: int, shape: tuple[int, int]
) -> torch.Tensor:
    """Broadcast per-tile values [tm, tk] back to elements, cropped to `shape` [M, K]."""
    expanded = values.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)
    return expanded[: shape[0], : shape[1]]


def require_divisible(shape: tuple[int, int], block: int, format_name: str) -> None:
    """Raise a clear error when M or K is not a multiple of the format's block."""
    m, k = shape
    if m % block or k % block:
        raise ValueError(
            f"{format_name} needs both dims of the 2D view [M, K] = [{m}, {k}] to be multiples of "
            f"{block}; pad the tensor (or the layer's features) to a multiple of {block}, or use "
            "a per-tensor or block-FP8 recipe for this layer"
        )
