"""A byte matrix transposed: per-tensor FP8's columnwise copy derived from its rowwise copy.

Why: FSDP2's FP8 all-gather brings each weight's rowwise bytes [N, K], and backward's data
gradient reads the transposed copy [K, N] (torch._scaled_mm takes its second operand
column-major). torch's `data.t().contiguous()` on a float8 tensor runs the generic strided
copy kernel: in call 11's profile of the 1b FSDP2 step on 2 x H200 (BENCHMARKS.md,
twenty-first session) 80 such copies took 5.7 ms of the step, 71 us for weights of at most
16.8 MB, about 0.5 TB/s. Here each program moves one TILE x TILE block of bytes: it loads the
block with its rows contiguous and stores it transposed, the output's rows contiguous.

Bytes are moved, never converted (the data is viewed as uint8), so the result equals
`x.t().contiguous()` bit for bit by construction (tests/gpu/test_transpose_cuda.py checks it,
edges of partial tiles included).
"""

from __future__ import annotations

import torch

from .fp8_common import cdiv, jit, tl
from .launch import launch

TILE = 64
WARPS = 4


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
    out = torch.empty((cols, rows), dtype=x.dtype, device=x.device)
    if x.numel():
        launch(_transpose_kernel, (cdiv(rows, TILE), cdiv(cols, TILE)), x.view(torch.uint8),
               out.view(torch.uint8), rows, cols, num_warps=WARPS, TILE=TILE)
    return out
