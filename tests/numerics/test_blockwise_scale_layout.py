"""The scale grids blockwise scaled_mm reads, made without a copy where the layout allows.

Why: every block FP8 GEMM on the GPU hands torch's BlockWise scaled_mm its scales in a fixed
layout (1x128 grids column-major, 128x128 grids transposed with a leading dimension that is a
multiple of 4). A transposing copy or a zero pad per operand cost 4-6 small kernels per Linear
at the 1b preset. The kernels now write the 1D grids column-major and a contiguous tile grid of
K/128 % 4 == 0 is already in layout; these helpers must then hand the same storage on. The
values they hand over are checked against an independent construction of the layout.
"""

from __future__ import annotations

import torch

from minifloat import gemm_paths
from minifloat.kernels.block_fp8 import column_major_grid


def test_column_major_grid_passes_through_without_copy():
    grid = column_major_grid((256, 3), torch.device("cpu"))
    grid.copy_(torch.arange(768, dtype=torch.float32).view(256, 3))
    assert grid.stride() == (1, 256)
    operand = gemm_paths._column_major(grid)
    assert operand.data_ptr() == grid.data_ptr() and operand.stride() == (1, 256)
    assert torch.equal(operand, grid)


def test_one_block_per_row_keeps_viewable_strides():
    """[M, 1] is the same order either way: strides (1, 1), which a dtype view accepts."""
    grid = column_major_grid((64, 1), torch.device("cpu"))
    assert grid.stride() == (1, 1)
    grid.view(torch.uint8)
    assert gemm_paths._column_major(grid).data_ptr() == grid.data_ptr()


def test_row_major_grid_is_made_column_major():
    grid = torch.arange(768, dtype=torch.float32).view(256, 3)
    operand = gemm_paths._column_major(grid)
    assert operand.stride() == (1, 256) and torch.equal(operand, grid)


def test_tile_grid_of_aligned_width_is_a_transposed_view():
    grid = torch.arange(3 * 8, dtype=torch.float32).view(3, 8)  # N/128 = 3, K/128 = 8
    operand = gemm_paths._tile_grid_operand(grid)
    assert operand.data_ptr() == grid.data_ptr()
    assert operand.shape == (8, 3) and operand.stride() == (1, 8)
    assert torch.equal(operand, grid.t())


def test_tile_grid_of_other_widths_is_padded_to_four():
    for width in (1, 3, 5, 6):
        grid = torch.arange(2 * width, dtype=torch.float32).view(2, width) + 1
        operand = gemm_paths._tile_grid_operand(grid)
        padded = -(-width // 4) * 4
        assert operand.shape == (padded, 2) and operand.stride() == (1, padded)
        assert torch.equal(operand[:width], grid.t()) and not operand[width:].any()


def test_non_contiguous_tile_grid_is_copied_into_layout():
    grid = torch.arange(8 * 3, dtype=torch.float32).view(8, 3).t()  # [3, 8], strides (1, 3)
    operand = gemm_paths._tile_grid_operand(grid)
    assert operand.shape == (8, 3) and operand.stride() == (1, 8)
    assert torch.equal(operand, grid.t())
