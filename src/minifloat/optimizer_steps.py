"""How many optimizer steps this process has taken: what tells a cached weight cast it is stale.

Why: foreach and fused optimizer steps (CUDA's defaults) update parameters without bumping
their version counters, so a cache of quantized weights keyed on `Tensor._version` alone would
hand out the bytes of the weights before the step. A global optimizer step post-hook
(registered once, on the first `watch()`) counts the steps of every torch.optim optimizer; a
cache stamps its copies with the count and the parameter's version counter (load_state_dict and
every other in-place op on the parameter bump it). A change through `.data`, or by an optimizer
that is not a torch.optim.Optimizer, is not seen.

Used by the FSDP2 batched weight casts (distributed/batched_weight_casts.py) and the eager
batched weight cast (modules/weight_cast_batch.py).
"""

from __future__ import annotations

from typing import Any

_STEPS = [0]  # optimizer steps taken in this process (any optimizer)
_HOOK: list = []


def _count(*_: Any) -> None:
    _STEPS[0] += 1


def watch() -> None:
    """Start counting optimizer steps (idempotent: the hook is registered once)."""
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_count))


def count() -> int:
    """Optimizer steps taken since watch() was first called."""
    return _STEPS[0]


def add(steps: int) -> None:
    """Count `steps` optimizer steps that ran without Python: a replayed CUDA graph's
    (step_graphs.GraphedStep), whose captured optimizer step calls no hook, so that caches of
    quantized weights know the weights changed."""
    _STEPS[0] += steps
