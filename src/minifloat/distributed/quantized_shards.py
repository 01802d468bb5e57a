"""quantized_model_init weights under FSDP2: quantized bytes sharded and gathered as they are.

Why: a model built under `quantized_model_init` holds its weights quantized only (TE's
fp8_model_params), with fp32 master copies kept by the optimizer. `fully_shard` splits
parameters with tensor ops, which a QuantizedTensor answers with its high-precision values, so
the weights would silently stop being quantized. `enable_low_precision_all_gather` therefore
wraps each such weight in `QuantizedShardWeight`: a tensor subclass over the weight's rowwise
bytes (and NVFP4's per-row scales) and what all shards share (scale_inv, or NVFP4's global
amax). FSDP2 shards and pads the bytes like any tensor (the wrapper survives the ops it
applies), all-gathers them through its extension hooks without any cast, and the gathered bytes
become the QuantizedTensor weight the module uses.

Updates go through the master weights: the optimizer steps each rank's fp32 master rows, then
`quantize_master_weights(fsdp_params, masters, start_offsets, group)` casts them into the rank's
shard with the maxima all-reduced over the group, so every shard keeps the shared values, and
the gathered weight is the full master's cast, bit for bit.

Per-tensor FP8 (current and delayed scaling), 128x128 block FP8, MXFP8 (both copies) and 2D NVFP4
weights, and hybrids of them (hybrid_shards.py); other formats are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from ..quantizers import (
    Float8BlockStorage,
    Float8Storage,
    HybridStorage,
    MXFP8Storage,
    NVFP4Storage,
    QuantizedTensor,
)
from .presigned import presigned


class QuantizedShardWeight(torch.Tensor):
    """Quantized weight bytes (or an FSDP2 shard of them) with what every shard shares; FSDP2
    all-gathers the bytes unchanged.

    `_rows`: tensors with one row per weight row, the first the rowwise bytes; `_shared`: what
    every shard holds alike. Per-tensor FP8: the bytes [rows, K]; the scale_inv. 128x128 block
    FP8: the bytes; the whole weight's tile grid (a tile's rows may lie on two ranks; the grid is
    small and equal everywhere after quantize_master_weights). 2D NVFP4: the packed codes
    [rows, K/2] and the per-row E4M3 block scales [rows, K/16]; the global amax. MXFP8: the
    rowwise bytes, their per-row E8M0 scales [rows, K/32] and the columnwise bytes [rows, K]; the
    columnwise scale grid [M/32, K]. Every row-wise op FSDP2 applies (split, narrow, copy_,
    new_zeros, view) is applied to each row tensor with its own width.
    """

    @staticmethod
    def __new__(cls, rows: tuple, shared: torch.Tensor, meta: tuple) -> QuantizedShardWeight:
        kind, _, _, dtype, columns = meta
        data = rows[0]
        shape = (data.shape[0], columns) if data.dim() == 2 else (data.numel() * _ELEMENTS[kind],)
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=data.device, requires_grad=False)

    def __init__(self, rows: tuple, shared: torch.Tensor, meta: tuple) -> None:
        self._rows = tuple(rows)  # uint8 row tensors, the rowwise bytes first
        for index, tensor in enumerate(self._rows):  # the names __tensor_flatten__ gives
            setattr(self, f"_row{index}", tensor)
        self._shared = shared  # the same for every shard of the weight
        self._meta = meta  # (kind, element dtype(s), quantizer, nominal dtype, K)

    @property
    def _data(self) -> torch.Tensor:
        return self._rows[0]

    @staticmethod
    def of(weight: QuantizedTensor) -> QuantizedShardWeight:
        storage = weight.quantized_storage
        if isinstance(storage, HybridStorage):
            from .hybrid_shards import hybrid_parts

            return QuantizedShardWeight(*hybrid_parts(storage))
        return QuantizedShardWeight(*single_format_parts(storage))

    def __repr__(self) -> str:
        return f"QuantizedShardWeight({tuple(self.shape)}, {self._meta[0]})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return [f"_row{i}" for i in range(len(self._rows))] + ["_shared"], self._meta

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        rows = tuple(inner_tensors[f"_row{i}"] for i in range(len(inner_tensors) - 1))
        return QuantizedShardWeight(rows, inner_tensors["_shared"], meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(a for a in tree_leaves((args, kwargs))
                     if isinstance(a, QuantizedShardWeight))
        if func is torch.ops.aten._to_copy.default:
            return _relabeled(first, **kwargs)
        if func not in _ROW_OPS:
            raise NotImplementedError(
                f"{func} on quantized weight bytes that FSDP2 shards: update the fp32 master "
                "weights and cast them with minifloat.distributed.quantize_master_weights")
        results = [_apply(func, args, kwargs, index, first)
                   for index in range(len(first._rows))]
        if isinstance(results[0], torch.Tensor):
            return QuantizedShardWeight(tuple(results), first._shared, first._meta)
        return type(results[0])(QuantizedShardWeight(rows, first._shared, first._meta)
                                for rows in zip(*results, strict=True))

    @presigned
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The rank's bytes as they are; what shards share travels as metadata. MXFP8 sends its
        rowwise copy for forward and its columnwise copy for backward (same sizes: FSDP2 keeps
        a weight's first gather buffers), or both at once where FSDP2 keeps the weight gathered
        after forward (kept_gathered.py); so do hybrids."""
        from .fsdp import directed_gather_inputs

        return directed_gather_inputs(
            lambda backward: self._rank_gather_inputs(mesh.size(), backward),
            self._meta[0] in ("mxfp8", "hybrid"), module, mesh)

    def _rank_gather_inputs(self, world: int = 1, backward: bool = False
                            ) -> tuple[tuple[torch.Tensor, ...], tuple]:
        kind, element_dtype, quantizer, _, _ = self._meta
        if kind == "fp8":
            return (self._data,), ("fp8", quantizer, element_dtype, self._shared)
        if kind == "block":  # the full scale grid, equal on every rank
            return (self._data,), ("block_grid", quantizer, element_dtype, self._shared)
        if kind == "nvfp4":
            return self._rows, ("nvfp4", quantizer, element_dtype, self._shared)
        if kind == "mxfp8_rowwise":  # a hybrid weight's forward part
            data, scale = self._rows
            return (data, scale), ("mxfp8", quantizer, (element_dtype, scale.dtype), "rowwise")
        if kind == "mxfp8_columnwise":  # a hybrid weight's backward part; the whole grid
            return self._rows, ("mxfp8_grid", quantizer, (element_dtype, torch.uint8),
                                self._shared)
        if kind == "hybrid":
            from .hybrid_shards import hybrid_rank_gather_inputs

            return hybrid_rank_gather_inputs(self, backward, world)
        data, scale, columnwise = self._rows
        if backward:  # backward's re-gather
            return ((columnwise, torch.zeros_like(scale)),
                    ("mxfp8_grid", quantizer, (element_dtype, scale.dtype), self._shared))
        return (data, scale), ("mxfp8", quantizer, (element_dtype, scale.dtype), "rowwise")

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        from .fsdp import refill_or_wrap

        return refill_or_wrap(all_gather_outputs, metadata, self._meta[4], param_dtype, out)

    def shard_storage(self) -> (Float8Storage | Float8BlockStorage | NVFP4Storage | MXFP8Storage
                                | HybridStorage):
        """A storage over these bytes (quantize_master_weights writes into it in place)."""
        kind, element_dtype, quantizer, dtype, columns = self._meta
        shape = (self._data.shape[0], columns)
        if kind == "hybrid":
            from .hybrid_shards import hybrid_shard_storage

            return hybrid_shard_storage(self)
        if kind in ("mxfp8_rowwise", "mxfp8_columnwise"):
            rowwise = kind == "mxfp8_rowwise"
            return MXFP8Storage(
                shape=shape, dtype=dtype, quantizer=quantizer, fp8_dtype=element_dtype,
                rowwise_data=self._data.view(element_dtype) if rowwise else None,
                rowwise_scale=self._rows[1] if rowwise else None,
                columnwise_data=None if rowwise else self._data.view(element_dtype),
                columnwise_scale=None if rowwise else self._shared)
        if kind == "fp8":
            return Float8Storage(shape=shape, dtype=dtype, quantizer=quantizer,
                                 data=self._data.view(element_dtype), data_transpose=None,
                                 scale_inv=self._shared, fp8_dtype=element_dtype)
        if kind == "block":  # rows of the bytes; the whole weight's tile grid
            return Float8BlockStorage(shape=shape, dtype=dtype, quantizer=quantizer,
                                      rowwise_data=self._data.view(element_dtype),
                                      rowwise_scale_inv=self._shared, columnwise_data=None,
                                      columnwise_scale_inv=None, block_scaling_dim=2)
        if kind == "nvfp4":
            return NVFP4Storage(shape=shape, dtype=dtype, quantizer=quantizer,
                                rowwise_data=self._data,
                                rowwise_scale=self._rows[1].view(element_dtype),
                                amax_rowwise=self._shared, columnwise_data=None,
                                columnwise_scale=None, amax_columnwise=None,
                                two_dimensional=True, with_rht=False)
        data, scale, columnwise = self._rows  # rows of both copies; the whole columnwise grid
        return MXFP8Storage(shape=shape, dtype=dtype, quantizer=quantizer,
                            fp8_dtype=element_dtype, rowwise_data=data.view(element_dtype),
                            rowwise_scale=scale, columnwise_data=columnwise.view(element_dtype),
                            columnwise_scale=self._shared)


def single_format_parts(storage, columnwise_only: bool = False) -> tuple[tuple, torch.Tensor,
                                                                           tuple]:
    """(row tensors, shared tensor, meta) of one format's storage: what a QuantizedShardWeight
    holds. columnwise_only: a hybrid weight's columnwise MXFP8 sub-storage (its columnwise
    bytes alone; the other formats keep a rowwise copy there, the columnwise one derived)."""
    quantizer = storage.quantizer.copy() if storage.quantizer is not None else None
    columns, nominal = storage.shape[-1], storage.dtype
    if isinstance(storage, Float8Storage) and storage.data is not None:
        return ((storage.data.view(torch.uint8),), storage.scale_inv,
                ("fp8", storage.fp8_dtype, quantizer, nominal, columns))
    if (isinstance(storage, Float8BlockStorage) and storage.block_scaling_dim == 2
            and storage.rowwise_data is not None):  # the tile grid is shared, whole
        data = storage.rowwise_data
        return ((data.view(torch.uint8),), storage.rowwise_scale_inv,
                ("block", data.dtype, quantizer, nominal, columns))
    if (isinstance(storage, NVFP4Storage) and storage.two_dimensional
            and storage.rowwise_data is not None):
        scale = storage.rowwise_scale
        return ((storage.rowwise_data, scale.view(torch.uint8)), storage.amax_rowwise,
                ("nvfp4", scale.dtype, quantizer, nominal, columns))
    if (isinstance(storage, MXFP8Storage) and columnwise_only
            and storage.columnwise_data is not None):
        return ((storage.columnwise_data.view(torch.uint8),), storage.columnwise_scale,
                ("mxfp8_columnwise", storage.fp8_dtype, quantizer, nominal, columns))
    if isinstance(storage, MXFP8Storage) and storage.rowwise_data is not None:
        rows = (storage.rowwise_data.view(torch.uint8), storage.rowwise_scale)
        if storage.columnwise_data is None:  # a hybrid weight's forward (rowwise) part
            return (rows, storage.rowwise_scale.new_zeros(1),
                    ("mxfp8_rowwise", storage.fp8_dtype, quantizer, nominal, columns))
        return ((*rows, storage.columnwise_data.view(torch.uint8)), storage.columnwise_scale,
                ("mxfp8", storage.fp8_dtype, quantizer, nominal, columns))
    raise NotImplementedError(
        f"FSDP2 sharding of quantized_model_init weights covers per-tensor FP8, 128x128 "
        f"block FP8, MXFP8 and 2D NVFP4 with a rowwise copy, and hybrids of them; this weight "
        f"is {storage!r}. Build the model without quantized_model_init to shard it (FSDP2 "
        "then gathers high-precision weights, or quantized ones with "
        "enable_low_precision_all_gather)")


# elements per stored byte of the rowwise bytes: FP8 one, NVFP4 two (packed nibbles)
_ELEMENTS = {"fp8": 1, "block": 1, "mxfp8": 1, "mxfp8_rowwise": 1, "mxfp8_columnwise": 1,
             "nvfp4": 2, "hybrid": 1}


def _relabeled(weight: QuantizedShardWeight, *, dtype: torch.dtype | None = None,
               device: torch.device | None = None, **_) -> QuantizedShardWeight:
    """`.to(dtype)` (FSDP2's mixed-precision param_dtype before the all-gather) names the
    dtype the gathered weight computes in; the bytes stay as they are. A device moves them."""
    kind, element_dtype, quantizer, nominal, columns = weight._meta
    rows, shared = weight._rows, weight._shared
    if device is not None:
        rows = tuple(t.to(device) for t in rows)
        shared = shared.to(device)
    return QuantizedShardWeight(rows, shared, (kind, element_dtype, quantizer, dtype or nominal,
                                               columns))


def _apply(func, args, kwargs, index: int, first: QuantizedShardWeight):
    """func on row tensor `index` of every wrapper in the arguments; a new tensor's size (given
    in the weight's elements) is converted to that tensor's width."""
    unwrapped = tree_map_only(QuantizedShardWeight, lambda t: t._rows[index], (args, kwargs))
    call_args, call_kwargs = list(unwrapped[0]), unwrapped[1]
    if func in _SIZED_OPS and len(call_args) > 1:
        inner = first._rows[index]
        size = list(call_args[1])
        if len(size) == 2:
            size[1] = inner.shape[1]
        elif size != [-1]:
            size = [size[0] * inner.numel() // first.numel()]
        call_args[1] = size
    return func(*call_args, **call_kwargs)


# ops FSDP2 applies to a parameter when sharding, padding and copying it: row-wise, so each
# keeps the wrapper; _SIZED_OPS take a size in the weight's elements
_SIZED_OPS = {
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_empty.default,
}
_ROW_OPS = _SIZED_OPS | {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.narrow.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.chunk.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.copy_.default,
    torch.ops.aten._pin_memory.default,
}


def local_shard(weight: torch.Tensor) -> tuple[QuantizedShardWeight, int] | None:
    """(the rank's QuantizedShardWeight, index of its first row in the full weight) of an
    FSDP2-sharded quantized weight (a DTensor over one), or None for anything else."""
    local = getattr(weight, "_local_tensor", weight)
    if not isinstance(local, QuantizedShardWeight):
        return None
    mesh = getattr(weight, "device_mesh", None)
    rank = mesh.get_local_rank() if mesh is not None else 0
    return local, rank * local.shape[0]
