"""quantized_model_init hybrid weights (HybridRecipe: a format per direction) sharded as bytes
under FSDP2 (seed 000's hybrid weights, issue 16 item 4).

A hybrid weight holds a rowwise sub-storage in the fprop format and a columnwise one in the
dgrad format. Sharded by rows, the QuantizedShardWeight holds both parts' row tensors, one part
after the other: the fprop format's rowwise bytes (and per-row scales), and the dgrad
format's rowwise bytes where that format derives its columnwise copy exactly (per-tensor FP8,
128x128 blocks, 2D NVFP4: the columnwise copy is rebuilt after the gather) or MXFP8's
columnwise bytes (rows of its [M, K] layout). What every shard shares (scales, tile grids, a
global amax) is packed into one byte tensor, each part's at a 16-byte aligned offset. Forward
gathers the fprop part, backward's re-gather the dgrad part, each packed into the rank's
fixed-size blob as for high-precision hybrid weights (hybrid_gather.py), and
quantize_master_weights casts each part in its own format through shard_storage().
"""

from __future__ import annotations

import torch

from ..quantizers import (
    Float8BlockStorage,
    Float8Storage,
    HybridStorage,
    MXFP8Storage,
    NVFP4Storage,
)
from .quantized_shards import QuantizedShardWeight, single_format_parts

_ALIGN = 16


def _derives_columnwise(storage) -> bool:
    return isinstance(storage, Float8Storage | Float8BlockStorage) or (
        isinstance(storage, NVFP4Storage) and storage.two_dimensional)


def hybrid_parts(storage: HybridStorage) -> tuple[tuple, torch.Tensor, tuple]:
    """(row tensors, shared bytes, meta) of a hybrid weight for QuantizedShardWeight."""
    parts = []
    for columnwise, sub in ((False, storage.rowwise_storage),
                            (True, storage.columnwise_storage)):
        if sub is None:
            raise NotImplementedError(
                "FSDP2 sharding of a hybrid quantized_model_init weight needs both "
                "directions' sub-storages; this weight holds only one")
        if columnwise and _derives_columnwise(sub) and not sub.has_rowwise():
            sub.update_usage(rowwise=True)  # the bytes ranks own and gather, by rows
        parts.append(single_format_parts(sub, columnwise_only=columnwise
                                         and isinstance(sub, MXFP8Storage)))
    shared, layouts = _packed([part[1] for part in parts])
    quantizer = storage.quantizer.copy() if storage.quantizer is not None else None
    if quantizer is not None:
        quantizer.amax_reduction_group = None
    subs = tuple((len(rows), meta, layout)
                 for (rows, _, meta), layout in zip(parts, layouts, strict=True))
    rows = parts[0][0] + parts[1][0]
    return rows, shared, ("hybrid", subs, quantizer, storage.dtype, storage.shape[-1])


def _packed(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple]]:
    """The tensors' bytes in one uint8 tensor, each at a 16-byte aligned offset, and each
    one's (offset, bytes, dtype, shape) to view it back."""
    pieces, layouts, offset = [], [], 0
    for tensor in tensors:
        flat = tensor.contiguous().view(-1).view(torch.uint8)
        padding = -flat.numel() % _ALIGN
        pieces += [flat, flat.new_zeros(padding)] if padding else [flat]
        layouts.append((offset, flat.numel(), tensor.dtype, tuple(tensor.shape)))
        offset += flat.numel() + padding
    return torch.cat(pieces), layouts


def _part(weight: QuantizedShardWeight, index: int) -> QuantizedShardWeight:
    """The single-format QuantizedShardWeight of part `index` (0: fprop, 1: dgrad), over the
    weight's own tensors (views: writes reach the weight)."""
    _, subs, _, _, _ = weight._meta
    first = sum(count for count, _, _ in subs[:index])
    count, meta, (offset, size, dtype, shape) = subs[index]
    shared = weight._shared[offset:offset + size].view(dtype).view(shape)
    return QuantizedShardWeight(weight._rows[first:first + count], shared, meta)


def hybrid_rank_gather_inputs(weight: QuantizedShardWeight, backward: bool, world: int
                              ) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """Forward: the fprop part's bytes; backward: the dgrad part's, packed into one blob."""
    from .hybrid_gather import packed_hybrid_inputs

    inputs, inner = _part(weight, 1 if backward else 0)._rank_gather_inputs()
    return packed_hybrid_inputs(inputs, inner, weight._meta[2],
                                (weight._data.shape[0], weight._meta[4]), backward, world)


def hybrid_shard_storage(weight: QuantizedShardWeight) -> HybridStorage:
    _, _, quantizer, dtype, columns = weight._meta
    rowwise, columnwise = (_part(weight, index).shard_storage() for index in (0, 1))
    return HybridStorage(shape=(weight._data.shape[0], columns), dtype=dtype,
                         quantizer=quantizer, rowwise_storage=rowwise,
                         columnwise_storage=columnwise)
