"""torch.serialization safe globals, so `torch.load(..., weights_only=True)` reads minifloat
tensors and quantizers without opening the door to arbitrary pickles."""

from __future__ import annotations

import torch

from . import quantizers, recipes
from .quantizers.tensor import _rebuild_quantized_tensor


def safe_globals() -> list:
    """Every class and function a pickled minifloat tensor refers to."""
    classes = [getattr(quantizers, name) for name in quantizers.__all__ if name[0].isupper()]
    recipe_classes = [
        recipes.Format, recipes.QuantizerRole, recipes.DelayedScaling,
        recipes.Float8CurrentScaling, recipes.Float8BlockScaling, recipes.MXFP8BlockScaling,
        recipes.NVFP4BlockScaling, recipes.HybridRecipe,
    ]
    return [*classes, *recipe_classes, _rebuild_quantized_tensor]


def register_safe_globals() -> None:
    """Register minifloat's classes with torch.serialization (idempotent)."""
    torch.serialization.add_safe_globals(safe_globals())
