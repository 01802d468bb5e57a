"""autocast and quantized_model_init: the contexts that turn quantization on.

`autocast(recipe=...)` makes minifloat modules quantize their GEMM operands inside it. It nests
and restores the previous state on exit. Under DelayedScaling it also closes the loop of
NUMERICS.md §3: forward slots update at the exit of the outermost autocast that ran them;
backward slots update once the last pending backward of the round has run (the first module's,
in a plain network).

`quantized_model_init(recipe=...)` makes modules built inside it hold QuantizedTensor weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from .recipes import DelayedScaling, Recipe


@dataclass
class DelayedScalingRound:
    """Delayed-scaling states touched inside one outermost autocast."""

    amax_reduction_group: object = None
    forward_states: list = field(default_factory=list)
    backward_states: list = field(default_factory=list)
    pending_backwards: int = 0

    def register(self, forward_state, backward_state, will_run_backward: bool) -> None:
        """Record a module call's states; count it when its backward will run."""
        if not any(state is forward_state for state in self.forward_states):
            self.forward_states.append(forward_state)
        if not any(state is backward_state for state in self.backward_states):
            self.backward_states.append(backward_state)
        if will_run_backward:
            self.pending_backwards += 1

    def backward_done(self) -> None:
        """Called by each counted backward; the last one updates every backward slot, so a
        frozen first layer (no backward) does not leave the round without an update."""
        self.pending_backwards -= 1
        if self.pending_backwards == 0:
            self.update_backward()

    def update_forward(self) -> None:
        for state in self.forward_states:
            state.update(self.amax_reduction_group)

    def update_backward(self) -> None:
        for state in self.backward_states:
            state.update(self.amax_reduction_group)


@dataclass
class AutocastState:
    enabled: bool = False
    recipe: Recipe | None = None
    amax_reduction_group: object = None
    delayed_round: DelayedScalingRound | None = None
    # Set inside minifloat.checkpoint: the record of delayed scales its forward used, replayed
    # by the recompute (see checkpoint.py).
    recompute_record: object = None


_STATE = AutocastState()
_INIT_STATE: dict = {"enabled": False, "recipe": None, "keep_high_precision_copy": False}


def default_recipe() -> Recipe:
    return DelayedScaling()


def get_autocast_state() -> AutocastState:
    return _STATE


@contextlib.contextmanager
def autocast_state_scope(state: AutocastState) -> Iterator[None]:
    """Make `state` the active autocast state inside the block (activation recompute)."""
    global _STATE
    previous = _STATE
    _STATE = state
    try:
        yield
    finally:
        _STATE = previous


def is_quantization_enabled() -> bool:
    return _STATE.enabled


@contextlib.contextmanager
def autocast(
    enabled: bool = True,
    recipe: Recipe | None = None,
    amax_reduction_group: object = None,
) -> Iterator[None]:
    """Quantize the GEMMs of minifloat modules run inside this context with `recipe`.

    amax_reduction_group (a torch.distributed group) is used at the point of use: delayed-scaling
    amax all-reduce at updates, current-scaling amax reductions by TP layers. It is never stored
    on a quantizer.
    """
    global _STATE
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"autocast recipe must be a minifloat Recipe, got {type(recipe).__name__}")
    previous = _STATE
    recipe = recipe if recipe is not None else default_recipe()
    delayed_round = previous.delayed_round
    record = previous.recompute_record
    owns_round = False
    if enabled and recipe.uses_delayed_scaling() and delayed_round is None:
        delayed_round = DelayedScalingRound(amax_reduction_group=amax_reduction_group)
        # a recompute replays the scales of the original forward and must not update them
        owns_round = not getattr(record, "replaying", False)
    active_recipe = recipe if enabled else None
    _STATE = AutocastState(enabled, active_recipe, amax_reduction_group, delayed_round, record)
    try:
        yield
    finally:
        _STATE = previous
        if owns_round:
            delayed_round.update_forward()


def get_quantized_init_state() -> dict:
    return _INIT_STATE


@contextlib.contextmanager
def quantized_model_init(
    enabled: bool = True,
    recipe: Recipe | None = None,
    keep_high_precision_copy: bool = False,
) -> Iterator[None]:
    """Modules built inside hold QuantizedTensor weights, stored in low precision only.

    With keep_high_precision_copy each such module also keeps `weight_hp_init`, a detached
    high-precision copy of the initial values, to seed fp32 master weights.
    """
    global _INIT_STATE
    previous = _INIT_STATE
    _INIT_STATE = {
        "enabled": enabled,
        "recipe": (recipe if recipe is not None else default_recipe()) if enabled else None,
        "keep_high_precision_copy": keep_high_precision_copy,
    }
    try:
        yield
    finally:
        _INIT_STATE = previous
