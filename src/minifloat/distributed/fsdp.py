"""FSDP2 low-precision all-gather (issue 16, mode b): weights gathered as quantized bytes.

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
full weight on one rank, bit for bit. FP8 current-scaling weights are quantized together: the
first gather after the weights changed casts every such shard of the model in one multi-tensor
launch with one all-reduce of the stacked amaxes, and later gathers of unchanged weights
(backward's re-gathers, further micro-batches) reuse those bytes (batched_weight_casts.py).
The shards are quantized from their own values: under a
MixedPrecisionPolicy whose param_dtype is bf16 and fp32 shards, that is the fp32 weight (as
torchao's float8 all-gather does), one rounding fewer than gathering bf16 and quantizing after.

Supported weight formats: per-tensor FP8 with current
scaling, with delayed scaling (the recipe state's scale; each rank records its shard's amax and
`autocast(amax_reduction_group=...)` reduces the history, as for activations; a re-gather for
backward records nothing, backward reads the copies forward kept), 128x128 block FP8 and 2D
NVFP4. Where shard boundaries cut scale tiles, the tiles' maxima are reduced across the ranks
that hold them (cut_tiles.py). MXFP8 gathers its rowwise copy for forward and its columnwise
copy for backward (neither derives the other). Hybrid weights (a format per direction) gather
each direction in its own format, packed into one blob per rank (hybrid_gather.py). Both
gather the two directions at once where FSDP2 keeps the weight gathered from forward to backward
(reshard_after_forward=False, or the root): no re-gather follows (kept_gathered.py). FSDP2 must
shard evenly (padding would be
gathered as data). Wrapped modules keep no weight copy from forward to backward (except under
delayed scaling): backward reads the re-gathered weight, so the weights stay sharded between the
two. The optimizer updates the high-precision shards; the next forward quantizes them again.

Under torch.compile (each block compiled, as FSDP2 users do), the gathered QuantizedTensor
reaches the graph as its buffers and the GEMM ops run on them (modules/quantized_weight_ops.py);
backward derives the columnwise copy from the re-gathered bytes, equal to forward's for FP8
current scaling, block FP8 and NVFP4. Delayed scaling and MXFP8, whose re-gathers bring other
bytes, refuse to compile with a clear error (`_compile_refusal`); MXFP8 weights that FSDP2 keeps
gathered, whose forward gather brings both copies, compile.

Weights built under quantized_model_init take another wrapper (quantized_shards.py): their bytes
are sharded and gathered as they are, and quantize_master_weights updates them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from ..quantizers import (
    Float8BlockQuantizer,
    Float8BlockStorage,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Storage,
    HybridQuantizer,
    HybridStorage,
    MXFP8Quantizer,
    MXFP8Storage,
    NVFP4Quantizer,
    NVFP4Storage,
    QuantizedTensor,
    Quantizer,
)
from .cut_tiles import (
    cut_mxfp8_columnwise_gather_inputs,
    cut_tile_gather_inputs,
    tile_rows_of,
)
from .kept_gathered import gathers_both_directions, remember_root
from .presigned import presigned
from .quantized_shards import QuantizedShardWeight

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
    def __new__(cls, inner: torch.Tensor, quantizer: Quantizer, batch: tuple | None = None
                ) -> LowPrecisionGatherWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=inner.device, layout=inner.layout,
            requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor, quantizer: Quantizer, batch: tuple | None = None
                 ) -> None:
        self._inner = inner
        self._quantizer = quantizer
        # (WeightCastBatch, this weight's index in it): the model's current-scaling shards
        # quantized together (batched_weight_casts.py); None: quantized alone at each gather
        self._batch = batch

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
        if func not in _KEEP_WRAPPER:  # the optimizer's foreach ops over every shard, mostly
            return func(*_unwrapped(args),
                        **dict(zip(kwargs, _unwrapped(kwargs.values()), strict=True)))
        first = next(a for a in tree_leaves((args, kwargs))
                     if isinstance(a, LowPrecisionGatherWeight))
        unwrap = tree_map_only(LowPrecisionGatherWeight, lambda t: t._inner, (args, kwargs))
        out = func(*unwrap[0], **unwrap[1])
        return tree_map_only(
            torch.Tensor, lambda t: LowPrecisionGatherWeight(t, first._quantizer, first._batch),
            out)

    @presigned
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """Quantize this rank's rows (rowwise copy only); the all-gather inputs are the bytes
        and, for block formats, the rows of the scale grid. MXFP8 and hybrid weights that FSDP2
        keeps gathered after forward gather both directions' copies at once (kept_gathered.py):
        no backward re-gather would bring the columnwise one."""
        return directed_gather_inputs(
            lambda backward: self._rank_gather_inputs(mesh, outer_size, backward),
            isinstance(self._quantizer, MXFP8Quantizer | HybridQuantizer), module, mesh)

    def _rank_gather_inputs(self, mesh, outer_size, backward: bool
                            ) -> tuple[tuple[torch.Tensor, ...], tuple]:
        if isinstance(self._quantizer, HybridQuantizer):
            from .hybrid_gather import hybrid_gather_inputs

            return hybrid_gather_inputs(self._inner, self._quantizer, mesh, outer_size, backward)
        if self._batch is not None:
            _require_even_shards(outer_size, mesh)
            batch, index = self._batch
            made = batch.gather_inputs(index, mesh)
            if made is not None:
                return made
        return format_gather_inputs(self._inner, self._quantizer, mesh, outer_size, backward)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered rows as a QuantizedTensor weight (FSDP2 frees the outputs after use)."""
        return refill_or_wrap(all_gather_outputs, metadata, self._inner.shape[1], param_dtype,
                              out)


def _unwrapped(values) -> list:
    """Each value with LowPrecisionGatherWeight unwrapped, in it or one list level down.

    Why: a foreach AdamW step hands every shard of the model to one op, several ops a step;
    pytree's tree_map over those lists cost ~2.5 ms of host time per op (cProfile, gloo CPU run
    of 20 blocks), this a few microseconds per tensor. Deeper nesting takes tree_map."""
    result = []
    for value in values:
        kind = type(value)
        if kind is LowPrecisionGatherWeight:
            value = value._inner
        elif kind is list or kind is tuple:
            value = kind(item._inner if type(item) is LowPrecisionGatherWeight else item
                         for item in value)
            if any(isinstance(item, list | tuple | dict) for item in value):
                value = tree_map_only(LowPrecisionGatherWeight, lambda t: t._inner, value)
        elif kind is dict:
            value = tree_map_only(LowPrecisionGatherWeight, lambda t: t._inner, value)
        result.append(value)
    return result


def refill_or_wrap(all_gather_outputs, metadata, columns: int, param_dtype: torch.dtype, out):
    """fsdp_post_all_gather's answer: the gathered storage as a new QuantizedTensor weight, or
    refilled into `out`, the unsharded weight of an earlier gather (in place, not through .data:
    that is a detached alias with a storage object of its own)."""
    outputs, metadata = unpacked(all_gather_outputs, metadata)
    _read_on_this_stream(metadata)
    storage = _gathered_any(outputs, metadata, columns, param_dtype)
    if out is not None:
        target = out.quantized_storage
        names = (("rowwise_storage", "columnwise_storage") if isinstance(target, HybridStorage)
                 else target.tensor_fields())
        for name in (*names, "quantizer"):
            setattr(target, name, getattr(storage, name))
        return None
    return QuantizedTensor(storage), tuple(all_gather_outputs)


def directed_gather_inputs(rank_gather_inputs: Callable[[bool], tuple],
                           one_direction_per_gather: bool, module: nn.Module, mesh
                           ) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """A rank's all-gather inputs for this gather's direction (`rank_gather_inputs(backward)`),
    or, for a weight that gathers one direction a gather (MXFP8, hybrids) and that FSDP2 keeps
    gathered after forward, forward's followed by the backward re-gather's (metadata "both");
    such a module's MXFP8 compile refusal is lifted then (_allow_compile_of_both_copies)."""
    both = one_direction_per_gather and gathers_both_directions(module)
    _allow_compile_of_both_copies(module, both)
    if not both:
        return packed_for_one_rank(*rank_gather_inputs(in_backward()), mesh)
    forward, backward = rank_gather_inputs(False), rank_gather_inputs(True)
    return packed_for_one_rank(forward[0] + backward[0],
                               ("both", len(forward[0]), forward[1], backward[1]), mesh)


def packed_for_one_rank(inputs: tuple[torch.Tensor, ...], metadata: tuple, mesh
                        ) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """The all-gather inputs as one flat byte tensor when the shard group has one rank.

    Why: with world size 1, FSDP2 (torch 2.11 to 2.13, FSDPParamGroup.unshard) skips the
    all-gather and copies only the first all-gather input into the unsharded buffer, so the
    scales of a block format never reached fsdp_post_all_gather (found on one GPU under NCCL).
    Each input is laid out at a 16-byte aligned offset, so unpacked() views it back without a
    copy; nothing is communicated at world size 1, so the one concatenation is the whole cost.
    """
    if mesh.size() != 1 or len(inputs) == 1:
        return inputs, metadata
    flat, layout = aligned_bytes(inputs)
    return (flat,), ("packed", tuple(layout), metadata)


def aligned_bytes(tensors) -> tuple[torch.Tensor, list[tuple]]:
    """The tensors' bytes in one uint8 tensor, each at a 16-byte aligned offset, and each
    one's (offset, bytes, dtype, shape), with which unpacked()-style views read it back."""
    parts, layout, offset = [], [], 0
    for tensor in tensors:
        flat = tensor.contiguous().view(-1).view(torch.uint8)
        padding = -flat.numel() % 16
        parts += [flat, flat.new_zeros(padding)] if padding else [flat]
        layout.append((offset, flat.numel(), tensor.dtype, tuple(tensor.shape)))
        offset += flat.numel() + padding
    return torch.cat(parts), layout


def _read_on_this_stream(metadata: tuple) -> None:
    """Mark the metadata's tensors as used on the current stream (record_stream).

    Why: fsdp_pre_all_gather runs on FSDP2's all-gather copy-in stream, so the caching allocator
    files what it allocates there (a shared scale, NVFP4's global amax, a scale grid) under that
    stream. This stream reads them after the gather, and FSDP2 drops the metadata right after
    this call: without the mark, a tensor whose last reference goes while this stream's kernels
    still read it (a derived copy's amax clone) goes back to the copy-in stream's pool at once,
    and the next unit's pre_all_gather, which runs ahead of this stream, writes over it. Found
    on 2 GPUs: hybrid MXFP8/NVFP4 weights kept gathered read the next unit's amax."""
    for item in metadata:
        if isinstance(item, torch.Tensor):
            if item.is_cuda:
                item.record_stream(torch.cuda.current_stream(item.device))
        elif isinstance(item, tuple):
            _read_on_this_stream(item)


def _gathered_any(outputs: tuple[torch.Tensor, ...], metadata: tuple, columns: int,
                  param_dtype: torch.dtype):
    """The gathered storage, of one direction or (metadata "both") of the two."""
    if metadata[0] == "both":  # forward's inputs, then the backward re-gather's
        _, count, forward_metadata, backward_metadata = metadata
        storage = _gathered_any(outputs[:count], forward_metadata, columns, param_dtype)
        columnwise = _gathered_any(outputs[count:], backward_metadata, columns, param_dtype)
        if isinstance(storage, HybridStorage):
            storage.columnwise_storage = columnwise.columnwise_storage
        else:  # MXFP8
            storage.columnwise_data = columnwise.columnwise_data
            storage.columnwise_scale = columnwise.columnwise_scale
        return storage
    if metadata[0] == "hybrid":
        from .hybrid_gather import hybrid_gathered_storage

        return hybrid_gathered_storage(outputs, metadata, columns, param_dtype)
    return _gathered_storage(outputs, metadata, columns, param_dtype)


def unpacked(outputs: tuple[torch.Tensor, ...], metadata: tuple
             ) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """packed_for_one_rank undone on the gathered buffer: views, no copies."""
    if metadata[0] != "packed":
        return outputs, metadata
    _, layout, inner = metadata
    flat = outputs[0].view(-1)
    return tuple(flat[offset:offset + size].view(dtype).view(shape)
                 for offset, size, dtype, shape in layout), inner


def format_gather_inputs(shard: torch.Tensor, weight_quantizer: Quantizer, mesh, outer_size,
                         backward: bool) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """(all-gather inputs, metadata) of this rank's rows quantized with one weight format."""
    quantizer = weight_quantizer.copy()  # throwaway: the group lives for this call only
    if mesh.size() > 1:  # one rank: its amax is the maximum (no collective launched for it)
        quantizer.amax_reduction_group = mesh.get_group()
    quantizer.set_usage(rowwise=True, columnwise=False)
    quantizer.internal = True
    rows = shard.shape[0]
    _require_even_shards(outer_size, mesh)
    tile = tile_rows_of(quantizer)
    if tile and rows % tile:  # scale tiles cut by shard boundaries: reduce their maxima
        return cut_tile_gather_inputs(shard, quantizer, mesh.get_local_rank() * rows,
                                      outer_size[0], mesh.get_group())
    if isinstance(quantizer, MXFP8Quantizer):
        return _mxfp8_gather_inputs(shard, quantizer, rows, mesh, outer_size[0], backward)
    if isinstance(quantizer, Float8Quantizer) and backward:
        # delayed scaling, re-gathered for backward: backward reads the copies forward kept,
        # so this gather must not record the weight's amax into the next round's slot
        quantizer.amax = torch.zeros_like(quantizer.amax)
    storage = quantizer.quantize(shard)
    return _gather_inputs(storage)


def _require_even_shards(outer_size, mesh) -> None:
    if outer_size[0] % mesh.size():
        raise ValueError(
            f"low-precision all-gather needs FSDP2 to shard a weight evenly: "
            f"{outer_size[0]} rows over {mesh.size()} ranks leaves padding, which FSDP2 would "
            "gather as data; use a row count divisible by the shard count, or gather "
            "high-precision weights (FSDP2 without enable_low_precision_all_gather)")


def in_backward() -> bool:
    """Whether this gather runs inside backward (FSDP2's re-gather before a module's backward)."""
    return torch._C._current_graph_task_id() != -1


def _mxfp8_gather_inputs(shard: torch.Tensor, quantizer: MXFP8Quantizer, rows: int, mesh,
                         total_rows: int, backward: bool
                         ) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """MXFP8 keeps two copies with scales of their own (32-element blocks along K for the
    rowwise one, along M for the columnwise one); neither derives the other. Forward gathers
    the rowwise copy only, the backward re-gather the columnwise copy only, so each gather
    moves one byte per element plus a scale per 32 (the modules keep no weight copy from
    forward: rebuild_weight_copy_in_backward)."""
    if backward and rows % 32:  # columnwise blocks cut by the shard boundary
        return cut_mxfp8_columnwise_gather_inputs(shard, quantizer, mesh.get_local_rank() * rows,
                                                  total_rows, mesh.get_group())
    quantizer.set_usage(rowwise=not backward, columnwise=backward)
    padded = shard
    if rows % 32:  # rowwise blocks run along K: zero rows added to fit the format change none
        padded = torch.cat([shard, shard.new_zeros(32 - rows % 32, shard.shape[1])])
    storage = quantizer.quantize(padded)
    prefix = "columnwise" if backward else "rowwise"
    data = getattr(storage, f"{prefix}_data")[:rows]
    scale = getattr(storage, f"{prefix}_scale")[:rows if prefix == "rowwise" else None]
    return (_bytes(data), _bytes(scale)), ("mxfp8", storage.quantizer,
                                           (data.dtype, scale.dtype), prefix)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def _gather_inputs(storage) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """(all-gather inputs, metadata) of a rank's rowwise storage: per-row tensors are gathered,
    what every rank holds alike (per-tensor scales and amaxes) travels as metadata."""
    if isinstance(storage, Float8Storage):
        return (_bytes(storage.data),), ("fp8", storage.quantizer, storage.fp8_dtype,
                                         storage.scale_inv)
    if isinstance(storage, Float8BlockStorage):
        return ((_bytes(storage.rowwise_data), storage.rowwise_scale_inv),
                ("block", storage.quantizer, storage.rowwise_data.dtype, None))
    return ((storage.rowwise_data, _bytes(storage.rowwise_scale)),
            ("nvfp4", storage.quantizer, storage.rowwise_scale.dtype, storage.amax_rowwise))


def _gathered_storage(outputs, metadata, columns: int, param_dtype: torch.dtype):
    kind, quantizer, dtype, shared = metadata
    if kind == "fp8":
        (data,) = outputs
        data = data.view(dtype).view(-1, columns)
        return Float8Storage(shape=data.shape, dtype=param_dtype, quantizer=quantizer,
                             data=data, data_transpose=None, scale_inv=shared, fp8_dtype=dtype)
    if kind == "mxfp8_grid":  # cut columnwise blocks: the full scale grid came as metadata
        data = outputs[0]
        data_dtype, _ = dtype
        data = data.view(data_dtype).view(-1, columns)
        return MXFP8Storage(shape=data.shape, dtype=param_dtype, quantizer=quantizer,
                            fp8_dtype=data_dtype, rowwise_data=None, rowwise_scale=None,
                            columnwise_data=data, columnwise_scale=shared)
    if kind == "mxfp8":  # one direction per gather; `shared` names it
        data, scale = outputs
        data_dtype, scale_dtype = dtype
        data = data.view(data_dtype).view(-1, columns)
        scale = scale.view(scale_dtype).view(-1, columns if shared == "columnwise"
                                             else columns // 32)
        fields = {f"{direction}_{name}": None for direction in ("rowwise", "columnwise")
                  for name in ("data", "scale")}
        fields[f"{shared}_data"], fields[f"{shared}_scale"] = data, scale
        return MXFP8Storage(shape=data.shape, dtype=param_dtype, quantizer=quantizer,
                            fp8_dtype=data_dtype, **fields)
    if kind == "block_grid":  # cut tiles: the full scale grid came as metadata
        (data,) = outputs
        data = data.view(dtype).view(-1, columns)
        return Float8BlockStorage(shape=data.shape, dtype=param_dtype, quantizer=quantizer,
                                  rowwise_data=data, rowwise_scale_inv=shared,
                                  columnwise_data=None, columnwise_scale_inv=None,
                                  block_scaling_dim=2)
    if kind == "block":
        data, scale_inv = outputs
        data = data.view(dtype).view(-1, columns)
        return Float8BlockStorage(shape=data.shape, dtype=param_dtype, quantizer=quantizer,
                                  rowwise_data=data, rowwise_scale_inv=scale_inv,
                                  columnwise_data=None, columnwise_scale_inv=None,
                                  block_scaling_dim=2)
    data, scale = outputs
    data = data.view(-1, columns // 2)
    return NVFP4Storage(shape=torch.Size((data.shape[0], columns)), dtype=param_dtype,
                        quantizer=quantizer, rowwise_data=data,
                        rowwise_scale=scale.view(dtype).view(data.shape[0], -1),
                        amax_rowwise=shared, columnwise_data=None, columnwise_scale=None,
                        amax_columnwise=None, two_dimensional=True, with_rht=False)


def _supported(quantizer: Quantizer) -> bool:
    if isinstance(quantizer, HybridQuantizer):  # each direction in a format gathered alone
        return (_supported(quantizer.rowwise_quantizer)
                and _supported(quantizer.columnwise_quantizer))
    if isinstance(quantizer, Float8CurrentScalingQuantizer | Float8Quantizer | MXFP8Quantizer):
        return True
    if isinstance(quantizer, Float8BlockQuantizer):
        return quantizer.block_scaling_dim == 2
    return (isinstance(quantizer, NVFP4Quantizer) and quantizer.with_2d_quantization
            and not quantizer.stochastic_rounding)


def _compile_refusal(quantizer: Quantizer) -> str | None:
    """Why a compiled graph cannot run weights gathered with this quantizer, or None.

    A compiled backward reads the weight buffers forward saw (FSDP2 refills them in place for
    backward): right where the re-gather brings the same bytes, wrong where it does not."""
    if isinstance(quantizer, Float8Quantizer):
        return ("FSDP2's FP8 all-gather of delayed-scaling weights does not run under "
                "torch.compile (backward's re-gather casts with the next step's scale, and a "
                "compiled backward would pair those bytes with forward's); use current "
                "scaling, gather high-precision weights, or run eagerly")
    if isinstance(quantizer, MXFP8Quantizer):
        return _MXFP8_REFUSAL
    if isinstance(quantizer, HybridQuantizer):
        from ..modules.base import HYBRID_COMPILE_REFUSAL

        return HYBRID_COMPILE_REFUSAL
    return None


_MXFP8_REFUSAL = (
    "FSDP2's MXFP8 all-gather brings the columnwise copy only in backward's re-gather, which a "
    "compiled backward does not see; gather MXFP8 weights in high precision under "
    "torch.compile (the weights are then quantized inside the graph), keep them gathered "
    "from forward to backward (fully_shard(reshard_after_forward=False): forward's gather then "
    "brings both copies), or run eagerly")


def _allow_compile_of_both_copies(module: nn.Module, both: bool) -> None:
    """Lift the MXFP8 compile refusal of a module whose weights gather both copies in forward:
    with no re-gather, the compiled backward reads the columnwise copy forward's gather brought
    (FSDP2's hooks gather before the compiled forward runs, so the first trace sees this)."""
    if both and module.compile_refusal is _MXFP8_REFUSAL:
        module.compile_refusal = None


def gemm_weights(module: nn.Module) -> list[tuple[str, int]]:
    """(parameter name, GEMM index) of each weight of a minifloat module."""
    from ..modules import GroupedLinear, LayerNormLinear, LayerNormMLP, Linear

    if isinstance(module, Linear | LayerNormLinear):
        return [("weight", 0)]
    if isinstance(module, LayerNormMLP):
        return [("fc1_weight", 0), ("fc2_weight", 1)]
    if isinstance(module, GroupedLinear):
        return [(f"weight{gemm}", gemm) for gemm in range(module.num_gemms)]
    return []


def enable_low_precision_all_gather(model: nn.Module, recipe) -> nn.Module:
    """Wrap the weights of model's minifloat modules (Linear, LayerNormLinear, LayerNormMLP,
    GroupedLinear) so that FSDP2 gathers them quantized with `recipe`'s weight quantizers. Call
    it before fully_shard; the model trains as before. Weights built under quantized_model_init
    (per-tensor FP8, 2D NVFP4) are sharded and gathered as the bytes they are
    (quantized_shards.py); update them through quantize_master_weights."""
    from ..modules.base import FORWARD_SLOTS
    from .batched_weight_casts import WeightCastBatch, batchable
    from .shard_state_dict import install_state_dict_hooks

    batch = WeightCastBatch()
    for module in model.modules():
        if gemm_weights(module):  # DCP then saves savable values (shard_state_dict.py)
            install_state_dict_hooks(module)
            remember_root(module, model)  # where its FSDP2 group is found (kept_gathered.py)
        for name, gemm in gemm_weights(module):
            weight = getattr(module, name)
            if isinstance(weight, QuantizedTensor):  # quantized_model_init: bytes as they are
                wrapped = QuantizedShardWeight.of(weight)
                setattr(module, name, nn.Parameter(wrapped, requires_grad=weight.requires_grad))
                module.rebuild_weight_copy_in_backward = True
                # bytes gathered as they are: only a direction per gather refuses to compile
                module.compile_refusal = module.compile_refusal or (
                    _MXFP8_REFUSAL if isinstance(weight.quantized_storage, MXFP8Storage)
                    else None)
                continue
            if isinstance(weight, LowPrecisionGatherWeight | QuantizedShardWeight):
                raise TypeError(f"{module.name or type(module).__name__}.{name} is already a "
                                f"{type(weight).__name__}; wrap each weight once")
            forward_quantizers, _ = module.quantizers(recipe)
            quantizer = forward_quantizers[len(FORWARD_SLOTS) * gemm + 1]  # the weight slot
            if not _supported(quantizer):
                raise NotImplementedError(
                    f"low-precision all-gather of {type(quantizer).__name__} weights is not "
                    "written; per-tensor FP8 (current, delayed), 128x128 block FP8, MXFP8 and "
                    "2D NVFP4 without stochastic rounding are supported, and hybrids of them "
                    "(gather high-precision weights otherwise: FSDP2 without this call)")
            if isinstance(quantizer, HybridQuantizer) and any(
                    isinstance(child, Float8Quantizer)
                    for child in (quantizer.rowwise_quantizer, quantizer.columnwise_quantizer)):
                raise NotImplementedError(
                    "low-precision all-gather of a hybrid weight with a delayed-scaling "
                    "direction is not written: forward gathers only the rowwise copy, and "
                    "delayed scaling needs backward's copy from forward's scale; use current "
                    "scaling in the hybrid, or gather high-precision weights")
            member = ((batch, batch.add(module, name, quantizer)) if batchable(quantizer)
                      else None)
            wrapped = LowPrecisionGatherWeight(weight.detach(), quantizer.copy(), member)
            setattr(module, name, nn.Parameter(wrapped, requires_grad=weight.requires_grad))
            # backward reads the re-gathered weight instead of a full-size copy kept from
            # forward; delayed scaling keeps its copy (a re-gather would use the scale of the
            # next step, updated when forward's autocast exits)
            module.rebuild_weight_copy_in_backward = not isinstance(quantizer, Float8Quantizer)
            module.compile_refusal = module.compile_refusal or _compile_refusal(quantizer)
    return model
