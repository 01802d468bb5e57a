"""convert_model: swap nn.Linear layers for minifloat.Linear in place, keeping their weights."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from .modules import Linear
from .recipe_state import RecipeState
from .recipes import Recipe


def _fits_recipe(layer: nn.Linear, recipe: Recipe | None, name: str) -> bool:
    """Whether every quantizer of the recipe can hold this layer's weight [N, K]."""
    if recipe is None:
        return True
    probe = Linear(1, 1, bias=False, device="meta", name=name)
    forward = RecipeState.create(recipe, "forward", 3, probe.get_quantizer_roles(True))
    weight_quantizer = forward.make_quantizers()[1]
    return weight_quantizer.is_quantizable(torch.empty(layer.weight.shape, device="meta"))


def convert_model(
    model: nn.Module,
    recipe: Recipe | None = None,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
) -> nn.Module:
    """Replace each nn.Linear (accepted by filter_fn(name, module)) with a minifloat.Linear.

    Weights and biases are moved, not copied. Layers whose weight shape the recipe's formats
    cannot hold (e.g. 100 features under MXFP8's blocks of 32) stay nn.Linear, and one warning
    lists them. Returns the model.
    """
    skipped = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            full_name = f"{parent_name}.{child_name}" if parent_name else child_name
            if filter_fn is not None and not filter_fn(full_name, child):
                continue
            if not _fits_recipe(child, recipe, full_name):
                skipped.append(f"{full_name} {tuple(child.weight.shape)}")
                continue
            replacement = Linear(
                child.in_features, child.out_features, bias=child.bias is not None,
                params_dtype=child.weight.dtype, device="meta", name=full_name,
            )
            replacement.weight = child.weight
            replacement.bias = child.bias
            setattr(parent, child_name, replacement)
    if skipped:
        warnings.warn(
            "convert_model kept these layers as nn.Linear because the recipe's formats cannot "
            f"hold their shapes: {', '.join(skipped)}",
            stacklevel=2,
        )
    return model
