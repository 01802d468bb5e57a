"""nn.Modules whose GEMMs run in minifloat formats."""

from .base import QuantizedModule
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .memory import rebuild_weight_copies_in_backward, save_original_inputs

__all__ = ["GroupedLinear", "LayerNormLinear", "LayerNormMLP", "Linear", "QuantizedModule",
           "rebuild_weight_copies_in_backward", "save_original_inputs"]
