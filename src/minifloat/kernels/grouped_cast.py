"""Per-tensor FP8 casts of a mixture of experts' rows, each expert's rows with its own scale,
the groups given by device-side row ends: rowwise bytes and their transpose in one launch.

Why: the device-offsets experts (modules/grouped_offsets.py) cast each expert's rows of the
padded layout with that expert's current-scaling scale. As torch ops the cast is a dozen eager
kernels per operand (fused only under torch.compile) and its transposed copy one more pass.
Here one program casts a tile and writes both copies; the scales ([E] fp32, numerics'
scale_from_amax of each group's maximum) come from torch ops on [E]-sized tensors.

Layout contract (grouped_gemm.GROUP_ROWS): every group starts on a multiple of 128 rows, so a
BLOCK_M-row tile (BLOCK_M dividing 128) lies in one group. Bytes: fp8_common.fp8_codes of the
fp32 product x * scale, the contract's saturating round-to-nearest-even (NaN 0x7F | the sign of
x, not of the product, which the GPU makes the canonical positive NaN), the bytes of
numerics.cast_to_fp8 (tests/gpu/test_grouped_offsets_kernels.py checks them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .element_cast import kernel_view, load_as_float
from .fp8_common import fp8_codes, is_e5m2, with_nan_codes
from .grouped_gemm import group_of_block
from .launch import launch

# (BLOCK_M, BLOCK_K, warps) on CUDA; BLOCK_M divides 128 (the layout contract).
# benchmarks/grouped_gemm_bench.py --sweep times others against a copy of the same bytes.
CUDA_TILE = (64, 64, 4)


@triton.jit
def _grouped_cast_kernel(x_ptr, data_ptr, data_t_ptr, scale_ptr, ends_ptr, rows, depth,
                         GROUPS: tl.constexpr, GROUPS_POW2: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         BF16_BITS: tl.constexpr, E5M2: tl.constexpr, HW_CAST: tl.constexpr,
                         ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_m[:, None] < rows) & (offs_k[None, :] < depth)
    x = load_as_float(x_ptr, offs_m[:, None].to(tl.int64) * depth + offs_k[None, :], mask,
                      BF16_BITS)
    group = tl.minimum(group_of_block(ends_ptr, pid_m * BLOCK_M, GROUPS, GROUPS_POW2),
                       GROUPS - 1)
    # the NaN byte keeps the sign of x, not of the product (with_nan_codes says why)
    codes = with_nan_codes(x, fp8_codes(x * tl.load(scale_ptr + group), E5M2, HW_CAST))
    if ROWWISE:
        tl.store(data_ptr + offs_m[:, None].to(tl.int64) * depth + offs_k[None, :], codes,
                 mask=mask)
    if COLUMNWISE:
        tl.store(data_t_ptr + offs_k[None, :].to(tl.int64) * rows + offs_m[:, None], codes,
                 mask=mask)


def grouped_cast(x: torch.Tensor, scale: torch.Tensor, ends: torch.Tensor,
                 fp8_dtype: torch.dtype, *, rowwise: bool, columnwise: bool
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(data [R, D] or None, data_t [D, R] or None) of x [R, D] (contiguous fp32/bf16/fp16),
    the rows of group g cast with scale[g] (fp32 [E]); ends int32 [E]. Only the copies asked
    for are written (a backward that recasts a kept input needs its transpose alone)."""
    if not (rowwise or columnwise):
        raise ValueError("grouped_cast: ask for the rowwise or the columnwise copy")
    rows, depth = x.shape
    groups = ends.shape[0]
    data = torch.empty(rows, depth, dtype=torch.uint8, device=x.device) if rowwise else None
    data_t = torch.empty(depth, rows, dtype=torch.uint8, device=x.device) if columnwise else None
    view, bf16_bits = kernel_view(x)
    block_m, block_k, warps = CUDA_TILE if x.is_cuda else (32, 32, 4)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(depth, block_k))
    launch(_grouped_cast_kernel, grid, view, data if rowwise else data_t,
           data_t if columnwise else data, scale, ends, rows, depth, num_warps=warps,
           GROUPS=groups, GROUPS_POW2=triton.next_power_of_2(groups), BLOCK_M=block_m,
           BLOCK_K=block_k, BF16_BITS=bf16_bits, E5M2=is_e5m2(fp8_dtype), HW_CAST=x.is_cuda,
           ROWWISE=rowwise, COLUMNWISE=columnwise)
    return (data.view(fp8_dtype) if rowwise else None,
            data_t.view(fp8_dtype) if columnwise else None)
