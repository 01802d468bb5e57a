"""nn.Modules whose GEMMs run in minifloat formats."""

from .base import QuantizedModule
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear

__all__ = ["GroupedLinear", "LayerNormLinear", "LayerNormMLP", "Linear", "QuantizedModule"]
