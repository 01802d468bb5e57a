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

Block formats keep both copies with scales of their own. When a rank's row count is a multiple
of the format's block along the rows (MXFP8 32, 1x128 blocks 128, NVFP4 16: no block crosses a
rank), each rank quantizes its rows in the copies asked for (NVFP4's global amaxes reduced over
the group) and every code and scale tensor is gathered along the rows: dim 0 of the rowwise
copies and of MXFP8's columnwise copy, dim 1 of the transposed columnwise copies of 1x128
blocks and NVFP4. Each rank quantizes only its own rows; the gathered copies are the single
rank's bytes (NVFP4 gradients with stochastic rounding draw their own random bits). Otherwise
the rows gather in high precision and the gathered tensor is quantized whole.
"""

from __future__ import annotations

from typing import Any

import torch

from ..quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Storage,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizedStorage,
    Quantizer,
)
from .tensor_parallel import _all_gather_dim0, _reduce_scatter_dim0


def _row_block(quantizer: Quantizer) -> int | None:
    """The block a format's copies span along the rows, or None where the rows cannot be
    gathered as codes (2D tiles, other formats)."""
    kind = type(quantizer)
    if kind is MXFP8Quantizer:
        return 32
    if kind is Float8BlockQuantizer and quantizer.block_scaling_dim == 1:
        return 128
    if kind is NVFP4Quantizer and not quantizer.with_2d_quantization:
        return 16
    return None


def gathers_quantized(quantizer: Quantizer, rows: int) -> bool:
    """Whether a tensor of this quantizer, `rows` rows on this rank, can be gathered as its
    quantized bytes: per-tensor FP8, or a block format on whole blocks."""
    if type(quantizer) in (Float8CurrentScalingQuantizer, Float8Quantizer):
        return True
    block = _row_block(quantizer)
    return block is not None and rows % block == 0


def gather_quantized_rows(x2d: torch.Tensor, quantizer: Quantizer, group: Any, *,
                          columnwise: bool, rowwise: bool = True) -> QuantizedStorage:
    """This rank's rows quantized (the amax reduced over `group` for current scaling), the
    codes all-gathered along the rows, the transposed copy derived when asked (per-tensor FP8:
    the rowwise copy is always made; block formats: the copies asked for, gathered each)."""
    if _row_block(quantizer) is not None:
        return _gather_block_rows(x2d, quantizer, group, rowwise=rowwise,
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


def _gather_block_rows(x2d: torch.Tensor, quantizer: Quantizer, group: Any, *,
                       rowwise: bool, columnwise: bool) -> QuantizedStorage:
    local_quantizer = quantizer.copy()
    local_quantizer.amax_reduction_group = group  # NVFP4's global amaxes: the whole tensor's
    local_quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    local_quantizer.internal = True
    local = local_quantizer.quantize(x2d)
    fields = {}
    for name in local.tensor_fields():
        tensor = getattr(local, name)
        if tensor is None or name.startswith("amax"):  # absent, or equal on every rank
            fields[name] = tensor
            continue
        along_columns = name.startswith("columnwise") and not isinstance(
            local_quantizer, MXFP8Quantizer)  # transposed copies: the rows are dim 1
        fields[name] = _gather_rows_of(tensor, group, along_columns)
    settings = {key: value for key, value in vars(local).items()
                if key not in ("shape", "dtype", "quantizer") and key not in fields}
    rows = x2d.shape[0] * torch.distributed.get_world_size(group)
    return type(local)(shape=(rows, x2d.shape[1]), dtype=x2d.dtype, quantizer=local.quantizer,
                       **settings, **fields)


def _gather_rows_of(tensor: torch.Tensor, group: Any, along_columns: bool) -> torch.Tensor:
    """All-gather along dim 0, or along dim 1 (through a transpose), as bytes."""
    wire = tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor
    if along_columns:
        gathered = _all_gather_dim0(wire.t().contiguous(), group).t().contiguous()
    else:
        gathered = _all_gather_dim0(wire, group)
    return gathered.view(tensor.dtype)
