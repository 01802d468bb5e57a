"""nn.Modules whose GEMMs run in minifloat formats."""

from .base import QuantizedModule
from .linear import Linear

__all__ = ["Linear", "QuantizedModule"]
