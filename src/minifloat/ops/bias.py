"""Bias: y = x + b over the last dim, in high precision.

Right after a GEMM op that takes an epilogue bias (BasicLinear), the fuser folds the addition
into that op's GEMM: y = x W^T + b is computed in fp32 and rounded once, exactly as
minifloat.Linear adds its bias; this op then passes the tensor on. Backward is always its own:
db = sum of dy over the rows (as Linear sums it), dx = dy, quantized for a GEMM op before it.
"""

from __future__ import annotations

import torch

from .base import FusibleOperation, hand_on, high_precision


class Bias(FusibleOperation):
    """A learnable bias of `features` elements (initialised to zero)."""

    def __init__(
        self,
        features: int,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.features = features
        dtype = params_dtype or torch.get_default_dtype()
        self.bias = torch.nn.Parameter(torch.zeros(features, dtype=dtype, device=device))

    def fuser_forward(self, ctx, x, *, next_input_quantizer, prev_grad_output_quantizer,
                      **extra):
        x = high_precision(x, "Bias")
        if x.shape[-1] != self.features:
            raise ValueError(f"Bias of {self.features} features got an input of shape "
                             f"{tuple(x.shape)}")
        ctx.prev_grad_output_quantizer = prev_grad_output_quantizer
        y = x if ctx.bias_applied else x + self.bias
        return hand_on(y, next_input_quantizer)

    def fuser_backward(self, ctx, dy):
        dy = high_precision(dy, "Bias")
        grad_bias = None
        if ctx.param_requires_grad[0]:
            grad_bias = dy.reshape(-1, self.features).sum(dim=0)
        grad_x = hand_on(dy, ctx.prev_grad_output_quantizer) if ctx.input_requires_grad else None
        return grad_x, [grad_bias]

    def extra_repr(self) -> str:
        return f"features={self.features}"
