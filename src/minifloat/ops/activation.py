"""Activations: GELU, ReLU and SwiGLU, computed in high precision with torch's functions.

Their backward re-runs the torch function on the saved input (HighPrecisionOperation), so
values and gradients are torch's bit for bit. Before a GEMM op their output leaves quantized
with that op's input quantizer (the hand-off of base.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import HighPrecisionOperation


class GELU(HighPrecisionOperation):
    """torch.nn.functional.gelu; `approximate` is "none" or "tanh" as in torch."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class ReLU(HighPrecisionOperation):
    """torch.nn.functional.relu."""

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x)


class SwiGLU(HighPrecisionOperation):
    """silu(a) * b where a, b = x.chunk(2, dim=-1): the last dim holds the gate half first and
    the linear half second, so [..., 2 * features] -> [..., features] (the layout of a fused
    gate/up projection, BasicLinear(in, 2 * features))."""

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"SwiGLU splits the last dim in two halves; got shape "
                             f"{tuple(x.shape)} with an odd last dim")
        gate, linear = x.chunk(2, dim=-1)
        return F.silu(gate) * linear
