"""quantized_model_init weights under FSDP2: FP8 bytes sharded and gathered as they are.

Why: a model built under `quantized_model_init` holds its weights in FP8 only (TE's
fp8_model_params), with fp32 master copies kept by the optimizer. `fully_shard` splits
parameters with tensor ops, which a QuantizedTensor answers with its high-precision values, so
the weights would silently stop being FP8. `enable_low_precision_all_gather` therefore wraps each
such weight in `QuantizedShardWeight`: a tensor subclass over the weight's rowwise FP8 bytes
(uint8 [M, K]) and its shared scale_inv. FSDP2 shards and pads the bytes like any tensor (the
wrapper survives the ops it applies), all-gathers them through its extension hooks without any
cast, and the gathered bytes become the QuantizedTensor weight the module uses.

Updates go through the master weights: the optimizer steps each rank's fp32 master rows, then
`quantize_master_weights(fsdp_params, masters, start_offsets, group)` casts them into the rank's
shard with the amax all-reduced over the group, so every shard keeps one scale_inv, and the
gathered weight is the full master's cast, bit for bit.

Per-tensor FP8 (current and delayed scaling) weights only; other formats are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from ..quantizers import Float8Storage, QuantizedTensor, Quantizer


class QuantizedShardWeight(torch.Tensor):
    """FP8 weight bytes (or an FSDP2 shard of them) with the weight's scale_inv and quantizer;
    FSDP2 all-gathers the bytes unchanged."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: torch.dtype,
                quantizer: Quantizer, dtype: torch.dtype) -> QuantizedShardWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=dtype, device=data.device, layout=data.layout, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: torch.dtype,
                 quantizer: Quantizer, dtype: torch.dtype) -> None:
        self._data = data  # uint8 bytes of the rows
        self._scale_inv = scale_inv  # shared by every shard of the weight
        self._fp8_dtype = fp8_dtype
        self._quantizer = quantizer

    @staticmethod
    def of(weight: QuantizedTensor) -> QuantizedShardWeight:
        storage = weight.quantized_storage
        if not isinstance(storage, Float8Storage) or storage.data is None:
            raise NotImplementedError(
                f"FSDP2 sharding of quantized_model_init weights covers per-tensor FP8 with a "
                f"rowwise copy; this weight is {storage!r}. Build the model without "
                "quantized_model_init to shard it (FSDP2 then gathers high-precision weights, or "
                "quantized ones with enable_low_precision_all_gather)")
        quantizer = storage.quantizer.copy() if storage.quantizer is not None else None
        return QuantizedShardWeight(storage.data.view(torch.uint8), storage.scale_inv,
                                    storage.fp8_dtype, quantizer, storage.dtype)

    def __repr__(self) -> str:
        return f"QuantizedShardWeight({tuple(self.shape)}, {self._fp8_dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data", "_scale_inv"], (self._fp8_dtype, self._quantizer, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        fp8_dtype, quantizer, dtype = meta
        return QuantizedShardWeight(inner_tensors["_data"], inner_tensors["_scale_inv"],
                                    fp8_dtype, quantizer, dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(a for a in tree_leaves((args, kwargs))
                     if isinstance(a, QuantizedShardWeight))
        if func not in _KEEP_WRAPPER:
            raise NotImplementedError(
                f"{func} on FP8 weight bytes that FSDP2 shards: update the fp32 master weights "
                "and cast them with minifloat.distributed.quantize_master_weights")
        unwrap = tree_map_only(QuantizedShardWeight, lambda t: t._data, (args, kwargs))
        out = func(*unwrap[0], **unwrap[1])
        return tree_map_only(
            torch.Tensor, lambda t: QuantizedShardWeight(t, first._scale_inv, first._fp8_dtype,
                                                         first._quantizer, first.dtype), out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The rank's bytes as they are; the shared scale_inv travels as metadata."""
        return (self._data,), ("fp8", self._quantizer, self._fp8_dtype, self._scale_inv)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        from .fsdp import refill_or_wrap

        return refill_or_wrap(all_gather_outputs, metadata, self.shape[1], param_dtype, out)

    def shard_storage(self) -> Float8Storage:
        """A storage over these bytes (quantize_master_weights writes into it in place)."""
        data = self._data.view(self._fp8_dtype)
        return Float8Storage(shape=data.shape, dtype=self.dtype, quantizer=self._quantizer,
                             data=data, data_transpose=None, scale_inv=self._scale_inv,
                             fp8_dtype=self._fp8_dtype)


# ops FSDP2 applies to a parameter when sharding, padding and copying it: the result is the same
# bytes (or a piece of them), so it keeps the wrapper
_KEEP_WRAPPER = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.narrow.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.chunk.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
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
