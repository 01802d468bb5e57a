"""NVFP4 recipe variants for ablations: one of NVFP4BlockScaling's flags off each, the LM head
kept in high precision as `compare` keeps it for its named recipes.

Why: issue 19's NVFP4 gap (about 6% of the bf16 val loss at the `small` preset) has to be
traced to an ingredient of the recipe (2D weight tiles, the RHT on the wgrad operands, stochastic
rounding of the gradients) or to a GEMM direction before anything can be proposed to close it.
The directions are the `hybrid:` specs that `compare` takes; the flags are these functions:

    python -m minifloat compare --preset tiny --steps 2000 \\
        --recipes bf16,nvfp4,benchmarks/nvfp4_variants.py:no_2d
    python benchmarks/recipe_seeds.py --preset small --steps 1000 --seeds 0,1 --device cuda \\
        --recipes bf16,nvfp4,benchmarks/nvfp4_variants.py:no_2d --out DIR
"""

from __future__ import annotations

from minifloat.recipes import HybridRecipe, NVFP4BlockScaling


def _head_kept(recipe: NVFP4BlockScaling) -> HybridRecipe:
    """The recipe in every GEMM, the layer named "head" in high precision (compare's default)."""
    return HybridRecipe(recipe, recipe, recipe, high_precision=("head",))


def no_sr() -> HybridRecipe:
    """Gradients rounded to nearest instead of stochastically."""
    return _head_kept(NVFP4BlockScaling(disable_stochastic_rounding=True))


def no_rht() -> HybridRecipe:
    """No random Hadamard transform on the wgrad operands."""
    return _head_kept(NVFP4BlockScaling(disable_rht=True))


def no_2d() -> HybridRecipe:
    """Weights in 1x16 blocks (rowwise and columnwise apart) instead of 16x16 tiles."""
    return _head_kept(NVFP4BlockScaling(disable_2d_quantization=True))
