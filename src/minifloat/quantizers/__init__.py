"""Quantizers (builders) and quantized storages (data holders), one file per format family."""

from .base import QuantizedStorage, Quantizer
from .blockwise import Float8BlockQuantizer, Float8BlockStorage
from .float8 import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Storage
from .hybrid import HybridQuantizedTensor, HybridQuantizer, HybridStorage
from .identity import IdentityQuantizer, IdentityStorage
from .mxfp8 import MXFP8Quantizer, MXFP8Storage
from .nvfp4 import NVFP4Quantizer, NVFP4Storage
from .tensor import QuantizedTensor, as_storage

__all__ = [
    "Float8BlockQuantizer",
    "Float8BlockStorage",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8Storage",
    "HybridQuantizedTensor",
    "HybridQuantizer",
    "HybridStorage",
    "IdentityQuantizer",
    "IdentityStorage",
    "MXFP8Quantizer",
    "MXFP8Storage",
    "NVFP4Quantizer",
    "NVFP4Storage",
    "QuantizedStorage",
    "QuantizedTensor",
    "Quantizer",
    "as_storage",
]
