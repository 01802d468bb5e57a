"""Example quantizer factories for CustomRecipe, defined at module scope so recipes pickle.

Each takes a QuantizerRole and returns a fresh Quantizer. The `*_like` factories reproduce a
built-in recipe with default settings, so CustomRecipe(factory) and the built-in recipe give the
same bytes; they are the starting point for per-layer variations (match on role.name).
"""

from __future__ import annotations

import torch

from .quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)
from .recipes import QuantizerRole


def current_scaling_factory(role: QuantizerRole) -> Quantizer:
    """Per-tensor current scaling: E5M2 for grad_output, E4M3 otherwise."""
    dtype = torch.float8_e5m2 if role.tensor_type == "grad_output" else torch.float8_e4m3fn
    return Float8CurrentScalingQuantizer(dtype)


def nvfp4_factory(role: QuantizerRole) -> Quantizer:
    """NVFP4: 16x16 tiles for weights; 1x16 with RHT on the columnwise copy otherwise; SR for
    gradients."""
    if role.tensor_type == "weight":
        return NVFP4Quantizer(with_2d_quantization=True)
    return NVFP4Quantizer(with_rht=True, stochastic_rounding=role.tensor_type == "grad_output")


def float8_current_scaling_like(role: QuantizerRole) -> Quantizer:
    """Equal to Float8CurrentScaling() (HYBRID: gradients E5M2)."""
    return current_scaling_factory(role)


def float8_block_scaling_like(role: QuantizerRole) -> Quantizer:
    """Equal to Float8BlockScaling(): weights 128x128 tiles, everything else 1x128 blocks."""
    return Float8BlockQuantizer(2 if role.tensor_type == "weight" else 1)


def mxfp8_like(role: QuantizerRole) -> Quantizer:
    """Equal to MXFP8BlockScaling(): E4M3 for all tensors."""
    return MXFP8Quantizer(torch.float8_e4m3fn)


def nvfp4_like(role: QuantizerRole) -> Quantizer:
    """Equal to NVFP4BlockScaling() with default flags."""
    return nvfp4_factory(role)
