"""Quantized weights in the compiled GEMM ops: the weight's buffers travel, not the weight.

Weights built under quantized_model_init, and those FSDP2's low-precision all-gather brings, are
QuantizedTensor parameters. Under torch.compile, dynamo and AOTAutograd take them as their
buffers (QuantizedTensor.__tensor_flatten__), and the GEMM ops minifloat::gemms_forward /
gemms_backward meet them through QuantizedTensor's dispatch. The handlers here pass each weight
on as its present buffers and a layout id to the ops' twins, minifloat::gemms_forward_qw /
gemms_backward_qw, which put the storages back together and run the very forward and backward of
the eager path, so compiled results equal eager ones bit for bit.

A layout id stands for the storage class, shape, dtype, format metadata and which buffers are
present: a hash of a process-independent description, as plan ids are (gemm_op.py). The
quantizer is not part of it: the GEMMs read bytes and scales only, so the rebuilt storage has
none.

Forward keeps no copy of a quantized weight: autograd keeps the weight (its buffers), and
backward derives the columnwise copy from it (rebuild_weight_copy), as the eager path does for
FSDP2's re-gathered weights. So a compiled weight's format must derive that copy, or hold it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..quantizers import QuantizedStorage, QuantizedTensor
from ..quantizers.tensor import register_handler
from . import gemm_op
from .op_define import define_op


@dataclass(frozen=True)
class WeightLayout:
    """What rebuilds a quantized weight's storage from its present buffers."""

    storage_class: type[QuantizedStorage]
    shape: tuple[int, ...]
    dtype: torch.dtype
    metadata: tuple
    present: tuple[str, ...]


_LAYOUTS: dict[int, WeightLayout] = {}
_IDS: dict[WeightLayout, int] = {}  # the reverse, so a call hashes no description


def layout_id(storage: QuantizedStorage) -> int:
    """The id of this storage's layout (registered on first sight)."""
    layout = WeightLayout(
        type(storage), tuple(int(size) for size in storage.shape), storage.dtype,
        storage.metadata_values(), storage.present_fields())
    ident = _IDS.get(layout)
    if ident is None:
        description = repr((layout.storage_class.__qualname__, layout.shape, str(layout.dtype),
                            tuple(repr(value) for value in layout.metadata), layout.present))
        ident = int.from_bytes(hashlib.sha1(description.encode()).digest()[:7], "little") or 1
        _LAYOUTS.setdefault(ident, layout)
        _IDS[layout] = ident
    return ident


def check_compilable(weight: QuantizedTensor, need_dgrad: bool) -> None:
    """A clear error for a quantized weight the compiled ops cannot run."""
    storage = weight.quantized_storage
    if not storage.has_rowwise():
        raise NotImplementedError(
            f"a {storage.format_name} weight without its rowwise copy reached a compiled "
            "forward; FSDP2's low-precision all-gather of MXFP8 weights brings the columnwise "
            "copy in backward's re-gather, which a compiled graph does not see: gather MXFP8 "
            "weights in high precision under torch.compile, or run eagerly")
    if need_dgrad and not (storage.has_columnwise() or storage.derives_columnwise()):
        raise NotImplementedError(
            f"this {storage.format_name} weight cannot make its columnwise copy from its "
            "rowwise one, which compiled backward needs (the forward keeps no weight copy); "
            "quantize the weight with both usages, gather it in high precision, or run eagerly")


def weight_buffers(weights: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """The quantized weights as their present buffers, and each one's layout id (compiled_gemms
    lets a module's weights be all quantized or none)."""
    buffers: list[torch.Tensor] = []
    layouts: list[int] = []
    for weight in weights:
        storage = weight.quantized_storage
        layouts.append(layout_id(storage))
        buffers.extend(gemm_op.present_buffers(weight))
    return buffers, layouts


def rebuilt_weights(buffers: list[torch.Tensor], layouts: list[int]) -> list[torch.Tensor]:
    """weight_buffers undone: QuantizedTensors over the same buffers (no copies)."""
    remaining = iter(buffers)
    weights: list[torch.Tensor] = []
    for ident in layouts:
        layout = _LAYOUTS.get(ident)
        if layout is None:
            raise RuntimeError(
                f"minifloat: quantized-weight layout {ident} is unknown to this process (a "
                "compiled graph loaded from another process's cache?); clear torch.compile's "
                "caches, or set TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, and compile again")
        buffers = {name: next(remaining) for name in layout.present}
        weights.append(QuantizedTensor(layout.storage_class.from_buffers(
            layout.shape, layout.dtype, layout.metadata, buffers)))
    return weights


def _forward_qw(
    x: torch.Tensor, weight_buffers: list[torch.Tensor], weight_layouts: list[int],
    biases: list[torch.Tensor], has_bias: list[bool], state: list[torch.Tensor], plan: int,
    gemms: list[int], m_splits: list[int], need_dgrad: bool, need_wgrad: bool, rebuild: bool,
    save_original: bool, input_amax: list[torch.Tensor], reduction: str,
) -> list[torch.Tensor]:
    """gemms_forward with the weights given as buffers (weight_buffers)."""
    weights = rebuilt_weights(weight_buffers, weight_layouts)
    return gemm_op.gemms_forward_impl(x, weights, biases, has_bias, state, plan, gemms,
                                      m_splits, need_dgrad, need_wgrad, rebuild, save_original,
                                      input_amax, reduction)


# on fake buffers: the reference path, as gemm_op's ops
_forward_qw_op = define_op("gemms_forward_qw", _forward_qw)


def _backward_qw(
    grad_output: torch.Tensor, saved: list[torch.Tensor], state: list[torch.Tensor], plan: int,
    gemms: list[int], m_splits: list[int], x_shape: list[int], weight_shapes: list[int],
    has_bias: list[bool], need_dgrad: bool, need_wgrad: bool,
    rebuild_buffers: list[torch.Tensor], rebuild_layouts: list[int],
    rebuild_scales: list[torch.Tensor], grad_output_amax: list[torch.Tensor], reduction: str,
) -> list[torch.Tensor]:
    """gemms_backward with the weights it derives copies from given as buffers."""
    weights = rebuilt_weights(rebuild_buffers, rebuild_layouts)
    return gemm_op.gemms_backward_impl(grad_output, saved, state, plan, gemms, m_splits,
                                       x_shape, weight_shapes, has_bias, need_dgrad, need_wgrad,
                                       weights, rebuild_scales, grad_output_amax, reduction)


def _backward_qw_fake(grad_output, saved, state, plan, gemms, m_splits, x_shape, weight_shapes,
                      has_bias, need_dgrad, need_wgrad, rebuild_buffers, rebuild_layouts,
                      rebuild_scales, grad_output_amax, reduction):
    return gemm_op.gemms_backward_fake(grad_output, saved, state, plan, gemms, m_splits,
                                       x_shape, weight_shapes, has_bias, need_dgrad, need_wgrad,
                                       [], rebuild_scales, grad_output_amax, reduction)


_backward_qw_op = define_op("gemms_backward_qw", _backward_qw, _backward_qw_fake)


def _forward_handler(x, weights, biases, has_bias, state, plan, gemms, m_splits, need_dgrad,
                     need_wgrad, rebuild, save_original, input_amax, reduction):
    for weight in weights:
        check_compilable(weight, need_dgrad)
    buffers, layouts = weight_buffers(list(weights))
    return _forward_qw_op(x, buffers, layouts, biases, has_bias, state, plan, gemms, m_splits,
                          need_dgrad, need_wgrad, rebuild, save_original, input_amax,
                          reduction)


def _backward_handler(grad_output, saved, state, plan, gemms, m_splits, x_shape, weight_shapes,
                      has_bias, need_dgrad, need_wgrad, rebuild_from, rebuild_scales,
                      grad_output_amax, reduction):
    buffers, layouts = weight_buffers(list(rebuild_from))
    return _backward_qw_op(grad_output, saved, state, plan, gemms, m_splits, x_shape,
                           weight_shapes, has_bias, need_dgrad, need_wgrad, buffers, layouts,
                           rebuild_scales, grad_output_amax, reduction)


register_handler(torch.ops.minifloat.gemms_forward.default, _forward_handler)
register_handler(torch.ops.minifloat.gemms_backward.default, _backward_handler)
