"""autocast and quantized_model_init: the contexts that turn quantization on.

`autocast(recipe=...)` makes minifloat modules quantize their GEMM operands inside it. It nests
and restores the previous state on exit.

The active recipe is also published as a small integer, `active_token()` (0: quantization off),
so that a module's forward reads one int instead of objects: torch.compile guards on that int,
equal for every layer, never on a recipe, quantizer or module name.

Delayed scaling (NUMERICS.md §3): each module registers its delayed-scaling states once, when
they are created, and each call notes them in the round of the outermost autocast (one list
append; the compiled op does the same from its state tensors). At the exit of the outermost
autocast the forward slots of the states noted in it are updated; their backward slots are
updated at the entry of the next outermost autocast (or by update_delayed_backward_scales()),
before any backward of the new step can read them, so no Python runs in backward: a standard
step (forward in autocast, then backward) sees the scales of an update right after its
backward. A replayed CUDA graph runs no Python and notes nothing: a round of a delayed recipe
that noted no state updates every state registered under that recipe.

`quantized_model_init(recipe=...)` makes modules built inside it hold QuantizedTensor weights.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .recipe_state import update_delayed_states
from .recipes import DelayedScaling, Recipe


@dataclass
class DelayedScalingRound:
    """The delayed recipes and the states used inside one outermost autocast, and the group to
    reduce over."""

    amax_reduction_group: object = None
    recipes: list = field(default_factory=list)
    used: dict = field(default_factory=dict)  # id(pair) -> _StatePair, in order of first use

    def add(self, recipe: Recipe) -> None:
        if recipe.uses_delayed_scaling() and recipe not in self.recipes:
            self.recipes.append(recipe)

    def pairs(self) -> list:
        if self.used:
            return list(self.used.values())
        return [pair for recipe in self.recipes for pair in registered_delayed_states(recipe)]

    def update_forward(self) -> None:
        """Every used module's forward states, in one batched update (update_delayed_states)."""
        update_delayed_states([state for pair in self.pairs()
                               for state in pair.forward.delayed_states()],
                              self.amax_reduction_group)

    def update_backward(self) -> None:
        update_delayed_states([state for pair in self.pairs()
                               for state in pair.backward.delayed_states()],
                              self.amax_reduction_group)


@dataclass
class AutocastState:
    enabled: bool = False
    recipe: Recipe | None = None
    amax_reduction_group: object = None
    delayed_round: DelayedScalingRound | None = None
    # Set inside minifloat.checkpoint: the record of delayed scales its forward used, replayed
    # by the recompute (see checkpoint.py).
    recompute_record: object = None
    token: int = 0  # recipe_token(recipe) while enabled, else 0


_STATE = AutocastState()
_INIT_STATE: dict = {"enabled": False, "recipe": None, "keep_high_precision_copy": False}

# The int published for the active recipe; equal recipes share one token for the process.
_ACTIVE_TOKEN = 0
_TOKENS: dict[Recipe, int] = {}
_RECIPES: list[Recipe | None] = [None]  # token -> recipe (0: none)

# Delayed-scaling states by recipe, in registration order (the same order on every rank, so
# that their all-reduces pair up): weak references to (forward, backward) state pairs.
_DELAYED_STATES: dict[Recipe, list[weakref.ref]] = {}
# The round whose backward slots the next outermost autocast entry updates.
_BACKWARD_PENDING: DelayedScalingRound | None = None
# outermost enabled autocasts entered so far (activation recompute's replays not counted): a
# forward pass's number, for the eager weight-cast batch (modules/weight_cast_batch.py)
_FORWARD_PASSES = [0]


def default_recipe() -> Recipe:
    return DelayedScaling()


def recipe_token(recipe: Recipe) -> int:
    """The process-wide int standing for `recipe` (equal recipes share it)."""
    token = _TOKENS.get(recipe)
    if token is None:
        token = _TOKENS[recipe] = len(_RECIPES)
        _RECIPES.append(recipe)
    return token


def recipe_for_token(token: int) -> Recipe:
    return _RECIPES[token]


def active_token() -> int:
    """recipe_token of the active recipe, or 0 outside autocast (read by every module call)."""
    return _ACTIVE_TOKEN


class _StatePair:
    """A module's forward and backward delayed-scaling states, registered as one entry."""

    def __init__(self, forward, backward) -> None:
        self.forward, self.backward = forward, backward


def register_delayed_states(recipe: Recipe, forward, backward) -> object:
    """Enrol a module's delayed-scaling states for `recipe` in the autocast updates; returns
    the handle the caller must keep alive (the registry holds it weakly)."""
    pair = _StatePair(forward, backward)
    _DELAYED_STATES.setdefault(recipe, []).append(weakref.ref(pair))
    return pair


def registered_delayed_states(recipe: Recipe) -> list[_StatePair]:
    """The state pairs registered for `recipe` that are still alive, in order."""
    refs = _DELAYED_STATES.get(recipe, [])
    pairs = [ref() for ref in refs]
    if any(pair is None for pair in pairs):
        _DELAYED_STATES[recipe] = [ref for ref, pair in zip(refs, pairs, strict=True)
                                   if pair is not None]
    return [pair for pair in pairs if pair is not None]


def note_delayed_use(pair: _StatePair) -> None:
    """Record that a module call used these states (its amaxes go into this round's update)."""
    delayed_round = _STATE.delayed_round
    if delayed_round is not None and id(pair) not in delayed_round.used:
        delayed_round.used[id(pair)] = pair


def update_delayed_backward_scales() -> None:
    """Update the backward slots of the last round's delayed recipes (once per round): what
    the next outermost autocast entry does; call it by hand to read the updated scales of a
    step's backward before the next step starts."""
    global _BACKWARD_PENDING
    pending, _BACKWARD_PENDING = _BACKWARD_PENDING, None
    if pending is not None:
        pending.update_backward()


def pending_delayed_round() -> DelayedScalingRound | None:
    """The last outermost autocast's round, whose backward update the next entry applies
    (None once applied, or when no autocast ran)."""
    return _BACKWARD_PENDING


def forward_pass() -> int:
    """The number of the current outermost autocast (0 before any): a new one per forward pass
    when each forward enters autocast, as training loops and micro-batches do."""
    return _FORWARD_PASSES[0]


def get_autocast_state() -> AutocastState:
    return _STATE


def _activate(state: AutocastState) -> None:
    global _STATE, _ACTIVE_TOKEN
    _STATE = state
    _ACTIVE_TOKEN = state.token if state.enabled else 0


@contextlib.contextmanager
def autocast_state_scope(state: AutocastState) -> Iterator[None]:
    """Make `state` the active autocast state inside the block (activation recompute)."""
    previous = _STATE
    _activate(state)
    try:
        yield
    finally:
        _activate(previous)


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

    Enter it outside torch.compile'd code (around the compiled model or step), as with
    TransformerEngine's fp8_autocast: the compiled graph reads which recipe is active.
    """
    global _BACKWARD_PENDING
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"autocast recipe must be a minifloat Recipe, got {type(recipe).__name__}")
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "minifloat.autocast was entered inside torch.compile'd code; enter it outside the "
            "compiled function or module (with mf.autocast(recipe=r): compiled_model(x))"
        )
    previous = _STATE
    recipe = recipe if recipe is not None else default_recipe()
    delayed_round = previous.delayed_round
    record = previous.recompute_record
    owns_round = False
    if enabled and delayed_round is None and not getattr(record, "replaying", False):
        update_delayed_backward_scales()
        delayed_round = DelayedScalingRound(amax_reduction_group=amax_reduction_group)
        owns_round = True
        _FORWARD_PASSES[0] += 1
    if enabled and delayed_round is not None and not getattr(record, "replaying", False):
        delayed_round.add(recipe)
    active_recipe = recipe if enabled else None
    token = recipe_token(recipe) if enabled else 0
    _activate(AutocastState(enabled, active_recipe, amax_reduction_group, delayed_round, record,
                            token))
    try:
        yield
    finally:
        _activate(previous)
        if owns_round and delayed_round.recipes:
            # a recompute replays the scales of the original forward and must not update them
            delayed_round.update_forward()
            _BACKWARD_PENDING = delayed_round


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
