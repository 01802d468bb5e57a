"""Recipes (frozen, validated dataclasses), Format, and QuantizerRole.

A recipe says how every tensor slot of every module is quantized. Built-in recipes decide by
role (weights 2D for block FP8 and NVFP4, gradients E5M2 under HYBRID, SR for NVFP4 gradients,
...); CustomRecipe hands each slot's role to a factory. Defaults follow NUMERICS.md §10.
"""

from __future__ import annotations

import enum
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

TENSOR_TYPES = ("input", "weight", "grad_output")


class Format(enum.Enum):
    """Element format of a recipe. HYBRID: E4M3 for forward tensors, E5M2 for gradients."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"
    E2M1 = "E2M1"


@dataclass(frozen=True)
class QuantizerRole:
    """What a tensor slot is: which module type, which GEMM operand, which layer.

    tensor_type is the operand as its consumer sees it: "input", "weight" or "grad_output".
    A module's output slot carries its consumer's input role and its grad_input slot the
    consumer's grad_output role (there are no "output"/"grad_input" types: the consumer decides
    the format).
    """

    module_type: str = "linear"
    tensor_type: str = "input"
    name: str = ""

    def __post_init__(self) -> None:
        if self.tensor_type not in TENSOR_TYPES:
            raise ValueError(
                f"QuantizerRole.tensor_type must be one of {TENSOR_TYPES}, got "
                f"{self.tensor_type!r}; label an output by its consumer's input role and a "
                "grad_input by its consumer's grad_output role"
            )
        if not isinstance(self.module_type, str) or not isinstance(self.name, str):
            raise TypeError("QuantizerRole.module_type and name must be strings")

    @property
    def is_gradient(self) -> bool:
        return self.tensor_type == "grad_output"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


class Recipe:
    """Base of all recipes (for isinstance checks)."""

    def uses_delayed_scaling(self) -> bool:
        """Whether some slot keeps an amax history that autocast must update each step."""
        return False


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor FP8 with scales from an amax history of earlier steps (NUMERICS.md §3)."""

    fp8_format: Format = Format.HYBRID
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        _require(self.fp8_format in (Format.E4M3, Format.E5M2, Format.HYBRID),
                 f"DelayedScaling.fp8_format must be E4M3, E5M2 or HYBRID, got {self.fp8_format}")
        _require(self.margin >= 0, f"DelayedScaling.margin must be >= 0, got {self.margin}")
        _require(self.amax_history_len >= 1,
                 f"DelayedScaling.amax_history_len must be >= 1, got {self.amax_history_len}")
        _require(self.amax_compute_algo in ("max", "most_recent"),
                 "DelayedScaling.amax_compute_algo must be 'max' or 'most_recent', got "
                 f"{self.amax_compute_algo!r}")

    def uses_delayed_scaling(self) -> bool:
        return True


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 with each tensor's own amax (NUMERICS.md §2)."""

    fp8_format: Format = Format.HYBRID
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    fprop_use_split_accumulator: bool = False
    dgrad_use_split_accumulator: bool = True
    wgrad_use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        _require(self.fp8_format in (Format.E4M3, Format.E5M2, Format.HYBRID),
                 f"Float8CurrentScaling.fp8_format must be E4M3, E5M2 or HYBRID, "
                 f"got {self.fp8_format}")
        _require(self.amax_epsilon >= 0,
                 f"Float8CurrentScaling.amax_epsilon must be >= 0, got {self.amax_epsilon}")


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """DeepSeek-style FP8 blocks of 128 (NUMERICS.md §4): inputs and grads 1D, weights 2D."""

    fp8_format: Format = Format.E4M3
    power_2_scale: bool = True
    amax_epsilon: float = 0.0
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self) -> None:
        _require(self.fp8_format == Format.E4M3,
                 f"Float8BlockScaling uses E4M3 only, got {self.fp8_format}")
        _require(self.amax_epsilon >= 0,
                 f"Float8BlockScaling.amax_epsilon must be >= 0, got {self.amax_epsilon}")
        for field in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            value = getattr(self, field)
            _require(value in (1, 2), f"Float8BlockScaling.{field} must be 1 or 2, got {value}")
        _require(not (self.x_block_scaling_dim == 2 and self.w_block_scaling_dim == 2),
                 "Float8BlockScaling: a 2D x 2D GEMM has no kernel; make inputs 1D")
        _require(not (self.grad_block_scaling_dim == 2 and self.w_block_scaling_dim == 2),
                 "Float8BlockScaling: a 2D x 2D dgrad GEMM has no kernel; make gradients 1D")


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 (NUMERICS.md §5): E4M3 elements and E8M0 scales per 32 for all tensors."""

    fp8_format: Format = Format.E4M3

    def __post_init__(self) -> None:
        _require(self.fp8_format in (Format.E4M3, Format.HYBRID),
                 f"MXFP8BlockScaling.fp8_format must be E4M3 or HYBRID, got {self.fp8_format}")


@dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4 (NUMERICS.md §6): weights 16x16; RHT on input/grad columnwise copies; SR on grads."""

    fp4_format: Format = Format.E2M1
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        _require(self.fp4_format == Format.E2M1,
                 f"NVFP4BlockScaling.fp4_format must be E2M1, got {self.fp4_format}")


@dataclass(frozen=True)
class CustomRecipe(Recipe):
    """Quantizers built by `qfactory(role) -> Quantizer`, called once per slot.

    The factory must be a module-level function (or another picklable callable) so that recipes
    travel into checkpoints and worker processes; it must never return None (return an
    IdentityQuantizer to keep a slot in high precision).
    """

    qfactory: Callable[[QuantizerRole], Any]

    def __post_init__(self) -> None:
        if not callable(self.qfactory):
            raise TypeError(
                f"CustomRecipe.qfactory must be callable(role) -> Quantizer, got "
                f"{type(self.qfactory).__name__}"
            )

    def __getstate__(self) -> dict[str, Any]:
        try:
            pickle.dumps(self.qfactory)
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            name = getattr(self.qfactory, "__qualname__", repr(self.qfactory))
            raise TypeError(
                f"CustomRecipe.qfactory {name} cannot be pickled ({error}); define the factory "
                "as a module-level function so the recipe can be checkpointed"
            ) from error
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "__dict__", dict(state))


# Which GEMM each copy of each tensor feeds (DESIGN.md §3): (rowwise, columnwise).
HYBRID_DIRECTIONS = {
    "input": ("fprop", "wgrad"),
    "weight": ("fprop", "dgrad"),
    "grad_output": ("dgrad", "wgrad"),
}


@dataclass(frozen=True)
class HybridRecipe(Recipe):
    """A recipe per GEMM: `fprop`, `dgrad` and `wgrad` each name the recipe whose formats the
    operands of that GEMM use (None keeps that GEMM in high precision).

    A tensor's two copies feed different GEMMs, so each slot becomes a HybridQuantizer:

        tensor        rowwise copy   columnwise copy
        input X       fprop          wgrad
        weight W      fprop          dgrad
        grad dY       dgrad          wgrad

    e.g. `HybridRecipe(fprop=MXFP8BlockScaling(), dgrad=NVFP4BlockScaling(),
    wgrad=NVFP4BlockScaling())` is MXFP8 forward with NVFP4 backward. Each copy is quantized the
    way its GEMM's recipe quantizes that role (NVFP4 weights 16x16, RHT on the wgrad copies...).

    `high_precision` keeps chosen slots out of quantization (IdentityQuantizer) by pattern:
    "glob" matches the layer name of a role ("layers.0.*", "lm_head"), "glob:tensor_type" one
    operand of those layers ("*:grad_output", "head:weight").
    """

    fprop: Recipe | None
    dgrad: Recipe | None
    wgrad: Recipe | None
    high_precision: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for gemm in ("fprop", "dgrad", "wgrad"):
            sub = getattr(self, gemm)
            if sub is not None and not isinstance(sub, Recipe):
                raise TypeError(
                    f"HybridRecipe.{gemm} must be a minifloat Recipe or None (high precision), "
                    f"got {type(sub).__name__}"
                )
            if isinstance(sub, HybridRecipe):
                raise TypeError(f"HybridRecipe.{gemm} cannot itself be a HybridRecipe")
        patterns = self.high_precision
        if isinstance(patterns, str):
            raise TypeError(
                "HybridRecipe.high_precision is a tuple of patterns; write "
                f"high_precision=({patterns!r},)"
            )
        object.__setattr__(self, "high_precision", tuple(patterns))
        for pattern in self.high_precision:
            if not isinstance(pattern, str):
                raise TypeError(f"HybridRecipe.high_precision patterns must be strings, got "
                                f"{pattern!r}")
            _, _, tensor_type = pattern.partition(":")
            _require(tensor_type in ("", *TENSOR_TYPES),
                     f"HybridRecipe.high_precision pattern {pattern!r}: the part after ':' must "
                     f"be one of {TENSOR_TYPES}")

    def uses_delayed_scaling(self) -> bool:
        return any(sub is not None and sub.uses_delayed_scaling()
                   for sub in (self.fprop, self.dgrad, self.wgrad))

    def keeps_high_precision(self, role: QuantizerRole) -> bool:
        """Whether a high_precision pattern selects this slot."""
        for pattern in self.high_precision:
            name_glob, _, tensor_type = pattern.partition(":")
            if fnmatchcase(role.name, name_glob) and tensor_type in ("", role.tensor_type):
                return True
        return False

    def direction_recipes(self, role: QuantizerRole) -> tuple[Recipe | None, Recipe | None]:
        """(recipe of the rowwise copy, recipe of the columnwise copy) of a slot."""
        row_gemm, col_gemm = HYBRID_DIRECTIONS[role.tensor_type]
        return getattr(self, row_gemm), getattr(self, col_gemm)
