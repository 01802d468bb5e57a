"""FSDP2 row shards whose scale tiles cross a shard boundary (low-precision all-gather).

Why: 128x128 block FP8 and 16x16 NVFP4 take one scale per tile. When FSDP2's row shards do not
hold whole tiles (a 192-row weight over 2 ranks: 96 rows each, so rows 96-127 of the first tile
live on rank 1), no rank can derive a cut tile's scale alone. Each rank takes the maxima of the
tiles its rows touch (rows it does not hold count as zeros, which cannot raise an absolute
maximum), one MAX all-reduce over the shard group combines them (with NVFP4's global amax; NaN
travels as a flag beside the values), and each rank casts its own rows with the scales of the
reduced maxima. The gathered bytes and scales are those of quantizing the full weight on one
rank, bit for bit, as when shards hold whole tiles.

What is gathered: block FP8 gathers the data rows only; its scale grid has one row per tile row,
which a cut tile would give twice, so the full grid (equal on every rank after the all-reduce)
travels as metadata. NVFP4 stores its scales per row (a tile's scale repeated over its 16
rows), so data and scale rows are gathered as for whole tiles.

MXFP8's columnwise copy (32-row blocks, gathered for backward) is cut the same way; its scale
grid ([M/32, K]) travels as metadata like block FP8's.

This runs the numerics reference (pure torch, any device) on the tile rows the shard touches;
shards of whole tiles keep the quantizer's own path (Triton kernels on a GPU).
"""

from __future__ import annotations

import torch

from .. import numerics
from ..numerics.blocks import tile_amax
from ..quantizers import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer
from .master_weights import all_reduce_max_keep_nan


def tile_rows_of(quantizer: Quantizer) -> int | None:
    """Rows of one scale tile of this weight quantizer's format (None: no tiles along rows)."""
    if isinstance(quantizer, Float8BlockQuantizer):
        return 128
    if isinstance(quantizer, NVFP4Quantizer):
        return 16
    return None


def _padded_tile_rows(shard: torch.Tensor, first_row: int, tile: int
                      ) -> tuple[torch.Tensor, int, int]:
    """(the tile rows the shard touches, zeros outside its rows; index of the first tile row;
    offset of the shard's first row inside them)."""
    first_tile = first_row // tile
    top = first_row - first_tile * tile
    count = -(-(top + shard.shape[0]) // tile)
    block = shard.new_zeros(count * tile, shard.shape[1])
    block[top:top + shard.shape[0]] = shard
    return block, first_tile, top


def cut_tile_gather_inputs(
    shard: torch.Tensor, quantizer: Quantizer, first_row: int, total_rows: int, group
) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """(all-gather inputs, metadata) of this rank's rows [first_row, first_row + rows) of a
    weight of `total_rows` rows, quantized with the tile maxima reduced over `group`; the
    layout fsdp._gathered_storage reads ("block_grid" or "nvfp4")."""
    tile = tile_rows_of(quantizer)
    rows, columns = shard.shape
    block, first_tile, top = _padded_tile_rows(shard.detach(), first_row, tile)
    local = tile_amax(block, tile, tile)
    grid_shape = (-(-total_rows // tile), local.shape[1])
    grid = torch.zeros(grid_shape, dtype=torch.float32, device=shard.device)
    grid[first_tile:first_tile + local.shape[0]] = local
    nvfp4 = isinstance(quantizer, NVFP4Quantizer)
    pieces = [grid.view(-1)]
    if nvfp4:  # the global amax rides along: one all-reduce for both
        pieces.insert(0, numerics.compute_amax(shard.detach()).reshape(1).float())
    reduced = all_reduce_max_keep_nan(torch.cat(pieces), group)
    owner = quantizer._output_quantizer()
    if not nvfp4:
        grid = reduced.view(grid_shape)
        data, _ = numerics.quantize_block_2d(
            block, power_2_scale=quantizer.power_2_scale, amax_epsilon=quantizer.amax_epsilon,
            tile_amaxes=grid[first_tile:first_tile + local.shape[0]])
        scale_inv = numerics.block_scale_inv(
            grid, power_2_scale=quantizer.power_2_scale, amax_epsilon=quantizer.amax_epsilon,
            input_dtype=block.dtype)
        mine = data[top:top + rows].contiguous()
        return (mine.view(torch.uint8),), ("block_grid", owner, data.dtype, scale_inv)
    amax = reduced[:1].reshape(())
    grid = reduced[1:].view(grid_shape)
    out = numerics.quantize_nvfp4(block, rowwise=True, two_dimensional=True,
                                  reduce_amax=lambda _: amax,
                                  tile_amaxes=grid[first_tile:first_tile + local.shape[0]])
    data = out["rowwise_data"][top:top + rows].contiguous()
    scale = out["rowwise_scale"][top:top + rows].contiguous()
    return ((data, scale.view(torch.uint8)),
            ("nvfp4", owner, scale.dtype, out["amax_rowwise"]))


def cut_mxfp8_columnwise_gather_inputs(
    shard: torch.Tensor, quantizer: MXFP8Quantizer, first_row: int, total_rows: int, group
) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """MXFP8's columnwise copy (32x1 blocks along rows) of a shard whose blocks the shard
    boundary cuts: the block maxima reduced over `group`, the data rows gathered, the full E8M0
    scale grid ([M/32, K], equal on every rank) as metadata ("mxfp8_grid")."""
    rows = shard.shape[0]
    block, first_tile, top = _padded_tile_rows(shard.detach(), first_row, 32)
    local = tile_amax(block, 32, 1)
    grid = torch.zeros((-(-total_rows // 32), local.shape[1]), dtype=torch.float32,
                       device=shard.device)
    grid[first_tile:first_tile + local.shape[0]] = local
    grid = all_reduce_max_keep_nan(grid.view(-1), group).view(grid.shape)
    out = numerics.quantize_mxfp8(block, rowwise=False, columnwise=True,
                                  dtype=quantizer.fp8_dtype,
                                  columnwise_amax=grid[first_tile:first_tile + local.shape[0]])
    data = out["columnwise_data"][top:top + rows].contiguous()
    scale = numerics.e8m0_exponent(grid, numerics.fp8_format(quantizer.fp8_dtype).max_value)
    # FSDP2 keeps the all-gather buffers of a weight's first gather (forward: data and its
    # [rows, K/32] scale), so this gather sends as many tensors of the same sizes: the second
    # one, the size of those scale rows, is unused (the grid travels as metadata)
    unused = torch.zeros(rows * (shard.shape[1] // 32), dtype=torch.uint8, device=shard.device)
    return ((data.view(torch.uint8), unused),
            ("mxfp8_grid", quantizer._output_quantizer(), (data.dtype, scale.dtype), scale))
