"""GemmOperation: the GEMM triples of a (grouped) linear op over row splits, as a fusible op.

The numerics are those of modules/linear_function.LinearGemms, built from the same pieces
(quantize_for_gemms / split_quantize, quantized_weight, general_gemm), so an op equals the
module bit for bit:

    fprop   y_i  = x_i W_i^T (+ b_i)     x_i rowwise, W_i rowwise
    dgrad   dx_i = dy_i W_i              dy_i rowwise, W_i columnwise
    wgrad   dW_i = dy_i^T x_i            dy_i columnwise, x_i columnwise

What the fusion adds: the input may arrive already quantized by the previous op (with this
op's input quantizer, see base.py), a Bias op right after is added in the GEMM's fp32 epilogue
(as Linear adds its bias, so y is rounded once), the output may leave quantized for the next
GEMM op, and dgrad's result may leave quantized with the previous GEMM op's grad_output
quantizer. The weight follows the two-step rule of seed 002 (modules/weights.py): rowwise
always, columnwise when grad is enabled and dgrad will run; usages are OR-merged into a
quantized weight's quantizer, never removed.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..modules.base import BACKWARD_SLOTS, FORWARD_SLOTS, QuantizedModule, plain_weight
from ..modules.linear_function import (
    WeightInfo,
    dgrad_wgrad_gemms,
    fprop_gemms,
    keep_for_backward,
    quantize_for_gemms,
)
from ..modules.weights import weight_cache_for
from ..quantizers import QuantizedStorage, Quantizer
from ..quantizers.split import check_splits
from ..recipes import QuantizerRole
from .base import FusibleOperation, OperationContext, QuantizedActivation, hand_on


class GemmOperation(QuantizedModule, FusibleOperation):
    """Base of the GEMM ops. Subclasses give `gemm_weights`, `gemm_biases` and `row_splits`."""

    # whether a neighbour may hand this op a quantized input / grad_output: only single-GEMM
    # ops; a grouped op quantizes each expert's rows with its own quantizer, which needs the
    # splits, so it quantizes its own operands
    accepts_quantized_operands: ClassVar[bool] = True
    takes_epilogue_bias: ClassVar[bool] = False

    def gemm_weights(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def gemm_biases(self, ctx: OperationContext) -> list[torch.Tensor | None]:
        raise NotImplementedError

    def row_splits(self, ctx: OperationContext, rows: int) -> list[int]:
        raise NotImplementedError

    # ---- roles and quantizers for the neighbours ----

    def input_role(self) -> QuantizerRole:
        return QuantizerRole(self.module_type, "input", self.gemm_name(0))

    def grad_output_role(self) -> QuantizerRole:
        return QuantizerRole(self.module_type, "grad_output", self.gemm_name(0))

    def fuser_prepare(self, ctx: OperationContext) -> None:
        weights = self.gemm_weights()
        ctx.need_dgrad = ctx.input_requires_grad
        ctx.need_wgrad = ctx.grad_enabled and any(w.requires_grad for w in weights)
        if ctx.recipe is not None:
            forward, backward = self.quantizers(ctx.recipe)
            per_forward, per_backward = len(FORWARD_SLOTS), len(BACKWARD_SLOTS)
            gemms = range(len(weights))
            ctx.input_quantizers = [forward[per_forward * g] for g in gemms]
            ctx.weight_quantizers = [forward[per_forward * g + 1] for g in gemms]
            ctx.grad_output_quantizers = [backward[per_backward * g] for g in gemms]

    def input_quantizer_for_producer(self, ctx: OperationContext) -> Quantizer | None:
        """A copy of the input quantizer set for the copies this call needs (rowwise for fprop,
        columnwise for wgrad): a copy, so another call reconfiguring the shared one cannot
        change it (delayed-scaling state tensors are shared, so amaxes still land here)."""
        if ctx.recipe is None or not self.accepts_quantized_operands:
            return None
        quantizer = ctx.input_quantizers[0].copy()
        quantizer.set_usage(rowwise=True, columnwise=ctx.need_wgrad)
        quantizer.internal = True
        return quantizer

    def grad_output_quantizer_for_producer(self, ctx: OperationContext) -> Quantizer | None:
        """A copy of the grad_output quantizer set for dgrad (rowwise) and wgrad (columnwise);
        None when this op's backward needs neither."""
        if (ctx.recipe is None or not self.accepts_quantized_operands
                or not (ctx.need_dgrad or ctx.need_wgrad)):
            return None
        quantizer = ctx.grad_output_quantizers[0].copy()
        quantizer.set_usage(rowwise=ctx.need_dgrad, columnwise=ctx.need_wgrad)
        quantizer.internal = True
        return quantizer

    # ---- forward ----

    def fuser_forward(self, ctx, x, *, next_input_quantizer, prev_grad_output_quantizer,
                      **extra):
        ctx.prev_grad_output_quantizer = prev_grad_output_quantizer
        weights, biases = self.gemm_weights(), self.gemm_biases(ctx)
        shape = x.shape
        if shape[-1] != weights[0].shape[-1]:
            raise ValueError(f"{type(self).__name__} expects inputs with last dim "
                             f"{weights[0].shape[-1]}, got shape {tuple(shape)}")
        rows = shape.numel() // shape[-1] if shape[-1] else 0
        ctx.splits = check_splits(rows, self.row_splits(ctx, rows), len(weights))
        ctx.x_shape, ctx.out_dtype, ctx.weights = shape, x.dtype, weights
        if ctx.recipe is None:
            y = self._forward_high_precision(ctx, x, weights, biases)
        else:
            y = self._forward_quantized(ctx, x, weights, biases)
        return hand_on(y.reshape(*shape[:-1], weights[0].shape[0]), next_input_quantizer)

    def _forward_high_precision(self, ctx, x, weights, biases) -> torch.Tensor:
        """Outside autocast: F.linear per split, as the modules run it."""
        pieces = torch.split(x.reshape(-1, x.shape[-1]), ctx.splits)
        plain = [plain_weight(w) for w in weights]
        ctx.save_for_backward(x if ctx.need_wgrad else None,
                              *(w if ctx.need_dgrad else None for w in plain))
        outputs = [torch.nn.functional.linear(piece, w, b)
                   for piece, w, b in zip(pieces, plain, biases, strict=True)]
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _forward_quantized(self, ctx, x, weights, biases) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            x_qs: list[QuantizedStorage | None] = [x.storage]  # handed on by the previous op
        else:
            x_qs = quantize_for_gemms(x.reshape(-1, x.shape[-1]), ctx.splits,
                                      ctx.input_quantizers, rowwise=True,
                                      columnwise=ctx.need_wgrad)
        weight_cache, reuse = weight_cache_for(self._weight_cache, ctx.is_first_microbatch)
        y, w_qs = fprop_gemms(x_qs, weights, biases, ctx.weight_quantizers, weight_cache,
                              need_dgrad=ctx.need_dgrad, out_dtype=ctx.out_dtype,
                              reuse_weights=reuse)
        saved = keep_for_backward(x_qs, w_qs, need_dgrad=ctx.need_dgrad,
                                  need_wgrad=ctx.need_wgrad)
        ctx.save_for_backward(*saved.tensors)
        saved.tensors = []  # held by the saved tensors alone (see LinearGemms.forward)
        ctx.kept = saved
        return y

    # ---- backward ----

    def fuser_backward(self, ctx, dy):
        if ctx.recipe is None:
            grad_x, grad_weights = self._backward_high_precision(ctx, dy)
            dy2d = dy.reshape(-1, dy.shape[-1])
        else:
            grad_x, grad_weights, dy2d = self._backward_quantized(ctx, dy)
        grad_biases = self._bias_gradients(ctx, dy2d)
        if grad_x is not None:
            grad_x = hand_on(grad_x.reshape(ctx.x_shape), ctx.prev_grad_output_quantizer)
        return grad_x, self.order_parameter_gradients(grad_weights, grad_biases)

    def order_parameter_gradients(
        self, grad_weights: list[torch.Tensor | None], grad_biases: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """The gradients in the order of self.parameters()."""
        raise NotImplementedError

    def _bias_gradients(self, ctx, dy2d) -> list[torch.Tensor | None]:
        """Gradients of this op's own biases (grouped op), per split as LinearGemms sums them."""
        own = self.own_biases()
        if all(b is None for b in own):
            return [None] * len(own)
        if dy2d is None:
            raise RuntimeError(f"{type(self).__name__} needs its grad_output in high precision "
                               "for its bias gradient")
        return [piece.sum(dim=0) if bias is not None else None
                for piece, bias in zip(torch.split(dy2d, ctx.splits), own, strict=True)]

    def own_biases(self) -> list[torch.Tensor | None]:
        return [None] * len(self.gemm_weights())

    def _backward_high_precision(self, ctx, dy):
        """The derivatives torch's linear uses, by the same calls (dx = dy W, dW = dy^T x)."""
        x, *plain = ctx.saved_tensors
        dy_pieces = torch.split(dy.reshape(-1, dy.shape[-1]), ctx.splits)
        grad_x = None
        if ctx.need_dgrad:
            pieces = [d.mm(w) for d, w in zip(dy_pieces, plain, strict=True)]
            grad_x = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        grad_weights: list[torch.Tensor | None] = [None] * len(plain)
        if ctx.need_wgrad:
            x_pieces = torch.split(x.reshape(-1, x.shape[-1]), ctx.splits)
            grad_weights = [d.t().mm(p) for d, p in zip(dy_pieces, x_pieces, strict=True)]
        return grad_x, grad_weights

    def _backward_quantized(self, ctx, dy):
        splits = ctx.splits
        dy2d = None
        if isinstance(dy, QuantizedActivation):
            dy_qs = [dy.storage]  # quantized by the next op with this op's quantizer
        else:
            dy2d = dy.reshape(-1, dy.shape[-1])
            dy_qs = [None] * len(splits)
            if ctx.need_dgrad or ctx.need_wgrad:
                dy_qs = quantize_for_gemms(dy2d, splits, ctx.grad_output_quantizers,
                                           rowwise=ctx.need_dgrad, columnwise=ctx.need_wgrad)
        x_qs, w_qs = ctx.kept.restore(list(ctx.saved_tensors))
        grad_x, grad_weights = dgrad_wgrad_gemms(
            splits, dy_qs, w_qs, x_qs, [WeightInfo.of(w) for w in ctx.weights],
            need_dgrad=ctx.need_dgrad, need_wgrad=ctx.need_wgrad, out_dtype=ctx.out_dtype)
        return grad_x, grad_weights, dy2d
