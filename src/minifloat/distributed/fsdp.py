"""FSDP2 low-precision all-gather (issue 16, mode b): weights gathered as FP8 bytes.

`enable_low_precision_all_gather(model, recipe)` wraps the weights of minifloat modules in
`LowPrecisionGatherWeight`, a tensor subclass over the high-precision shard, before
`fully_shard`. FSDP2 then calls its all-gather extension hooks:

- `fsdp_pre_all_gather`: the rank quantizes its shard of rows with the weight quantizer of the
  recipe. The per-tensor amax is all-reduced over the shard group first, through a throwaway
  copy of the quantizer that holds the group for that one call (seed 003): the quantizer kept
  here never holds a group. Only the rowwise bytes are gathered (one byte per element instead
  of two for bf16).
- `fsdp_post_all_gather`: the gathered bytes and the shared scale become a QuantizedTensor
  weight; the module uses it as it uses quantized_model_init weights (the transposed copy for
  the data gradient is made from the gathered bytes).

Because the amax is the maximum over every shard, the gathered bytes are those of quantizing the
full weight on one rank, bit for bit. Supported: per-tensor FP8 with current scaling. Other
weight formats raise a clear error (not written yet). The optimizer updates the high-precision
shards; the next forward quantizes them again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..quantizers import Float8CurrentScalingQuantizer, Float8Storage, QuantizedTensor, Quantizer

# ops whose result is the same weight shard (or a piece of it) and so keeps the wrapper: what
# FSDP2 applies to a parameter when sharding, padding and copying it
_KEEP_WRAPPER = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.chunk.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.copy_.default,
    torch.ops.aten._pin_memory.default,
}


class LowPrecisionGatherWeight(torch.Tensor):
    """A high-precision weight (or FSDP2 shard of one) that FSDP2 all-gathers quantized."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor, quantizer: Quantizer) -> LowPrecisionGatherWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=inner.device, layout=inner.layout,
            requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor, quantizer: Quantizer) -> None:
        self._inner = inner
        self._quantizer = quantizer

    def __repr__(self) -> str:
        return f"LowPrecisionGatherWeight({self._inner!r}, {type(self._quantizer).__name__})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_inner"], self._quantizer

    @staticmethod
    def __tensor_unflatten__(inner_tensors, quantizer, outer_size, outer_stride):
        return LowPrecisionGatherWeight(inner_tensors["_inner"], quantizer)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        quantizer = next(a._quantizer for a in _flatten(args, kwargs)
                         if isinstance(a, LowPrecisionGatherWeight))
        unwrap = tree_map_only(LowPrecisionGatherWeight, lambda t: t._inner, (args, kwargs))
        out = func(*unwrap[0], **unwrap[1])
        if func not in _KEEP_WRAPPER:
            return out
        return tree_map_only(torch.Tensor, lambda t: LowPrecisionGatherWeight(t, quantizer), out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """Quantize this rank's rows with the amax reduced over the shard group."""
        quantizer = self._quantizer.copy()  # throwaway: the group lives for this call only
        quantizer.amax_reduction_group = mesh.get_group()
        quantizer.set_usage(rowwise=True, columnwise=False)
        quantizer.internal = True
        storage = quantizer.quantize(self._inner)
        return (storage.data.view(torch.uint8),), (storage.scale_inv, storage.quantizer,
                                                   storage.fp8_dtype)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered bytes as a QuantizedTensor weight (FSDP2 frees `data` after use)."""
        (data,) = all_gather_outputs
        scale_inv, quantizer, fp8_dtype = metadata
        shape = (data.numel() // self._inner.shape[1], self._inner.shape[1])
        fp8 = data.view(fp8_dtype).view(shape)
        if out is not None:  # the same unsharded weight object, refilled in place (not
            # through .data: that is a detached alias with a storage object of its own)
            storage = out.quantized_storage
            storage.data, storage.data_transpose, storage.scale_inv = fp8, None, scale_inv
            return None
        storage = Float8Storage(shape=torch.Size(shape), dtype=param_dtype, quantizer=quantizer,
                                data=fp8, data_transpose=None, scale_inv=scale_inv,
                                fp8_dtype=fp8_dtype)
        return QuantizedTensor(storage), (data,)


def _flatten(args, kwargs) -> list:
    from torch.utils._pytree import tree_leaves

    return tree_leaves((args, kwargs))


def enable_low_precision_all_gather(model: nn.Module, recipe) -> nn.Module:
    """Wrap the weights of model's minifloat modules so that FSDP2 gathers them quantized with
    `recipe`'s weight quantizer. Call it before fully_shard; the model trains as before."""
    from ..modules import LayerNormLinear, Linear

    for module in model.modules():
        if not isinstance(module, Linear | LayerNormLinear):
            continue
        weight = module.weight
        if isinstance(weight, QuantizedTensor | LowPrecisionGatherWeight):
            raise TypeError(f"{module.name or type(module).__name__}: the weight is already a "
                            f"{type(weight).__name__}; wrap high-precision weights only")
        forward_quantizers, _ = module.quantizers(recipe)
        quantizer = forward_quantizers[1]  # GEMM 0's weight slot
        if not isinstance(quantizer, Float8CurrentScalingQuantizer):
            raise NotImplementedError(
                f"low-precision all-gather of {type(quantizer).__name__} weights is not "
                "written yet; FP8 current scaling is supported (gather high-precision weights "
                "otherwise: FSDP2 without this call)")
        wrapped = LowPrecisionGatherWeight(weight.detach(), quantizer.copy())
        module.weight = nn.Parameter(wrapped, requires_grad=weight.requires_grad)
    return model
