"""What every quantized module shares: slot roles, recipe states, the weight cache.

Slots follow the linear layout: forward [input, weight, output], backward [grad_output,
grad_input]. The output slot carries the role of its consumer's input and the grad_input slot
the role of its consumer's grad_output (QuantizerRole has no "output" type, see seed 001).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..autocast import get_autocast_state
from ..quantizers import Quantizer
from ..recipe_state import RecipeState
from ..recipes import QuantizerRole, Recipe

FORWARD_SLOTS = ("input", "weight", "output")
BACKWARD_SLOTS = ("grad_output", "grad_input")


class QuantizedModule(nn.Module):
    """Base of minifloat's GEMM modules: roles, per-recipe quantizers and the weight cache."""

    module_type = "linear"

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        self.name = name or ""
        self.output_consumer_role: QuantizerRole | None = None
        self.grad_input_consumer_role: QuantizerRole | None = None
        self._recipe_states: dict[Recipe, tuple[RecipeState, RecipeState]] = {}
        self._quantizers: dict[Recipe, tuple[list[Quantizer], list[Quantizer]]] = {}
        self._weight_cache: dict[int, dict] = {}  # id(weight) -> its cached quantization

    # ---- roles ----

    def get_quantizer_roles(self, forward: bool) -> list[QuantizerRole]:
        """Roles of this module's forward or backward slots, in slot order."""
        if forward:
            return [
                QuantizerRole(self.module_type, "input", self.name),
                QuantizerRole(self.module_type, "weight", self.name),
                self.output_consumer_role or QuantizerRole("linear", "input", self.name),
            ]
        return [
            QuantizerRole(self.module_type, "grad_output", self.name),
            self.grad_input_consumer_role or QuantizerRole("linear", "grad_output", self.name),
        ]

    def set_consumer_roles(
        self, output: QuantizerRole | None = None, grad_input: QuantizerRole | None = None
    ) -> None:
        """Say who consumes this module's output (and so its grad_input)."""
        if output is not None:
            self.output_consumer_role = output
        if grad_input is not None:
            self.grad_input_consumer_role = grad_input
        self._recipe_states.clear()
        self._quantizers.clear()

    # ---- quantizers ----

    def recipe_states(self, recipe: Recipe) -> tuple[RecipeState, RecipeState]:
        """Forward and backward states for `recipe` (created once, kept across steps)."""
        if recipe not in self._recipe_states:
            device = self._state_device()
            forward = RecipeState.create(
                recipe, "forward", len(FORWARD_SLOTS), self.get_quantizer_roles(True), device
            )
            backward = RecipeState.create(
                recipe, "backward", len(BACKWARD_SLOTS), self.get_quantizer_roles(False), device
            )
            self._recipe_states[recipe] = (forward, backward)
        return self._recipe_states[recipe]

    def quantizers(self, recipe: Recipe) -> tuple[list[Quantizer], list[Quantizer]]:
        """(forward, backward) quantizers for `recipe`, built once and reused."""
        if recipe not in self._quantizers:
            forward, backward = self.recipe_states(recipe)
            self._quantizers[recipe] = (forward.make_quantizers(), backward.make_quantizers())
        return self._quantizers[recipe]

    def _state_device(self) -> torch.device:
        for parameter in self.parameters():
            return parameter.device
        return torch.device("cpu")

    @contextlib.contextmanager
    def delayed_scaling_scope(self, recipe: Recipe, will_run_backward: bool):
        """Enrol this call's delayed-scaling states in the autocast round for the forward run
        inside the block; yields the callback its backward must call (None when there is
        nothing to update).

        Inside minifloat.checkpoint the forward's scales are recorded; during the recompute
        they are put back for the block and nothing is enrolled or recorded into the history.
        """
        forward, backward = self.recipe_states(recipe)
        state = get_autocast_state()
        record = state.recompute_record
        if not forward.tracks_amax_history:
            yield None
        elif record is not None and record.replaying:
            with record.replay(forward.delayed_states()):
                yield None  # the recomputed graph is never run backward
        elif state.delayed_round is None:
            yield None
        else:
            if record is not None:
                record.stash(forward.delayed_states())
            state.delayed_round.register(forward, backward, will_run_backward)
            yield state.delayed_round.backward_done if will_run_backward else None
