"""Linear: y = x W^T + b with every GEMM operand quantized by the active recipe.

Forward quantizes the input rowwise (plus columnwise when the weight needs a gradient) and the
weight rowwise (plus columnwise when the input needs a gradient), and saves only what backward
uses: the input's columnwise copy and the weight's columnwise copy. Backward quantizes dY in the
directions its two GEMMs need (DESIGN.md §3). The GEMMs live in linear_function.py, shared with
GroupedLinear.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..autocast import get_autocast_state, get_quantized_init_state
from ..quantizers import QuantizedTensor
from .base import QuantizedModule
from .linear_function import GemmCall, LinearGemms


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
        grad_enabled = torch.is_grad_enabled()
        call = GemmCall(
            m_splits=[x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0],
            weight_cache=self._weight_cache,
            input_quantizers=[forward_quantizers[0]],
            weight_quantizers=[forward_quantizers[1]],
            grad_output_quantizers=[backward_quantizers[0]],
            need_dgrad=grad_enabled and x.requires_grad,
            need_wgrad=grad_enabled and self.weight.requires_grad,
        )
        with self.delayed_scaling_scope(recipe, call.need_dgrad or call.need_wgrad) as done:
            call.backward_done = done
            return LinearGemms.apply(x, call, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, name={self.name!r}")
