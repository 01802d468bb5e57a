"""BasicLinear: y = x W^T, the weight-only linear op (a bias is a separate Bias op).

Its GEMMs are GemmOperation's with one split: the module Linear's numerics. Inside
ops.Sequential its input may arrive already quantized by the previous op, a Bias op right after
it is folded into its GEMM epilogue (one rounding of y, as Linear), and its output and its
grad_input may leave quantized for neighbouring GEMM ops (see base.py).
"""

from __future__ import annotations

import torch

from .base import OperationContext
from .gemm_base import GemmOperation


class BasicLinear(GemmOperation):
    """x [..., in_features] -> [..., out_features] with a weight [out_features, in_features].

    Roles have module_type "linear" and `name`. Under quantized_model_init the weight is a
    QuantizedTensor holding both copies. With `weight.main_grad` (fp32, set by a distributed
    optimizer) wgrad accumulates into it and weight.grad stays None.
    """

    module_type = "linear"
    takes_epilogue_bias = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        self.in_features, self.out_features = in_features, out_features
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = self.new_weight(out_features, in_features, dtype, device)

    def gemm_weights(self) -> list[torch.Tensor]:
        return [self.weight]

    def gemm_biases(self, ctx: OperationContext) -> list[torch.Tensor | None]:
        return [ctx.epilogue_bias]

    def row_splits(self, ctx: OperationContext, rows: int) -> list[int]:
        return [rows]

    def order_parameter_gradients(self, grad_weights, grad_biases):
        return [grad_weights[0]]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"name={self.name!r}")
