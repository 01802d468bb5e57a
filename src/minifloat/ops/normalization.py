"""LayerNorm and RMSNorm over the last dim, computed in high precision with torch's functions.

Parameters are initialised as torch.nn.LayerNorm / RMSNorm do (weight 1, bias 0), and backward
re-runs the torch function on the saved input (HighPrecisionOperation), so outputs and every
gradient equal the torch modules bit for bit. Before a GEMM op the normalized output leaves
quantized with that op's input quantizer (base.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import HighPrecisionOperation


class RMSNorm(HighPrecisionOperation):
    """x / sqrt(mean(x^2) + eps) * weight over the last `features` elements."""

    def __init__(
        self,
        features: int,
        eps: float = 1e-5,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.features, self.eps = features, eps
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.ones(features, dtype=dtype, device=device))

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.features,), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"features={self.features}, eps={self.eps}"


class LayerNorm(RMSNorm):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last `features` elements (RMSNorm's
    parameters plus a shift)."""

    def __init__(
        self,
        features: int,
        eps: float = 1e-5,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(features, eps, params_dtype, device)
        self.bias = nn.Parameter(torch.zeros_like(self.weight))

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.features,), self.weight, self.bias, self.eps)
