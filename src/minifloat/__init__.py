"""minifloat: train PyTorch models in FP8, MXFP8 and NVFP4, with every GEMM operand's format
chosen by role and by direction. Pure Python: exact emulation everywhere, Triton and torch
scaled-matmul fast paths on NVIDIA GPUs.
"""

from . import numerics
from .quantizers import (
    Float8BlockQuantizer,
    Float8BlockStorage,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Storage,
    IdentityQuantizer,
    IdentityStorage,
    MXFP8Quantizer,
    MXFP8Storage,
    NVFP4Quantizer,
    NVFP4Storage,
    QuantizedStorage,
    QuantizedTensor,
    Quantizer,
)
from .serialization import register_safe_globals

__version__ = "0.1.0"

register_safe_globals()

__all__ = [
    "Float8BlockQuantizer",
    "Float8BlockStorage",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8Storage",
    "IdentityQuantizer",
    "IdentityStorage",
    "MXFP8Quantizer",
    "MXFP8Storage",
    "NVFP4Quantizer",
    "NVFP4Storage",
    "QuantizedStorage",
    "QuantizedTensor",
    "Quantizer",
    "numerics",
    "register_safe_globals",
]
