"""GroupedLinear op: one linear per expert over row splits of one input (mixture of experts).

The fusible counterpart of minifloat.GroupedLinear, with the same parameters (weight0..,
bias0..) and numerics: rows [sum(m[:i]), sum(m[:i+1])) of x go through expert i; splits may be
uneven or empty. The token counts are a per-call input: `ops.Sequential.forward(x,
m_splits=...)` hands them to every grouped op (they appear in `extra_inputs`).

Each expert quantizes its rows with its own quantizer (its own scale), which needs the splits,
so a neighbour never hands this op a quantized input or grad_output: it quantizes its own
operands with split_quantize. Its output and its grad_input, whole tensors, may still leave
quantized for a neighbouring single-GEMM op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..modules.grouped_linear import ExpertParameters, init_expert_parameters
from .base import OperationContext
from .gemm_base import GemmOperation


class GroupedLinear(ExpertParameters, GemmOperation):
    """`num_gemms` linear layers of shape [out_features, in_features] over row splits.

    Roles have module_type "grouped_linear" and `name` for every expert. The biases are the
    op's own (added in each expert's GEMM epilogue), as in the module.
    """

    module_type = "grouped_linear"
    accepts_quantized_operands = False
    extra_inputs = ("m_splits",)

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        init_expert_parameters(self, num_gemms, in_features, out_features, bias, params_dtype,
                               device)

    def gemm_weights(self) -> list[torch.Tensor]:
        return self.weights

    def gemm_biases(self, ctx: OperationContext) -> list[torch.Tensor | None]:
        return self.biases

    def own_biases(self) -> list[torch.Tensor | None]:
        return self.biases

    def fuser_forward(self, ctx, x, *, next_input_quantizer, prev_grad_output_quantizer,
                      m_splits: Sequence[int] | None = None, **extra):
        if m_splits is None:
            raise ValueError("the GroupedLinear op needs the token count of each expert: call "
                             "Sequential.forward(x, m_splits=[...])")
        ctx.m_splits = [int(m) for m in m_splits]
        return super().fuser_forward(ctx, x, next_input_quantizer=next_input_quantizer,
                                     prev_grad_output_quantizer=prev_grad_output_quantizer)

    def row_splits(self, ctx: OperationContext, rows: int) -> list[int]:
        return ctx.m_splits

    def order_parameter_gradients(self, grad_weights, grad_biases):
        grads = {}
        for gemm in range(self.num_gemms):
            grads[f"weight{gemm}"] = grad_weights[gemm]
            grads[f"bias{gemm}"] = grad_biases[gemm]
        return [grads[name] for name, _ in self.named_parameters()]

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}, name={self.name!r}")
