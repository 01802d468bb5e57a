"""Linear: y = x W^T + b with every GEMM operand quantized by the active recipe.

Forward quantizes the input rowwise (plus columnwise when the weight needs a gradient) and the
weight rowwise (plus columnwise when the input needs a gradient), and saves only what backward
uses: the input's columnwise copy and the weight's columnwise copy. Backward quantizes dY in the
directions its two GEMMs need (DESIGN.md §3).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..autocast import get_autocast_state, get_quantized_init_state
from ..gemm import general_gemm
from ..quantizers import QuantizedTensor, Quantizer
from .base import QuantizedModule


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, input_quantizer, weight_quantizer,
                grad_output_quantizer, need_dgrad, need_wgrad, backward_done):
        in_features = weight.shape[-1]
        if x.shape[-1] != in_features:
            raise ValueError(
                f"Linear expects inputs with last dim {in_features}, got shape {tuple(x.shape)}"
            )
        x2d = x.reshape(-1, in_features)
        input_quantizer.set_usage(rowwise=True, columnwise=need_wgrad)
        input_quantizer.internal = True
        x_q = input_quantizer(x2d)
        w_q = module.quantized_weight(
            weight, weight_quantizer, rowwise=True, columnwise=need_dgrad
        )
        out_dtype = x.dtype
        y = general_gemm(x_q, w_q, out_dtype=out_dtype, bias=bias)

        if need_wgrad:
            x_q.update_usage(rowwise=False)  # backward needs only the columnwise copy
        saved_x, x_q = x_q.prepare_for_saving() if need_wgrad else ([], None)
        ctx.save_for_backward(*saved_x)
        ctx.x_q, ctx.w_q = x_q, w_q if need_dgrad else None
        ctx.weight = weight
        ctx.grad_output_quantizer = grad_output_quantizer
        ctx.need_wgrad, ctx.need_dgrad = need_wgrad, need_dgrad
        ctx.has_bias = bias is not None
        ctx.x_shape, ctx.out_dtype = x.shape, out_dtype
        ctx.backward_done = backward_done
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        out_features = grad_output.shape[-1]
        dy2d = grad_output.reshape(-1, out_features)
        quantizer = ctx.grad_output_quantizer
        quantizer.set_usage(rowwise=ctx.need_dgrad, columnwise=ctx.need_wgrad)
        quantizer.internal = True
        grad_x = grad_weight = grad_bias = None
        if ctx.need_dgrad or ctx.need_wgrad:
            dy_q = quantizer(dy2d)
        if ctx.need_dgrad:
            grad_x = general_gemm(dy_q, ctx.w_q, b_columnwise=True, out_dtype=ctx.out_dtype)
            grad_x = grad_x.reshape(ctx.x_shape)
        if ctx.need_wgrad:
            ctx.x_q.restore_from_saved(list(ctx.saved_tensors))
            main_grad = getattr(ctx.weight, "main_grad", None)
            if main_grad is not None:
                general_gemm(dy_q, ctx.x_q, a_columnwise=True, b_columnwise=True,
                             accumulate_into=main_grad)
                grad_weight = None
            else:
                grad_weight = general_gemm(dy_q, ctx.x_q, a_columnwise=True, b_columnwise=True,
                                           out_dtype=ctx.weight.dtype)
        if ctx.has_bias:
            grad_bias = dy2d.sum(dim=0)
        if ctx.backward_done is not None:
            ctx.backward_done()
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None, None


class Linear(QuantizedModule):
    """A drop-in nn.Linear whose GEMMs run in the autocast recipe's formats.

    Outside autocast it is an ordinary linear layer (a quantized weight is dequantized).
    With `weight.main_grad` (an fp32 tensor set by a distributed optimizer) wgrad accumulates
    into it and `weight.grad` stays None.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        self.in_features, self.out_features = in_features, out_features
        dtype = params_dtype or torch.get_default_dtype()
        weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        self.bias = None
        if bias:
            bound = 1 / math.sqrt(in_features) if in_features else 0.0
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=dtype, device=device).uniform_(-bound, bound)
            )
        self.weight = nn.Parameter(self._initial_weight(weight))

    def _initial_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """Under quantized_model_init the parameter is a QuantizedTensor (low precision only)."""
        init = get_quantized_init_state()
        if not init["enabled"]:
            return weight
        if init["keep_high_precision_copy"]:
            self.weight_hp_init = weight.detach().clone()
        weight_quantizer = self.quantizers(init["recipe"])[0][1].copy()
        weight_quantizer.set_usage(rowwise=True, columnwise=True)
        weight_quantizer.internal = False
        return weight_quantizer(weight)

    def _state_device(self) -> torch.device:
        weight = getattr(self, "weight", None)
        return weight.device if weight is not None else torch.device("cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = get_autocast_state()
        if not state.enabled:
            weight = self.weight
            if isinstance(weight, QuantizedTensor):
                weight = weight.dequantize()
            return F.linear(x, weight, self.bias)
        recipe = state.recipe
        forward_quantizers, backward_quantizers = self.quantizers(recipe)
        # Decided here, not from ctx.needs_input_grad (which ignores torch.no_grad): under
        # no_grad no columnwise copy is made and nothing is saved.
        grad_enabled = torch.is_grad_enabled()
        need_dgrad = grad_enabled and x.requires_grad
        need_wgrad = grad_enabled and self.weight.requires_grad
        input_quantizer: Quantizer = forward_quantizers[0]
        with self.delayed_scaling_scope(recipe, need_dgrad or need_wgrad) as backward_done:
            return _LinearFunction.apply(
                x, self.weight, self.bias, self, input_quantizer, forward_quantizers[1],
                backward_quantizers[0], need_dgrad, need_wgrad, backward_done,
            )

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, name={self.name!r}")
