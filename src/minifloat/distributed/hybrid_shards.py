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

from ..quantizers import HybridStorage, MXFP8Storage
from .fsdp import aligned_bytes
from .master_weights import cast_targets
from .quantized_shards import QuantizedShardWeight, single_format_parts


def hybrid_parts(storage: HybridStorage) -> tuple[tuple, torch.Tensor, tuple]:
    """(row tensors, shared bytes, meta) of a hybrid weight for QuantizedShardWeight."""
    if storage.rowwise_storage is None or storage.columnwise_storage is None:
        raise NotImplementedError(
            "FSDP2 sharding of a hybrid quantized_model_init weight needs both directions' "
            "sub-storages; this weight holds only one")
    # the bytes ranks own and gather, by rows: the dgrad part gets the rowwise copy its
    # columnwise one derives from, as the master-weight cast writes it
    fprop, dgrad = cast_targets(storage)
    parts = [single_format_parts(fprop),
             single_format_parts(dgrad, columnwise_only=isinstance(dgrad, MXFP8Storage))]
    shared, layouts = aligned_bytes([part[1] for part in parts])
    quantizer = storage.quantizer.copy() if storage.quantizer is not None else None
    if quantizer is not None:
        quantizer.amax_reduction_group = None
    subs = tuple((len(rows), meta, layout)
                 for (rows, _, meta), layout in zip(parts, layouts, strict=True))
    rows = parts[0][0] + parts[1][0]
    return rows, shared, ("hybrid", subs, quantizer, storage.dtype, storage.shape[-1])


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
