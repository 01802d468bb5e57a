"""MXFP8 quantization of many tensors in one kernel launch (NUMERICS.md §5).

Why: a mixture-of-experts layer quantizes one small split per expert, and an optimizer casts
many master weights; one launch per tensor is then dominated by launch latency and host time.
MXFP8 needs no global amax (every 32-element block takes its own E8M0 scale), so a single launch
covers every tensor, rowwise and columnwise copies alike.

The pattern of kernels.multi_tensor: one int64 table per call, uploaded with one asynchronous
copy (pinned host memory, non_blocking; no host sync): per tensor its input offset in elements
from a base tensor (all inputs share one dtype), M, K and its output offsets, then the running
count of tiles owned by the tensors before it. A program finds its tensor by binary search over
those counts and runs kernels.mxfp8.mxfp8_tile, the tile code of the single-tensor kernel, with
the same tile shape and warps, so every tensor gets the bytes its own `quantize_mxfp8` call (and
the numerics reference) gives it. Outputs are views into one flat buffer per kind (rowwise and
columnwise data and scales); a view keeps its buffer alive.

Imported lazily, like the other kernel modules, once `minifloat.kernels.available` holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..numerics.blocks import as_2d, require_divisible
from ..numerics.formats import fp8_format
from ..numerics.mxfp8 import BLOCK
from .element_cast import E4M3_CONSTANTS, E5M2_CONSTANTS, kernel_view
from .fp8_common import cdiv, hw_cast, needs_wide_offsets
from .launch import launch
from .multi_tensor import (
    ALIGN,
    FIELDS,
    _aligned_offsets,
    _input_offsets,
    _owner,
    _search_steps,
    _starts,
    _upload,
    _view,
)
from .mxfp8 import BLOCK_K, BLOCK_M, DIRECT_COLUMNS, NUM_WARPS, _reciprocal_bits, mxfp8_tile

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _mxfp8_multi_kernel(
    x_base,
    row_data_base,
    row_scale_base,
    col_data_base,
    col_scale_base,
    table_ptr,
    starts_ptr,
    n,
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
    STEPS: tl.constexpr,
    FIELDS: tl.constexpr,
    WIDE: tl.constexpr,
    X_ALIGNED: tl.constexpr,
):
    """One tile of one tensor. Table row i: (input offset in elements, M, K, data offset,
    scale offset); rowwise and columnwise buffers share offsets (equal sizes: M*K data bytes,
    M*K/32 scale bytes). M and K narrow to int32 unless WIDE, as the single-tensor launch
    passes them, so the tile code and its registers are those of _mxfp8_kernel. X_ALIGNED:
    every input offset is a multiple of 16 elements (inputs as 16-byte aligned as the base)."""
    i = _owner(starts_ptr, tl.program_id(0), n, STEPS)
    row = table_ptr + i * FIELDS
    M = tl.load(row + 1)
    K = tl.load(row + 2)
    if not WIDE:
        M = M.to(tl.int32)
        K = K.to(tl.int32)
    # Values read from memory carry no divisibility facts; the single-tensor launch gets them
    # from Triton's specialisation (M, K and 16-byte aligned pointers). Without them every
    # access is scalar: twice the registers, with spills (sm_90 compile).
    M = tl.multiple_of(M, 16)
    K = tl.multiple_of(K, 16)
    x_offset = tl.load(row)
    if X_ALIGNED:
        x_offset = tl.multiple_of(x_offset, 16)
    data_offset = tl.multiple_of(tl.load(row + 3), 16)
    scale_offset = tl.multiple_of(tl.load(row + 4), 16)
    local = (tl.program_id(0) - tl.load(starts_ptr + i)).to(tl.int32)
    tiles_k = tl.cdiv(K, BLOCK_K)
    mxfp8_tile(
        x_base + x_offset, row_data_base + data_offset, row_scale_base + scale_offset,
        col_data_base + data_offset, col_scale_base + scale_offset, M, K,
        local // tiles_k, local % tiles_k, BF16_BITS, ROWWISE, COLUMNWISE, MANTISSA_BITS,
        MIN_EXPONENT, MAX_CODE, RECIPROCAL_BITS, BLOCK_M, BLOCK_K, SCALE_BLOCK, HW_CAST, E5M2,
        DIRECT_COLUMNS,
    )


def _matrices(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """[M, K] views of the inputs, after the single-tensor kernel's checks plus one device and
    one dtype for the group (the table addresses inputs as offsets from one base pointer)."""
    device, dtype = xs[0].device, xs[0].dtype
    views = []
    for x in xs:
        if x.device != device or x.dtype != dtype:
            raise ValueError(
                "quantize_mxfp8_multi needs tensors of one device and dtype; got "
                f"{x.dtype} on {x.device} next to {dtype} on {device}: group them first"
            )
        if x.dtype not in INPUT_DTYPES:
            raise ValueError(
                f"the MXFP8 kernel takes float32/bfloat16/float16 inputs, got {x.dtype}"
            )
        if not x.is_contiguous():
            raise ValueError("the MXFP8 kernel needs a contiguous input; call .contiguous() first")
        x2d = as_2d(x)
        require_divisible(tuple(x2d.shape), BLOCK, "MXFP8")
        views.append(x2d)
    return views


def quantize_mxfp8_multi(
    xs: Sequence[torch.Tensor],
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    rowwise: bool = True,
    columnwise: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """MXFP8 of every tensor in `xs`: per tensor, the dict kernels.mxfp8.quantize_mxfp8 returns
    (`rowwise_data` [M, K] in `dtype`, `rowwise_scale` [M, K/32] uint8, `columnwise_data`
    [M, K], `columnwise_scale` [M/32, K], for the copies asked for) with the same bytes, from one
    kernel launch and one asynchronous table upload.

    Every tensor must be contiguous float32/bfloat16/float16 with M and K multiples of 32, and
    all on one device with one dtype (ValueError otherwise, before anything is launched).
    Zero-element tensors get empty buffers. Note the default: both copies (the single-tensor
    function defaults to rowwise only).
    """
    if not xs:
        return []
    fmt = fp8_format(dtype)
    views = _matrices(xs)
    if not (rowwise or columnwise):
        return [{} for _ in views]
    device, n = views[0].device, len(views)
    shapes = [tuple(v.shape) for v in views]
    inputs = [kernel_view(v)[0] for v in views]
    base, x_offsets = _input_offsets(inputs)
    data_offsets, data_total = _aligned_offsets([m * k for m, k in shapes], ALIGN)
    scale_offsets, scale_total = _aligned_offsets([m * k // BLOCK for m, k in shapes], ALIGN)
    tile_counts = [cdiv(m, BLOCK_M) * cdiv(k, BLOCK_K) for m, k in shapes]

    def buffer(wanted: bool, total: int) -> torch.Tensor | None:
        return torch.empty(max(total, 1), dtype=torch.uint8, device=device) if wanted else None

    row_data, row_scale = buffer(rowwise, data_total), buffer(rowwise, scale_total)
    col_data, col_scale = buffer(columnwise, data_total), buffer(columnwise, scale_total)
    total_tiles = sum(tile_counts)
    if total_tiles:
        rows = [(x_offsets[i], m, k, data_offsets[i], scale_offsets[i])
                for i, (m, k) in enumerate(shapes)]
        table = _upload(rows, (_starts(tile_counts),), device)
        some_data = row_data if row_data is not None else col_data
        some_scale = row_scale if row_scale is not None else col_scale
        mantissa_bits, min_exponent, max_code = (
            E4M3_CONSTANTS if dtype == torch.float8_e4m3fn else E5M2_CONSTANTS
        )
        launch(
            _mxfp8_multi_kernel, (total_tiles,), base,
            row_data if row_data is not None else some_data,
            row_scale if row_scale is not None else some_scale,
            col_data if col_data is not None else some_data,
            col_scale if col_scale is not None else some_scale,
            table[: n * FIELDS], table[n * FIELDS:], n,
            BF16_BITS=views[0].dtype == torch.bfloat16, ROWWISE=rowwise, COLUMNWISE=columnwise,
            MANTISSA_BITS=mantissa_bits, MIN_EXPONENT=min_exponent, MAX_CODE=max_code,
            RECIPROCAL_BITS=_reciprocal_bits(fmt.max_value), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
            SCALE_BLOCK=BLOCK, HW_CAST=hw_cast(views[0]), E5M2=dtype == torch.float8_e5m2,
            DIRECT_COLUMNS=DIRECT_COLUMNS and BLOCK_M == BLOCK, STEPS=_search_steps(n),
            FIELDS=FIELDS, WIDE=any(needs_wide_offsets(m, k, BLOCK_M) for m, k in shapes),
            X_ALIGNED=all(offset % 16 == 0 for offset in x_offsets),
            num_warps=NUM_WARPS,
        )
    results = []
    for i, (m, k) in enumerate(shapes):
        out: dict[str, torch.Tensor] = {}
        if row_data is not None:
            out["rowwise_data"] = _view(row_data, data_offsets[i], (m, k)).view(dtype)
            out["rowwise_scale"] = _view(row_scale, scale_offsets[i], (m, k // BLOCK))
        if col_data is not None:
            out["columnwise_data"] = _view(col_data, data_offsets[i], (m, k)).view(dtype)
            out["columnwise_scale"] = _view(col_scale, scale_offsets[i], (m // BLOCK, k))
        results.append(out)
    return results
