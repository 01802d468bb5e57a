"""Fusible ops: build a network as `ops.Sequential(op, op, ...)` run as one autograd function.

    seq = ops.Sequential(ops.LayerNorm(512), ops.BasicLinear(512, 2048), ops.Bias(2048),
                         ops.GELU(), ops.BasicLinear(2048, 512), ops.Bias(512))
    with minifloat.autocast(recipe=...):
        y = seq(x)

GEMM ops (BasicLinear, GroupedLinear) are QuantizedModules with the roles, recipes and weight
handling of minifloat.Linear / minifloat.GroupedLinear; the others compute in high precision.
Neighbours hand quantized tensors along (a GELU before a BasicLinear quantizes its output with
that op's input quantizer) and a Bias after a BasicLinear is added in the GEMM epilogue, so a
Sequential equals the equivalent module stack bit for bit. See base.py and sequential.py.
"""

from .activation import GELU, ReLU, SwiGLU
from .base import FusibleOperation, HighPrecisionOperation, OperationContext, QuantizedActivation
from .bias import Bias
from .gemm_base import GemmOperation
from .grouped_linear import GroupedLinear
from .linear import BasicLinear
from .normalization import LayerNorm, RMSNorm
from .sequential import Sequential

__all__ = [
    "GELU",
    "BasicLinear",
    "Bias",
    "FusibleOperation",
    "GemmOperation",
    "GroupedLinear",
    "HighPrecisionOperation",
    "LayerNorm",
    "OperationContext",
    "QuantizedActivation",
    "RMSNorm",
    "ReLU",
    "Sequential",
    "SwiGLU",
]
