"""Byte and nibble matrices transposed: a quantized weight's columnwise copy derived from its
rowwise copy (per-tensor and 2D block FP8 bytes, 2D NVFP4 nibbles).

Why: FSDP2's FP8 all-gather brings each weight's rowwise bytes [N, K], and backward's data
gradient reads the transposed copy [K, N] (torch._scaled_mm takes its second operand
column-major). torch's `data.t().contiguous()` on a float8 tensor runs the generic strided
copy kernel: in call 11's profile of the 1b FSDP2 step on 2 x H200 (BENCHMARKS.md,
twenty-first session) 80 such copies took 5.7 ms of the step, 71 us for weights of at most
16.8 MB, about 0.5 TB/s. Here each program moves one TILE x TILE block of bytes: it loads the
block with its rows contiguous and stores it transposed, the output's rows contiguous.

Bytes are moved, never converted (the data is viewed as uint8), so the result equals
`x.t().contiguous()` bit for bit by construction (tests/gpu/test_transpose_cuda.py checks it,
edges of partial tiles included). 2D NVFP4's nibble transpose (numerics.transpose_nvfp4_2d's
data: unpack, transpose the codes, pack again, five torch passes over the weight) is one pass
here: a program unpacks a TILE x TILE block of codes, transposes it and packs the pairs of the
new rows.
"""

from __future__ import annotations

import torch

from ..numerics import pack_nibbles, unpack_nibbles
from .fp8_common import cdiv, jit, tl
from .launch import launch

TILE = 64
WARPS = 4
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (the tiles across the columns)


@jit
def _transpose_kernel(x_ptr, out_ptr, rows, cols, TILE: tl.constexpr):
    row = tl.program_id(0) * TILE + tl.arange(0, TILE)
    col = tl.program_id(1) * TILE + tl.arange(0, TILE)
    inside = (row[:, None] < rows) & (col[None, :] < cols)
    block = tl.load(x_ptr + row[:, None].to(tl.int64) * cols + col[None, :], mask=inside)
    tl.store(out_ptr + col[:, None].to(tl.int64) * rows + row[None, :], tl.trans(block),
             mask=tl.trans(inside))


def transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    """x.t().contiguous() of a contiguous 2D tensor of one-byte elements (FP8, uint8)."""
    if x.dim() != 2 or x.element_size() != 1 or not x.is_contiguous():
        raise ValueError(f"transpose_bytes takes a contiguous 2D tensor of one-byte elements, "
                         f"got shape {tuple(x.shape)}, {x.dtype}, contiguous={x.is_contiguous()}")
    rows, cols = x.shape
    if cdiv(cols, TILE) > MAX_GRID_Y:  # over 4M columns: no weight has them
        return x.t().contiguous()
    out = torch.empty((cols, rows), dtype=x.dtype, device=x.device)
    if x.numel():
        launch(_transpose_kernel, (cdiv(rows, TILE), cdiv(cols, TILE)), x.view(torch.uint8),
               out.view(torch.uint8), rows, cols, num_warps=WARPS, TILE=TILE)
    return out


@jit
def _transpose_nibbles_kernel(x_ptr, out_ptr, rows, cols, TILE: tl.constexpr):
    """Codes [rows, cols] packed two a byte (element 2j low nibble, 2j+1 high) -> the codes of
    the transpose [cols, rows], packed the same way. rows and cols are even."""
    row = tl.program_id(0) * TILE + tl.arange(0, TILE)
    pair = tl.program_id(1) * (TILE // 2) + tl.arange(0, TILE // 2)  # byte columns
    inside = (row[:, None] < rows) & (pair[None, :] < cols // 2)
    packed = tl.load(x_ptr + row[:, None].to(tl.int64) * (cols // 2) + pair[None, :],
                     mask=inside, other=0)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [TILE, TILE])  # [row, col]
    low, high = tl.split(tl.reshape(tl.trans(codes), [TILE, TILE // 2, 2]))  # [col, row pair]
    col = tl.program_id(1) * TILE + tl.arange(0, TILE)
    out_pair = tl.program_id(0) * (TILE // 2) + tl.arange(0, TILE // 2)
    tl.store(out_ptr + col[:, None].to(tl.int64) * (rows // 2) + out_pair[None, :],
             low | (high << 4), mask=(col[:, None] < cols) & (out_pair[None, :] < rows // 2))


def transpose_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles(unpack_nibbles(packed).t().contiguous()) of uint8 [rows, cols / 2] (rows
    even): FP4 codes transposed, [cols, rows / 2]."""
    if packed.dim() != 2 or packed.dtype != torch.uint8 or not packed.is_contiguous():
        raise ValueError(f"transpose_nibbles takes contiguous 2D uint8 (packed FP4 codes), got "
                         f"shape {tuple(packed.shape)}, {packed.dtype}")
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    if cdiv(cols, TILE) > MAX_GRID_Y:  # over 4M columns: numerics' passes
        return pack_nibbles(unpack_nibbles(packed).t().contiguous())
    if rows % 2:
        raise ValueError(f"transpose_nibbles: {rows} rows cannot pack into bytes of the "
                         "transpose; NVFP4 tensors have rows in multiples of 16")
    out = torch.empty((cols, rows // 2), dtype=torch.uint8, device=packed.device)
    if packed.numel():
        launch(_transpose_nibbles_kernel, (cdiv(rows, TILE), cdiv(cols, TILE)), packed, out,
               rows, cols, num_warps=WARPS, TILE=TILE)
    return out
