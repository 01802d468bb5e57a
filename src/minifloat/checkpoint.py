"""Activation recompute for minifloat modules: `minifloat.checkpoint(function, *args)`.

torch.utils.checkpoint alone recomputes the forward during backward, outside the autocast that
ran it, so the recompute would run in high precision and save different tensors. Under delayed
scaling it would also use the scales updated at the autocast's exit, not the ones the forward
used. This wrapper runs torch's non-reentrant checkpoint with a recompute context that restores
the autocast state of the original forward and, module call by module call, its delayed-scaling
scales; the recompute records no amax. The recomputed tensors then equal the originals bit for
bit, and so do the gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

from .autocast import autocast_state_scope, get_autocast_state


class RecomputeRecord:
    """The scales each delayed-scaling module call used in a checkpointed forward, in order."""

    def __init__(self) -> None:
        self.replaying = False
        self._snapshots: deque[list[torch.Tensor]] = deque()

    def stash(self, states: list) -> None:
        """Remember the scales a module call is about to use (original forward)."""
        self._snapshots.append([state.scale.clone() for state in states])

    @contextlib.contextmanager
    def replay(self, states: list) -> Iterator[None]:
        """Run a recomputed module call with the scales its original call used; put back the
        current scales and amax history row afterwards."""
        if not self._snapshots:
            raise RuntimeError(
                "minifloat.checkpoint: the recompute ran more delayed-scaling module calls than "
                "the original forward; the checkpointed function must run the same modules"
            )
        snapshot = self._snapshots.popleft()
        current = [(state.scale.clone(), state.amax_history[0].clone()) for state in states]
        for state, scale in zip(states, snapshot, strict=True):
            state.scale.copy_(scale)
        try:
            yield
        finally:
            for state, (scale, amax_row) in zip(states, current, strict=True):
                state.scale.copy_(scale)
                state.amax_history[0].copy_(amax_row)


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's context_fn: called when the checkpointed forward starts."""
    record = RecomputeRecord()
    original = get_autocast_state()
    forward_state = dataclasses.replace(original, recompute_record=record)

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        record.replaying = True
        with autocast_state_scope(dataclasses.replace(original, recompute_record=record)):
            yield

    return autocast_state_scope(forward_state), recompute()


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `function(*args, **kwargs)` without keeping its activations; recompute them in
    backward under the same quantization as the forward (see the module docstring).

    Takes torch.utils.checkpoint.checkpoint's keyword arguments (preserve_rng_state,
    determinism_check, debug) except use_reentrant (always False: the reentrant variant runs the
    forward under no_grad, where minifloat makes no backward copies) and context_fn (used here).
    """
    if kwargs.pop("use_reentrant", False):
        raise ValueError(
            "minifloat.checkpoint supports only use_reentrant=False (the reentrant variant "
            "runs the forward under no_grad); drop the argument"
        )
    if "context_fn" in kwargs:
        raise ValueError("minifloat.checkpoint sets context_fn itself; do not pass one")
    checkpoint_kwargs = {name: kwargs.pop(name) for name in
                         ("preserve_rng_state", "determinism_check", "debug") if name in kwargs}
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=_contexts, **checkpoint_kwargs, **kwargs
    )
