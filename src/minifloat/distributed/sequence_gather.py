"""Sequence parallelism with a quantized all-gather (issue 17): a column-parallel layer's input
gathered as FP8 bytes, not bf16.

Under sequence parallelism each rank holds a slice of the rows (the sequence) of a
column-parallel layer's input, and every rank needs all of them. For per-tensor FP8 (current
scaling, with the amax all-reduced over the TP group for this one call as seed 003 asks; or
delayed scaling, whose scale is the recipe state's) each rank quantizes its own rows, the
ranks all-gather the one-byte codes, and the gathered codes with the shared scale_inv are
exactly the single-rank quantization of the whole input (each code depends only on its value
and the scale). The transposed copy for the weight gradient is made from the gathered bytes.

The same holds in backward for a row-parallel layer's output gradient (its forward
reduce-scatters the output along the rows; backward gathers the gradient's rows as FP8 codes:
gather_grad_output).

MXFP8 keeps both copies with scales of their own, each laid out [rows, ...]: when a rank's row
count is a multiple of 32 (no block crosses a rank), each rank quantizes its rows in the
copies asked for and the codes and E8M0 scales of each are gathered along the rows (about as
many bytes as bf16 when both copies travel, but each rank quantizes only its own rows).

Other formats gather in high precision and quantize the whole gathered tensor: their
columnwise copies (blocks along the rows: 1x128 or 128x128 blocks, NVFP4's 16 with the
Hadamard transform) cannot be made from rowwise codes here.
"""

from __future__ import annotations

from typing import Any

import torch

from ..quantizers import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Storage,
    MXFP8Quantizer,
    MXFP8Storage,
    Quantizer,
)
from .tensor_parallel import _all_gather_dim0, _reduce_scatter_dim0

_MX_BLOCK = 32


def gathers_quantized(quantizer: Quantizer, rows: int) -> bool:
    """Whether a tensor of this quantizer, `rows` rows on this rank, can be gathered as its
    quantized bytes: per-tensor FP8, or MXFP8 on whole 32-row blocks."""
    kind = type(quantizer)
    if kind in (Float8CurrentScalingQuantizer, Float8Quantizer):
        return True
    return kind is MXFP8Quantizer and rows % _MX_BLOCK == 0


def gather_quantized_rows(x2d: torch.Tensor, quantizer: Quantizer, group: Any, *,
                          columnwise: bool, rowwise: bool = True
                          ) -> Float8Storage | MXFP8Storage:
    """This rank's rows quantized (the amax reduced over `group` for current scaling), the
    codes all-gathered along the rows, the transposed copy derived when asked (per-tensor FP8:
    the rowwise copy is always made; MXFP8: the copies asked for, gathered each)."""
    if type(quantizer) is MXFP8Quantizer:
        return _gather_mxfp8_rows(x2d, quantizer, group, rowwise=rowwise,
                                  columnwise=columnwise)
    local_quantizer = quantizer.copy()
    if isinstance(local_quantizer, Float8CurrentScalingQuantizer):
        local_quantizer.amax_reduction_group = group
    local_quantizer.set_usage(rowwise=True, columnwise=False)
    local_quantizer.internal = True
    local = local_quantizer.quantize(x2d)
    codes = _all_gather_dim0(local.data.view(torch.uint8), group)
    gathered = Float8Storage(shape=codes.shape, dtype=x2d.dtype, quantizer=local.quantizer,
                             data=codes.view(local.fp8_dtype), data_transpose=None,
                             scale_inv=local.scale_inv, fp8_dtype=local.fp8_dtype)
    if columnwise:
        gathered.update_usage(columnwise=True)
    return gathered


def gather_grad_output(dy2d: torch.Tensor, quantizer: Quantizer, group: Any, *,
                       rowwise: bool, columnwise: bool) -> Any:
    """A row-parallel layer's output gradient: this rank's rows gathered over `group` and
    quantized for dgrad (rowwise) and wgrad (columnwise): as bytes for per-tensor FP8, else in
    high precision and quantized whole (the single-rank bytes either way)."""
    if gathers_quantized(quantizer, dy2d.shape[0]):
        return gather_quantized_rows(dy2d, quantizer, group, columnwise=columnwise,
                                     rowwise=rowwise)
    full = _all_gather_dim0(dy2d, group)
    quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    quantizer.internal = True
    return quantizer.quantize(full)


def scatter_rows(y2d: torch.Tensor, group: Any) -> torch.Tensor:
    """The partial products of a row-parallel layer summed over `group`, this rank's rows."""
    return _reduce_scatter_dim0(y2d, group)


def _gather_mxfp8_rows(x2d: torch.Tensor, quantizer: MXFP8Quantizer, group: Any, *,
                       rowwise: bool, columnwise: bool) -> MXFP8Storage:
    local_quantizer = quantizer.copy()
    local_quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    local_quantizer.internal = True
    local = local_quantizer.quantize(x2d)
    fields = {}
    for name in local.tensor_fields():
        tensor = getattr(local, name)
        if tensor is None:
            fields[name] = None
            continue
        gathered = _all_gather_dim0(tensor.contiguous().view(torch.uint8), group)
        fields[name] = gathered.view(tensor.dtype)
    rows = (fields["rowwise_data"] if rowwise else fields["columnwise_data"]).shape[0]
    return MXFP8Storage(shape=(rows, x2d.shape[1]), dtype=x2d.dtype,
                        quantizer=local.quantizer, fp8_dtype=local.fp8_dtype, **fields)
