"""minifloat: train PyTorch models in FP8, MXFP8 and NVFP4, with every GEMM operand's format
chosen by role and by direction. Pure Python: exact emulation everywhere, Triton and torch
scaled-matmul fast paths on NVIDIA GPUs.
"""

from . import factories, numerics, ops
from .autocast import autocast, quantized_model_init, update_delayed_backward_scales
from .checkpoint import checkpoint
from .convert import convert_model
from .gemm import general_gemm
from .graphs import make_graphed_callables
from .modules import (
    GroupedLinear,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    rebuild_weight_copies_in_backward,
    save_original_inputs,
)
from .modules.weights import quantize_weights_once
from .quantizers import (
    Float8BlockQuantizer,
    Float8BlockStorage,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Storage,
    HybridQuantizedTensor,
    HybridQuantizer,
    HybridStorage,
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
from .recipe_state import RecipeState
from .recipes import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    HybridRecipe,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QuantizerRole,
    Recipe,
)
from .serialization import register_safe_globals
from .step_graphs import GraphedStep, make_graphed_step

__version__ = "0.1.0"

register_safe_globals()

__all__ = [
    "CustomRecipe",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "HybridRecipe",
    "GroupedLinear",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QuantizerRole",
    "Recipe",
    "RecipeState",
    "autocast",
    "quantize_weights_once",
    "checkpoint",
    "convert_model",
    "factories",
    "general_gemm",
    "make_graphed_callables",
    "make_graphed_step",
    "GraphedStep",
    "quantized_model_init",
    "rebuild_weight_copies_in_backward",
    "save_original_inputs",
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
    "numerics",
    "ops",
    "register_safe_globals",
    "update_delayed_backward_scales",
]
