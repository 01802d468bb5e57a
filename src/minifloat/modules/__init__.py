"""nn.Modules whose GEMMs run in minifloat formats."""

from .base import QuantizedModule
from .grouped_linear import GroupedLinear
from .linear import Linear

__all__ = ["GroupedLinear", "Linear", "QuantizedModule"]
