"""Linear: y = x W^T + b with every GEMM operand quantized by the active recipe.

Forward quantizes the input rowwise (plus columnwise when the weight needs a gradient) and the
weight rowwise (plus columnwise when the input needs a gradient), and saves only what backward
uses: the input's columnwise copy and the weight's columnwise copy. Backward quantizes dY in the
directions its two GEMMs need (DESIGN.md §3). The GEMMs live in linear_function.py, shared with
GroupedLinear.
"""

from __future__ import annotations

import torch

from .base import QuantizedModule


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
        self.weight = self.new_weight(out_features, in_features, dtype, device)
        self.bias = self.new_bias(out_features, in_features, dtype, device) if bias else None

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """y = x W^T + b; `is_first_microbatch` as in TransformerEngine (see run_gemms)."""
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        return self.run_gemms(x, [rows], [self.weight], [self.bias], gemms=[0],
                              is_first_microbatch=is_first_microbatch)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, name={self.name!r}")
