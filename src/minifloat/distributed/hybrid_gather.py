"""FSDP2 low-precision all-gather of hybrid weights: each direction in its own format (seed 000).

A hybrid weight (HybridRecipe: e.g. MXFP8 forward, NVFP4 backward) has a rowwise copy in the
fprop format and a columnwise copy in the dgrad format. Forward gathers the rowwise child's
bytes; the backward re-gather gathers the columnwise child's, each with the single-format logic
of fsdp.format_gather_inputs (amax and cut tiles reduced over the shard group, MXFP8's
columnwise copy gathered as such). For the formats that derive their columnwise copy from the
rowwise one exactly (per-tensor FP8, 128x128 blocks, 2D NVFP4: NUMERICS.md §9), the columnwise
child's rowwise bytes are gathered and the columnwise copy is derived after the gather: the
bytes of quantizing the full weight columnwise with that child on one rank.

Why one byte blob per rank: FSDP2 allocates a weight's all-gather buffers at its first gather
and keeps their count and sizes, but the two directions' formats give different tensors (MXFP8
data and scales against NVFP4 nibbles and scales). Each rank packs its inputs into one uint8
[rows, row_bytes] tensor, row_bytes an upper bound of both formats' bytes per row (fixed per
weight), so every gather has the same one input; post-gather unpacks the ranks' pieces and
concatenates them per input (one copy of the gathered bytes). The bound keeps the gather at
about 0.52x a bf16 gather when one direction is 8-bit, 0.3x when both are NVFP4.
"""

from __future__ import annotations

import math

import torch

from ..quantizers import HybridQuantizer, HybridStorage, NVFP4Quantizer, Quantizer
from .fsdp import _gathered_storage, format_gather_inputs

_ALIGN = 16  # each packed input starts at a 16-byte offset, so it views back without a copy
_MAX_INPUTS = 3


def hybrid_gather_inputs(shard: torch.Tensor, hybrid: HybridQuantizer, mesh, outer_size,
                         backward: bool) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """One rank's all-gather input, [rows, row_bytes] uint8, and the metadata to unpack it:
    the rowwise child's bytes for forward, the columnwise child's for `backward`."""
    child = hybrid.columnwise_quantizer if backward else hybrid.rowwise_quantizer
    inputs, inner = format_gather_inputs(shard, child, mesh, outer_size, backward)
    return packed_hybrid_inputs(inputs, inner, hybrid, shard.shape, backward, mesh.size())


def packed_hybrid_inputs(inputs: tuple[torch.Tensor, ...], inner: tuple,
                         hybrid: HybridQuantizer, shape: tuple[int, int], backward: bool,
                         world: int) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """One direction's gather inputs packed into the rank's fixed-size blob, and the metadata
    hybrid_gathered_storage unpacks it with (also for quantized_model_init hybrid weights
    sharded as bytes: hybrid_shards.py)."""
    rows, columns = shape
    child = hybrid.columnwise_quantizer if backward else hybrid.rowwise_quantizer
    row_bytes = max(_row_bytes_bound(q, columns, rows)
                    for q in (hybrid.rowwise_quantizer, hybrid.columnwise_quantizer))
    blob = inputs[0].new_zeros(rows * row_bytes, dtype=torch.uint8)
    layout, offset = [], 0
    for tensor in inputs:
        flat = tensor.contiguous().view(-1).view(torch.uint8)
        if offset + flat.numel() > blob.numel():
            raise RuntimeError(
                f"hybrid all-gather: {type(child).__name__} wrote more bytes than the bound of "
                f"{row_bytes} a row ({rows} x {columns} shard); this is a bug in "
                "hybrid_gather._row_bytes_bound")
        blob[offset:offset + flat.numel()] = flat
        layout.append((offset, flat.numel(), tensor.dtype, tuple(tensor.shape)))
        offset += flat.numel() + (-flat.numel() % _ALIGN)
    hybrid_copy = hybrid.copy()
    for quantizer in (hybrid_copy, hybrid_copy.rowwise_quantizer,
                      hybrid_copy.columnwise_quantizer):
        quantizer.amax_reduction_group = None  # nothing in the metadata holds a group
    metadata = ("hybrid", backward, hybrid_copy, world, rows, tuple(layout), inner)
    return (blob.view(rows, row_bytes),), metadata


def hybrid_gathered_storage(outputs: tuple[torch.Tensor, ...], metadata: tuple, columns: int,
                            param_dtype: torch.dtype) -> HybridStorage:
    """The gathered blobs as a HybridStorage holding the one direction this gather was for."""
    _, backward, hybrid, world, rows, layout, inner = metadata
    pieces = outputs[0].reshape(world, -1)
    gathered = []
    for offset, size, dtype, shape in layout:
        gathered.append(torch.cat([pieces[rank, offset:offset + size].view(dtype).view(shape)
                                   for rank in range(world)]))
    storage = _gathered_storage(tuple(gathered), inner, columns, param_dtype)
    if backward and not storage.has_columnwise():  # a format that derives it exactly
        storage.update_usage(rowwise=False, columnwise=True)
    return HybridStorage(shape=storage.shape, dtype=param_dtype, quantizer=hybrid,
                         rowwise_storage=None if backward else storage,
                         columnwise_storage=storage if backward else None)


def _row_bytes_bound(quantizer: Quantizer, columns: int, rows: int) -> int:
    """Bytes a row of the rank's packed inputs may take: the data (one byte an element, half
    for NVFP4), the scales (at most one byte per 16 elements for NVFP4, per 32 for MXFP8, four
    per 128x128 tile for blocks: below one per 32), and the 16-byte alignment of up to three
    inputs spread over the rows."""
    if isinstance(quantizer, NVFP4Quantizer):
        per_row = columns // 2 + math.ceil(columns / 16)
    else:
        per_row = columns + math.ceil(columns / 32)
    return per_row + math.ceil(_ALIGN * _MAX_INPUTS / rows)
