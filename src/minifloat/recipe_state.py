"""RecipeState: turns a recipe and the roles of a module's slots into quantizers.

`RecipeState.create(recipe, mode, num_quantizers, roles)` returns the state for one module and
one direction ("forward" slots: input, weight, output...; "backward" slots: grad_output,
grad_input...). `make_quantizers()` builds one quantizer per slot. Delayed-scaling state (scales
and amax history) lives on the state object, so rebuilding quantizers keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import kernels, numerics
from .quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)
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

MODES = ("forward", "backward")


def default_roles(mode: str, num_quantizers: int, name: str = "") -> list[QuantizerRole]:
    """Roles of linear-layer slots when a caller gives none: forward [input, weight, output]
    repeated (output = the next linear's input), backward [grad_output, grad_input] repeated
    (grad_input = the previous linear's grad_output)."""
    forward_cycle, backward_cycle = ("input", "weight", "input"), ("grad_output", "grad_output")
    cycle = forward_cycle if mode == "forward" else backward_cycle
    return [
        QuantizerRole("linear", cycle[i % len(cycle)], name) for i in range(num_quantizers)
    ]


def fp8_dtype_for(fmt: Format, role: QuantizerRole) -> torch.dtype:
    """E4M3 or E5M2 for a role: HYBRID gives gradients E5M2 and everything else E4M3."""
    if fmt == Format.E5M2 or (fmt == Format.HYBRID and role.is_gradient):
        return torch.float8_e5m2
    return torch.float8_e4m3fn


class RecipeState:
    """Quantizer configuration for one module and one direction."""

    # True where the state keeps amax histories that autocast updates (DelayedScaling).
    tracks_amax_history = False

    def delayed_states(self) -> list[DelayedScalingRecipeState]:
        """The delayed-scaling states inside this one (itself, a hybrid's sub-states, or none):
        what activation recompute must snapshot to replay a forward with the same scales."""
        return []

    def __init__(self, recipe: Recipe, mode: str, roles: list[QuantizerRole]) -> None:
        self.recipe = recipe
        self.mode = mode
        self.roles = roles

    @staticmethod
    def create(
        recipe: Recipe,
        mode: str = "forward",
        num_quantizers: int = 1,
        roles: Sequence[QuantizerRole] | None = None,
        device: torch.device | str | None = None,
    ) -> RecipeState:
        if mode not in MODES:
            raise ValueError(f"RecipeState mode must be 'forward' or 'backward', got {mode!r}")
        if roles is None:
            roles = default_roles(mode, num_quantizers)
        roles = list(roles)
        if len(roles) != num_quantizers:
            raise ValueError(
                f"RecipeState.create got {len(roles)} roles for {num_quantizers} quantizers"
            )
        for role in roles:
            if not isinstance(role, QuantizerRole):
                raise TypeError(f"roles must be QuantizerRole objects, got {type(role).__name__}")
        if isinstance(recipe, DelayedScaling):
            return DelayedScalingRecipeState(recipe, mode, roles, device)
        if isinstance(recipe, HybridRecipe):
            return HybridRecipeState(recipe, mode, roles, device)
        if isinstance(recipe, CustomRecipe | Float8CurrentScaling | Float8BlockScaling
                      | MXFP8BlockScaling | NVFP4BlockScaling):
            return RecipeState(recipe, mode, roles)
        raise TypeError(f"unknown recipe type {type(recipe).__name__}")

    def make_quantizers(self) -> list[Quantizer]:
        return [self._make_quantizer(index, role) for index, role in enumerate(self.roles)]

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors this state's quantizers read and record into (delayed scaling: scale
        and amax history), in a fixed order: what a compiled graph passes to minifloat's ops."""
        return []

    def with_state_tensors(self, tensors: list[torch.Tensor]
                           ) -> tuple[RecipeState, list[torch.Tensor]]:
        """(a state like this one whose quantizers use `tensors` in place of its own, the
        tensors left over); stateless recipes return themselves."""
        return self, tensors

    def _make_quantizer(self, index: int, role: QuantizerRole) -> Quantizer:
        recipe = self.recipe
        if isinstance(recipe, CustomRecipe):
            quantizer = recipe.qfactory(role)
            if quantizer is None:
                raise ValueError(
                    f"CustomRecipe factory returned None for {role}; return an "
                    "IdentityQuantizer() to keep this slot in high precision"
                )
            if not isinstance(quantizer, Quantizer):
                raise TypeError(
                    f"CustomRecipe factory returned {type(quantizer).__name__} for {role}; it "
                    "must return a minifloat Quantizer"
                )
            return quantizer
        return quantizer_for_role(recipe, role)


def quantizer_for_role(recipe: Recipe, role: QuantizerRole) -> Quantizer:
    """The quantizer a built-in (stateless) recipe assigns to a role."""
    if isinstance(recipe, Float8CurrentScaling):
        return Float8CurrentScalingQuantizer(
            fp8_dtype_for(recipe.fp8_format, role),
            amax_epsilon=recipe.amax_epsilon,
            power_2_scale=recipe.power_2_scale,
        )
    if isinstance(recipe, Float8BlockScaling):
        if role.tensor_type == "weight":
            dim = recipe.w_block_scaling_dim
        elif role.is_gradient:
            dim = recipe.grad_block_scaling_dim
        else:
            dim = recipe.x_block_scaling_dim
        return Float8BlockQuantizer(
            dim, power_2_scale=recipe.power_2_scale, amax_epsilon=recipe.amax_epsilon
        )
    if isinstance(recipe, MXFP8BlockScaling):
        return MXFP8Quantizer(fp8_dtype_for(recipe.fp8_format, role))
    if isinstance(recipe, NVFP4BlockScaling):
        if role.tensor_type == "weight":
            return NVFP4Quantizer(with_2d_quantization=not recipe.disable_2d_quantization)
        return NVFP4Quantizer(
            with_rht=not recipe.disable_rht,
            stochastic_rounding=role.is_gradient and not recipe.disable_stochastic_rounding,
        )
    raise TypeError(f"{type(recipe).__name__} has no stateless per-role quantizer")


class DelayedScalingRecipeState(RecipeState):
    """Delayed scaling: one scale and one amax-history column per slot (NUMERICS.md §3).

    Quantizers get 1-element views of `scale` and of row 0 of `amax_history`, so they record into
    this state and see updated scales without being rebuilt.
    """

    tracks_amax_history = True

    def delayed_states(self) -> list[DelayedScalingRecipeState]:
        return [self]

    def __init__(
        self,
        recipe: DelayedScaling,
        mode: str,
        roles: list[QuantizerRole],
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(recipe, mode, roles)
        slots = len(roles)
        self.scale = torch.ones(slots, dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(
            recipe.amax_history_len, slots, dtype=torch.float32, device=device
        )
        self.fp8_dtypes = [fp8_dtype_for(recipe.fp8_format, role) for role in roles]
        self.fp8_max = torch.tensor(
            [numerics.fp8_format(dtype).max_value for dtype in self.fp8_dtypes],
            dtype=torch.float32,
            device=device,
        )

    def _make_quantizer(self, index: int, role: QuantizerRole) -> Quantizer:
        return Float8Quantizer(
            self.scale[index : index + 1],
            self.amax_history[0, index : index + 1],
            self.fp8_dtypes[index],
        )

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.scale, self.amax_history]

    def with_state_tensors(self, tensors: list[torch.Tensor]
                           ) -> tuple[RecipeState, list[torch.Tensor]]:
        bound = object.__new__(type(self))
        bound.__dict__.update(self.__dict__)
        bound.scale, bound.amax_history = tensors[0], tensors[1]
        return bound, tensors[2:]

    def update(self, amax_reduction_group=None) -> None:
        """Reduce slot-0 amaxes over the group (when reduce_amax), then roll and rescale."""
        update_delayed_states([self], amax_reduction_group)


def update_delayed_states(states: list[DelayedScalingRecipeState],
                          amax_reduction_group=None) -> None:
    """Update delayed-scaling states: reduce each slot-0 amax over the group (when the recipe
    asks), then roll the histories and rescale, on the GPU in one launch per (history shape,
    margin, algorithm) (kernels.delayed_update.delayed_scaling_update_many_), elsewhere with
    numerics.delayed_scaling_update. Why one launch: autocast updates two states per module
    and step, and one launch each was ~20 ms of host time a step at 80 Linears."""
    batches: dict[tuple, list[DelayedScalingRecipeState]] = {}
    seen: set[int] = set()
    for state in states:
        if id(state) in seen:
            continue
        seen.add(id(state))
        recipe = state.recipe
        if amax_reduction_group is not None and recipe.reduce_amax:
            dist.all_reduce(state.amax_history[0], op=dist.ReduceOp.MAX,
                            group=amax_reduction_group)
        if kernels.available(state.amax_history):
            key = (tuple(state.amax_history.shape), state.amax_history.device, recipe.margin,
                   recipe.amax_compute_algo)
            batches.setdefault(key, []).append(state)
            continue
        history, scale = numerics.delayed_scaling_update(
            state.amax_history, state.scale, state.fp8_max, margin=recipe.margin,
            amax_compute_algo=recipe.amax_compute_algo)
        state.amax_history.copy_(history)
        state.scale.copy_(scale)
    if batches:
        from .kernels.delayed_update import delayed_scaling_update_many_  # Triton: GPU only

        for (_, _, margin, algorithm), batch in batches.items():
            delayed_scaling_update_many_(
                [(state.amax_history, state.scale, state.fp8_max) for state in batch],
                margin=margin, amax_compute_algo=algorithm)


class HybridRecipeState(RecipeState):
    """A HybridRecipe's slots: one sub-state per distinct GEMM recipe, over the same roles.

    Slot i's rowwise child comes from the sub-state of the GEMM its rowwise copy feeds and its
    columnwise child from the other's (recipes.HYBRID_DIRECTIONS), so delayed-scaling children
    of one recipe share that sub-state's scale and amax history for the slot.
    """

    def __init__(
        self,
        recipe: HybridRecipe,
        mode: str,
        roles: list[QuantizerRole],
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(recipe, mode, roles)
        self.sub_states: dict[Recipe, RecipeState] = {}
        for sub in (recipe.fprop, recipe.dgrad, recipe.wgrad):
            if sub is not None and sub not in self.sub_states:
                self.sub_states[sub] = RecipeState.create(sub, mode, len(roles), roles, device)
        self.tracks_amax_history = any(state.tracks_amax_history
                                       for state in self.sub_states.values())

    def _make_quantizer(self, index: int, role: QuantizerRole) -> Quantizer:
        recipe = self.recipe
        if recipe.keeps_high_precision(role):
            return IdentityQuantizer()
        children = []
        for sub in recipe.direction_recipes(role):
            if sub is None:
                children.append(IdentityQuantizer())
            else:
                children.append(self.sub_states[sub]._make_quantizer(index, role))
        return HybridQuantizer(*children)

    def delayed_states(self) -> list[DelayedScalingRecipeState]:
        return [s for state in self.sub_states.values() for s in state.delayed_states()]

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for state in self.sub_states.values() for t in state.state_tensors()]

    def with_state_tensors(self, tensors: list[torch.Tensor]
                           ) -> tuple[RecipeState, list[torch.Tensor]]:
        bound = object.__new__(type(self))
        bound.__dict__.update(self.__dict__)
        bound.sub_states = {}
        for sub, state in self.sub_states.items():
            bound.sub_states[sub], tensors = state.with_state_tensors(tensors)
        return bound, tensors

    def update(self, amax_reduction_group=None) -> None:
        """Roll and rescale the delayed-scaling sub-states (the others keep no history)."""
        update_delayed_states(self.delayed_states(), amax_reduction_group)
