"""The autograd function behind Linear and GroupedLinear: G GEMM triples over row splits.

For split i of the input (its rows m_splits[i]) and weight i:

    fprop   y_i  = x_i W_i^T (+ b_i)     x_i rowwise, W_i rowwise
    dgrad   dx_i = dy_i W_i              dy_i rowwise, W_i columnwise
    wgrad   dW_i = dy_i^T x_i            dy_i columnwise, x_i columnwise

Forward quantizes every split in one split_quantize call, rowwise plus columnwise when the
weights need gradients, and saves only the columnwise copies, through save_for_backward (so
saved-tensor hooks such as CPU offload and activation recompute see them). With
save_original_input (TransformerEngine's name) forward makes only the rowwise copy and saves the
high-precision input itself; backward makes the columnwise copy from it (rebuild_input_copies).
Backward quantizes dy in the directions its GEMMs need. Linear is the case of one split. Which
copies are made is decided in the module's forward from torch.is_grad_enabled(), not from
ctx.needs_input_grad (which ignores torch.no_grad): under no_grad no columnwise copy is made
and nothing is saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..gemm import general_gemm
from ..quantizers import (
    Float8Quantizer,
    HybridQuantizer,
    QuantizedStorage,
    QuantizedTensor,
    Quantizer,
    as_storage,
)
from ..quantizers.split import check_splits, split_quantize
from .weights import quantized_weight

FORWARD_SLOTS = ("input", "weight", "output")  # quantizer slots per GEMM
BACKWARD_SLOTS = ("grad_output", "grad_input")


@dataclass
class GemmCall:
    """Everything one forward of a (grouped) linear needs besides the tensors."""

    m_splits: list[int]
    weight_cache: dict | None  # None: quantize the weights afresh (weights.quantized_weight)
    reuse_weights: bool
    input_quantizers: list[Quantizer]
    weight_quantizers: list[Quantizer]
    grad_output_quantizers: list[Quantizer]
    need_dgrad: bool
    need_wgrad: bool
    # keep no weight copy for dgrad: backward quantizes the weight again (or reads the copy an
    # FSDP2 re-gather brought); see rebuild_weight_copy
    rebuild_weights: bool = False
    # keep the high-precision input for wgrad instead of its columnwise copy: backward
    # quantizes it again (rebuild_input_copies); see QuantizedModule.save_original_input
    save_original_input: bool = False
    # sequence parallelism: the TP group to all-gather the input's rows over as FP8 bytes
    # (distributed/sequence_gather.py); backward reduce-scatters the input gradient
    input_gather_group: Any = None
    # sequence parallelism, row-parallel: reduce-scatter the output's rows over this group;
    # backward gathers the output gradient's rows (as FP8 bytes where the format allows)
    output_scatter_group: Any = None

    @classmethod
    def from_slots(
        cls, forward_quantizers: list[Quantizer], backward_quantizers: list[Quantizer],
        gemms: list[int], m_splits: list[int], *, need_dgrad: bool, need_wgrad: bool,
        weight_cache: dict | None = None, reuse_weights: bool = False,
        rebuild_weights: bool = False, save_original_input: bool = False,
        input_gather_group: Any = None, output_scatter_group: Any = None,
    ) -> GemmCall:
        """The call of GEMMs `gemms`, picking each one's quantizers from a module's slot lists
        (forward: input, weight, output per GEMM; backward: grad_output, grad_input)."""
        per_forward, per_backward = len(FORWARD_SLOTS), len(BACKWARD_SLOTS)
        input_quantizers = [forward_quantizers[per_forward * g] for g in gemms]
        return cls(
            m_splits=list(m_splits),
            weight_cache=weight_cache,
            reuse_weights=reuse_weights,
            input_quantizers=input_quantizers,
            weight_quantizers=[forward_quantizers[per_forward * g + 1] for g in gemms],
            grad_output_quantizers=[backward_quantizers[per_backward * g] for g in gemms],
            need_dgrad=need_dgrad,
            need_wgrad=need_wgrad,
            rebuild_weights=rebuild_weights and need_dgrad and all(
                can_rebuild(forward_quantizers[per_forward * g + 1]) for g in gemms),
            # a sequence-parallel input is gathered as quantized bytes: those are kept
            save_original_input=save_original_input and need_wgrad
            and input_gather_group is None and all(can_rebuild(q) for q in input_quantizers),
            input_gather_group=input_gather_group,
            output_scatter_group=output_scatter_group,
        )


def quantize_for_gemms(
    x2d: torch.Tensor, m_splits: list[int], quantizers: list[Quantizer], *, rowwise: bool,
    columnwise: bool,
) -> list[QuantizedStorage | None]:
    """Configure each split's quantizer for the copies asked for, then quantize all splits."""
    for quantizer in quantizers:
        quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
        quantizer.internal = True
    return split_quantize(x2d, m_splits, quantizers)


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def fprop_gemms(
    x_qs: list[QuantizedStorage | None],
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    weight_quantizers: list[Quantizer],
    weight_cache: dict | None,
    *,
    need_dgrad: bool,
    out_dtype: torch.dtype,
    reuse_weights: bool = False,
) -> tuple[torch.Tensor, list[QuantizedStorage | None]]:
    """y = cat_i(x_i W_i^T + b_i) ([rows, N]) and the quantized weights dgrad will need (None
    where it will not run); an empty split contributes no rows."""
    outputs, w_qs = [], []
    for x_q, weight, bias, quantizer in zip(x_qs, weights, biases, weight_quantizers,
                                            strict=True):
        w_q = quantized_weight(weight_cache, weight, quantizer, columnwise=need_dgrad,
                               reuse=reuse_weights)
        w_qs.append(w_q if need_dgrad else None)
        if x_q is None:
            outputs.append(torch.zeros(0, weight.shape[0], dtype=out_dtype,
                                       device=weight.device))
        else:
            outputs.append(general_gemm(x_q, w_q, out_dtype=out_dtype, bias=bias))
    return _cat(outputs), w_qs


def dgrad_wgrad_gemms(
    splits: list[int],
    dy_qs: list[QuantizedStorage | None],
    w_qs: list[QuantizedStorage | None],
    x_qs: list[QuantizedStorage | None],
    weights: list[WeightInfo],
    *,
    need_dgrad: bool,
    need_wgrad: bool,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """dx ([rows, K], None without dgrad) and each split's dW (weight_gradient); x_qs hold
    their buffers again (restore_from_saved)."""
    grad_x = None
    if need_dgrad:
        in_features = weights[0].shape[-1]
        pieces = []
        for rows, dy_q, w_q, weight in zip(splits, dy_qs, w_qs, weights, strict=True):
            if rows == 0:
                pieces.append(torch.zeros(0, in_features, dtype=out_dtype,
                                          device=weight.device))
            else:
                pieces.append(general_gemm(dy_q, w_q, b_columnwise=True, out_dtype=out_dtype))
        grad_x = _cat(pieces)
    grad_weights: list[torch.Tensor | None] = [None] * len(splits)
    if need_wgrad:
        for i, (x_q, dy_q, weight) in enumerate(zip(x_qs, dy_qs, weights, strict=True)):
            grad_weights[i] = weight_gradient(x_q, dy_q, weight)
    return grad_x, grad_weights


@dataclass
class WeightInfo:
    """What backward needs of a weight besides its quantized copy: shape, dtype and device of
    its gradient, and the fp32 `main_grad` a distributed optimizer may have set on it."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    main_grad: torch.Tensor | None = None

    @staticmethod
    def of(weight: torch.Tensor) -> WeightInfo:
        return WeightInfo(weight.shape, weight.dtype, weight.device,
                          getattr(weight, "main_grad", None))


@dataclass
class SavedForBackward:
    """What forward keeps for backward: the buffers (saved through save_for_backward, or
    returned by the compiled op) and the metadata-only storages they go back into."""

    tensors: list[torch.Tensor | None]
    x_storages: list[QuantizedStorage | None]
    w_storages: list[QuantizedStorage | None]
    x_tensor_count: int = 0  # tensors[:x_tensor_count] are the inputs' buffers

    def restore(self, tensors: list[torch.Tensor | None]
                ) -> tuple[list[QuantizedStorage | None], list[QuantizedStorage | None]]:
        """Fresh storages holding `tensors` (in the order of self.tensors): (x, w)."""
        rest = list(tensors)
        restored = []
        for storage in self.x_storages + self.w_storages:
            if storage is None:
                restored.append(None)
                continue
            storage = storage.detach()
            rest = storage.restore_from_saved(rest)
            restored.append(storage)
        count = len(self.x_storages)
        return restored[:count], restored[count:]


def keep_for_backward(
    x_qs: list[QuantizedStorage | None], w_qs: list[QuantizedStorage | None], *,
    need_dgrad: bool, need_wgrad: bool,
) -> SavedForBackward:
    """Keep only what the backward GEMMs read: each input's columnwise copy (wgrad) and each
    weight's columnwise copy (dgrad), never a rowwise copy (seed 002: the weight itself is left
    untouched; the kept object is a detached view of its buffers)."""
    tensors: list[torch.Tensor | None] = []
    x_kept: list[QuantizedStorage | None] = []
    w_kept: list[QuantizedStorage | None] = []
    x_tensor_count = 0
    # (an index, not `source is x_qs`: torch 2.11's dynamo cannot trace `is` on lists)
    for index, (source, kept, needed) in enumerate(
            ((x_qs, x_kept, need_wgrad), (w_qs, w_kept, need_dgrad))):
        for q in source:
            if q is None or not needed:
                kept.append(None)
                continue
            q = q.detach()
            if q.has_rowwise() and q.has_columnwise():
                q.update_usage(rowwise=False)
            buffers, meta = q.prepare_for_saving()
            tensors.extend(buffers)
            kept.append(meta)
        if index == 0:
            x_tensor_count = len(tensors)
    return SavedForBackward(tensors, x_kept, w_kept, x_tensor_count)


def gemms_forward(
    x: torch.Tensor, call: GemmCall, weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
) -> tuple[torch.Tensor, list[int], SavedForBackward]:
    """y = cat_i(x_i W_i^T + b_i) in x's leading shape, the checked splits, and what backward
    keeps: the forward of LinearGemms and of the compiled op alike."""
    in_features = weights[0].shape[-1]
    if x.shape[-1] != in_features:
        raise ValueError(
            f"expected inputs with last dim {in_features}, got shape {tuple(x.shape)}"
        )
    x2d = x.reshape(-1, in_features)
    lead = tuple(x.shape[:-1])
    if call.input_gather_group is not None:  # sequence parallelism, the rows gathered as FP8
        from ..distributed.sequence_gather import gather_quantized_rows

        x_q = gather_quantized_rows(x2d, call.input_quantizers[0], call.input_gather_group,
                                    columnwise=call.need_wgrad)
        x_qs, splits = [x_q], [x_q.shape[0]]
        lead = (lead[0] * (x_q.shape[0] // max(x2d.shape[0], 1)), *lead[1:])  # along dim 0
    else:
        splits = check_splits(x2d.shape[0], call.m_splits, len(weights))
        x_qs = quantize_for_gemms(x2d, splits, call.input_quantizers, rowwise=True,
                                  columnwise=call.need_wgrad and not call.save_original_input)
    keep_weights = call.need_dgrad and not call.rebuild_weights
    y, w_qs = fprop_gemms(x_qs, weights, biases, call.weight_quantizers, call.weight_cache,
                          need_dgrad=keep_weights, out_dtype=x.dtype,
                          reuse_weights=call.reuse_weights)
    saved = keep_for_backward(x_qs, w_qs, need_dgrad=keep_weights,
                              need_wgrad=call.need_wgrad and not call.save_original_input)
    if call.output_scatter_group is not None:  # sequence parallelism: this rank's rows
        from ..distributed.sequence_gather import scatter_rows

        rows = y.shape[0]
        y = scatter_rows(y, call.output_scatter_group)
        lead = (lead[0] * y.shape[0] // max(rows, 1), *lead[1:])
    return as_output(y, (*lead, weights[0].shape[0])), splits, saved


def gemms_backward(
    grad_output: torch.Tensor, call: GemmCall, splits: list[int],
    x_qs: list[QuantizedStorage | None], w_qs: list[QuantizedStorage | None],
    weights: list[WeightInfo], has_bias: list[bool], out_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
    """(dx as [rows, K] or None, dW per split, db per split): the backward of LinearGemms and
    of the compiled op alike."""
    dy2d = grad_output.reshape(-1, grad_output.shape[-1])
    dy_qs = [None] * len(splits)
    if call.output_scatter_group is not None:  # row-parallel: the bias is added after
        grad_biases = [None] * len(splits)
    else:
        grad_biases = [dy.sum(dim=0) if bias else None
                       for dy, bias in zip(torch.split(dy2d, splits), has_bias, strict=True)]
    if call.output_scatter_group is not None and (call.need_dgrad or call.need_wgrad):
        from ..distributed.sequence_gather import gather_grad_output

        dy_qs = [gather_grad_output(dy2d, call.grad_output_quantizers[0],
                                    call.output_scatter_group, rowwise=call.need_dgrad,
                                    columnwise=call.need_wgrad)]
    elif call.need_dgrad or call.need_wgrad:
        dy_qs = quantize_for_gemms(dy2d, splits, call.grad_output_quantizers,
                                   rowwise=call.need_dgrad, columnwise=call.need_wgrad)
    grad_x, grad_weights = dgrad_wgrad_gemms(
        splits, dy_qs, w_qs, x_qs, weights, need_dgrad=call.need_dgrad,
        need_wgrad=call.need_wgrad, out_dtype=out_dtype)
    return grad_x, grad_weights, grad_biases


def as_output(y: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """The contiguous GEMM result in the caller's shape, as a tensor of its own rather than a
    view (what F.linear returns for a 3D input). Why: FSDP2 warns about, and an in-place op on
    a module's output silently breaks, a view output (`x += layer(x)` would drop FSDP2's
    pre-backward hook); _unsafe_view shares the memory without marking a view."""
    if tuple(y.shape) == tuple(shape) and y._base is None:
        return y
    if not y.is_contiguous():
        return y.reshape(shape).clone()
    return torch.ops.aten._unsafe_view(y, shape)


class LinearGemms(torch.autograd.Function):
    """y = cat_i(x_i W_i^T + b_i); params = (W_0 .. W_{G-1}, b_0 .. b_{G-1}), biases may be None.

    The eager path: the input copies go through ctx.save_for_backward (saved-tensor hooks such
    as CPU offload and activation recompute see them); the weight copies stay on ctx (an
    offload would copy every weight each step) and are dropped once backward has read them,
    unless the graph is retained.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, call: GemmCall, *params):
        count = len(call.input_quantizers)
        weights, biases = params[:count], params[count:]
        y, splits, saved = gemms_forward(x, call, list(weights), list(biases))
        x_count = saved.x_tensor_count
        # save_original_input: the input itself, as F.linear saves it
        originals = [x] if call.save_original_input else []
        ctx.original_count = len(originals)
        if call.save_original_input:
            ctx.input_scales = [forward_scale(q) for q in call.input_quantizers]
        ctx.weights_by_reference = None
        if call.rebuild_weights and any(isinstance(w, QuantizedTensor) for w in weights):
            # FSDP2's low-precision gather refills these very objects for backward (with the
            # backward direction's copy): kept by reference, since a saved-tensor hook (CPU
            # offload) would hand backward a copy of what forward saw
            ctx.weights_by_reference = weights
            ctx.save_for_backward(*saved.tensors[:x_count], *originals)
        elif call.rebuild_weights:  # the weights themselves, as F.linear saves them
            ctx.save_for_backward(*saved.tensors[:x_count], *originals, *weights)
        else:
            ctx.save_for_backward(*saved.tensors[:x_count], *originals)
        if call.rebuild_weights:
            ctx.forward_scales = [forward_scale(q) for q in call.weight_quantizers]
        ctx.w_tensors = saved.tensors[x_count:]
        # the buffers now live in autograd's saved tensors and ctx.w_tensors only: a list kept
        # here held every input copy alive after backward (as long as the graph object lived,
        # i.e. into the next step: 2.2 GiB at the 1b preset) and past an offload hook
        saved.tensors = []
        ctx.saved = saved
        ctx.weights = [WeightInfo.of(w) for w in weights]
        ctx.call, ctx.splits = call, splits
        ctx.has_bias = [bias is not None for bias in biases]
        ctx.x_shape, ctx.out_dtype = x.shape, x.dtype
        return y

    @staticmethod
    def backward(ctx, grad_output):
        saved_tensors = list(ctx.saved_tensors)
        weights = ctx.weights_by_reference
        if ctx.call.rebuild_weights and weights is None:
            count = len(ctx.call.weight_quantizers)
            weights, saved_tensors = saved_tensors[-count:], saved_tensors[:-count]
        originals = saved_tensors[len(saved_tensors) - ctx.original_count:]
        saved_tensors = saved_tensors[:len(saved_tensors) - ctx.original_count]
        x_qs, w_qs = ctx.saved.restore(saved_tensors + list(ctx.w_tensors))
        if originals:
            x_qs = rebuild_input_copies(originals[0], ctx.splits, ctx.call.input_quantizers,
                                        ctx.input_scales)
        if ctx.call.rebuild_weights:
            w_qs = [rebuild_weight_copy(weight, quantizer, scale) for weight, quantizer, scale
                    in zip(weights, ctx.call.weight_quantizers, ctx.forward_scales, strict=True)]
        if not graph_kept():
            # autograd frees the saved inputs after backward; free the weight copies with them
            # (the loss, and so this node, usually lives on into the next step's forward)
            ctx.w_tensors = ()
            ctx.weights_by_reference = None
        grad_x2d, grad_weights, grad_biases = gemms_backward(
            grad_output, ctx.call, ctx.splits, x_qs, w_qs, ctx.weights, ctx.has_bias,
            ctx.out_dtype)
        if grad_x2d is not None and ctx.call.input_gather_group is not None:
            from ..distributed.tensor_parallel import _reduce_scatter_dim0

            grad_x2d = _reduce_scatter_dim0(grad_x2d, ctx.call.input_gather_group)
        grad_x = None if grad_x2d is None else as_output(grad_x2d, ctx.x_shape)
        return (grad_x, None, *grad_weights, *grad_biases)


def _columnwise_maker(quantizer: Quantizer) -> Quantizer:
    """The quantizer that makes a weight's columnwise copy (a hybrid's columnwise child)."""
    return quantizer.columnwise_quantizer if isinstance(quantizer, HybridQuantizer) else quantizer


def can_rebuild(quantizer: Quantizer) -> bool:
    """Whether backward can make this weight quantizer's columnwise copy as forward would: not
    for a hybrid whose columnwise copy takes delayed scaling (forward's cast of that copy is
    what records its amax; a rebuild in backward would record nothing, or into the next step)."""
    return not (isinstance(quantizer, HybridQuantizer)
                and isinstance(quantizer.columnwise_quantizer, Float8Quantizer))


def forward_scale(quantizer: Quantizer) -> torch.Tensor | None:
    """The delayed-scaling scale a weight was quantized with in forward (a copy: the recipe
    state's slot is updated before backward runs), or None for a stateless quantizer (a hybrid
    with a delayed columnwise child never rebuilds: can_rebuild)."""
    return quantizer.scale.clone() if isinstance(quantizer, Float8Quantizer) else None


def rebuild_weight_copy(weight: torch.Tensor, quantizer: Quantizer,
                        scale: torch.Tensor | None) -> QuantizedStorage:
    """The weight's columnwise copy for dgrad, made in backward instead of kept from forward.

    Why: a kept copy is a full-size weight held from forward to backward, which undoes FSDP2's
    sharding of the weights (torchao's force_recompute_fp8_weight_in_bwd exists for this). The
    copy equals the one forward would have kept: a high-precision weight is quantized again
    (columnwise only: every format's scales come from the same maxima, and delayed scaling uses
    forward's scale and records no amax); a quantized weight (an FSDP2 low-precision re-gather)
    derives the copy or already holds it.
    """
    if isinstance(weight, QuantizedTensor):
        # on a view: the copy made here must not stay on the weight (FSDP2's unsharded weight
        # would hold every layer's until its next gather). Forward's copy, by contrast, stays
        # on the weight (quantized_weight): the lazy rebuild quantize_master_weights relies on
        storage = as_storage(weight).detach()
        try:
            storage.update_usage(columnwise=True)
        except ValueError as error:
            raise ValueError(
                f"{error}. This weight came to backward without its columnwise copy: FSDP2's "
                "low-precision all-gather brings an MXFP8 or hybrid weight's columnwise copy in "
                "backward's re-gather, or in forward's gather where FSDP2 keeps the weight "
                "gathered after forward; minifloat looks for the weight's FSDP2 group under the "
                "model given to enable_low_precision_all_gather, so give it the model that "
                "fully_shard wraps (or keep reshard_after_forward=True)") from None
        return storage
    return columnwise_rebuilder(quantizer, scale)(weight.detach())


def columnwise_rebuilder(quantizer: Quantizer, scale: torch.Tensor | None) -> Quantizer:
    """A copy of the quantizer that makes `quantizer`'s columnwise copy (a hybrid's columnwise
    child), making that copy alone; with `scale` (delayed scaling: forward's), casting with it
    and recording its amax into a scratch tensor, not into the recipe state."""
    rebuilt = _columnwise_maker(quantizer).copy()
    rebuilt.set_usage(rowwise=False, columnwise=True)
    rebuilt.internal = True
    if scale is not None:
        rebuilt.scale, rebuilt.amax = scale, torch.zeros_like(rebuilt.amax)
    return rebuilt


def rebuild_input_copies(x: torch.Tensor, splits: list[int], quantizers: list[Quantizer],
                         scales: list[torch.Tensor | None]) -> list[QuantizedStorage | None]:
    """Each split's columnwise copy for wgrad, made in backward from the high-precision input
    that save_original_input kept instead of the copy.

    Why: a module's input is often recomputable (a norm's or an activation's output); kept in
    high precision, torch.compile's partitioner recomputes it in backward from what the norm
    or activation saved anyway, instead of keeping a copy (torchao does the same). The copy
    equals the one forward would have made: a columnwise cast of the same input (every format's
    scales come from its maxima), delayed scaling with forward's scale recording no amax."""
    rebuilt = [columnwise_rebuilder(q, scale) for q, scale in zip(quantizers, scales,
                                                                  strict=True)]
    return split_quantize(x.reshape(-1, x.shape[-1]), splits, rebuilt)


def graph_kept() -> bool:
    """Whether the running backward keeps the graph (retain_graph / create_graph), so that a
    second backward will read the saved copies again. torch's private query (AOTAutograd asks it
    for the same reason); if it is gone, keep the copies (the safe answer)."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


def weight_gradient(
    x_q: QuantizedStorage | None, dy_q: QuantizedStorage | None, weight: WeightInfo
) -> torch.Tensor | None:
    """dW = dy^T x for one split; accumulated into weight.main_grad (fp32, set by a distributed
    optimizer) when present, then returning None so autograd leaves weight.grad alone."""
    main_grad = weight.main_grad
    if x_q is None:  # an expert that received no tokens
        return None if main_grad is not None else torch.zeros(
            weight.shape, dtype=weight.dtype, device=weight.device)
    if main_grad is not None:
        general_gemm(dy_q, x_q, a_columnwise=True, b_columnwise=True, accumulate_into=main_grad)
        return None
    return general_gemm(dy_q, x_q, a_columnwise=True, b_columnwise=True, out_dtype=weight.dtype)
