"""Per-tensor FP8 casts of a mixture of experts' rows, each expert's rows with its own scale,
the groups given by device-side row ends: rowwise bytes and their transpose in one launch.

Why: the device-offsets experts (modules/grouped_offsets.py) cast each expert's rows of the
padded layout (and the experts' stacked weights, as rows) with that expert's current-scaling
scale. As torch ops the cast is a dozen eager kernels per operand (fused only under
torch.compile) and its transposed copy one more pass. Here each program casts one tile with
per_tensor_tile, the tile function of every per-tensor cast (words of four elements in, words
of four codes out: benchmarks/KERNEL_NOTES.md), with the scale of the group that holds the
tile; the scales ([E] fp32, numerics' scale_from_amax of each group's maximum) come from the
group scales' op. The first version cast element by element (a byte transpose through shared
memory) and moved its bytes at 0.53-0.69 of a copy's speed on an H100.

Layout contract (grouped_gemm.GROUP_ROWS): every group starts on a multiple of 128 rows, so a
tile of the dense casts' rows (64, or 32; dividing 128) lies in one group; tiles past the last
group's end (rows of no group, zeros) take the last group's scale. Bytes: those of
numerics.cast_to_fp8 of the fp32 product x * scale, as every per-tensor kernel writes them
(NaN's sign follows the product as the device computes it: no part of the contract;
tests/gpu/test_grouped_offsets_kernels.py).
"""

from __future__ import annotations

import torch

from . import per_tensor_fp8
from .fp8_common import cdiv, is_e5m2, jit, tl, triton
from .grouped_gemm import group_of_block
from .launch import launch
from .per_tensor_fp8 import tile_views
from .per_tensor_tile import per_tensor_tile, scale_makes_nan


@jit
def _grouped_cast_kernel(x_ptr, data_ptr, data_t_ptr, scale_ptr, ends_ptr, M, K,
                         GROUPS: tl.constexpr, GROUPS_POW2: tl.constexpr, E5M2: tl.constexpr,
                         ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HALVES: tl.constexpr,
                         ROW_WORDS: tl.constexpr, COL_WORDS: tl.constexpr,
                         MASK_M: tl.constexpr, MASK_K: tl.constexpr, WIDE: tl.constexpr,
                         HW_CAST: tl.constexpr, PRODUCTS: tl.constexpr,
                         MAX_U16X2: tl.constexpr):
    """One tile per program, in the dense cast's order (along K first); the views are those
    per_tensor_tile's modes ask for (tile_views)."""
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    pid_m = pid // tiles_k
    pid_k = pid % tiles_k
    group = tl.minimum(group_of_block(ends_ptr, pid_m * BLOCK_M, GROUPS, GROUPS_POW2),
                       GROUPS - 1)
    scale = tl.load(scale_ptr + group)
    # the scales are given, so the tile checks its own NaN (a NaN input anywhere in it)
    per_tensor_tile(x_ptr, data_ptr, data_t_ptr, scale_ptr, scale, scale_makes_nan(scale), M,
                    K, pid_m, pid_k, E5M2, ROWWISE, COLUMNWISE, False, HW_CAST or PRODUCTS,
                    BLOCK_M, BLOCK_K, HALVES, ROW_WORDS, COL_WORDS, MASK_M, MASK_K, WIDE,
                    HW_CAST, PRODUCTS, MAX_U16X2)


def grouped_cast(x: torch.Tensor, scale: torch.Tensor, ends: torch.Tensor,
                 fp8_dtype: torch.dtype, *, rowwise: bool, columnwise: bool
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(data [R, D] or None, data_t [D, R] or None) of x [R, D] (contiguous fp32/bf16/fp16),
    the rows of group g cast with scale[g] (fp32 [E]); ends int32 [E]. Only the copies asked
    for are written (a backward that recasts a kept input needs its transpose alone)."""
    if not (rowwise or columnwise):
        raise ValueError("grouped_cast: ask for the rowwise or the columnwise copy")
    rows, depth = x.shape
    # the dense casts' tile, modes and conversion path (read at the call: tests switch them)
    tile = per_tensor_fp8.tile_constexprs(x, rows, depth)
    if 128 % tile["BLOCK_M"]:
        raise ValueError(f"grouped_cast: tiles of {tile['BLOCK_M']} rows would straddle two "
                         "groups")
    groups = ends.shape[0]
    data = torch.empty(rows, depth, dtype=torch.uint8, device=x.device) if rowwise else None
    data_t = torch.empty(depth, rows, dtype=torch.uint8, device=x.device) if columnwise else None
    # an absent copy's pointer: the other copy (its stores are compiled out)
    x_view, rows_out, cols_out = tile_views(x, data if rowwise else data_t,
                                            data_t if columnwise else data, tile)
    grid = (cdiv(rows, tile["BLOCK_M"]) * cdiv(depth, tile["BLOCK_K"]),)
    launch(_grouped_cast_kernel, grid, x_view, rows_out, cols_out, scale, ends, rows, depth,
           num_warps=per_tensor_fp8.NUM_WARPS, GROUPS=groups,
           GROUPS_POW2=triton.next_power_of_2(groups), E5M2=is_e5m2(fp8_dtype),
           ROWWISE=rowwise, COLUMNWISE=columnwise, **tile)
    return (data.view(fp8_dtype) if rowwise else None,
            data_t.view(fp8_dtype) if columnwise else None)
