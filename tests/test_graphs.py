"""make_graphed_callables on the CPU: what can be checked without CUDA graphs.

The capture itself, and replays against eager steps bit for bit, are tested on the GPU
(tests/gpu/test_graphed_callables_cuda.py). Here: the clear error without CUDA, and the replay
guard (the recipe check and the delayed-scaling notes) around a stand-in for a captured graph.
"""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from minifloat.autocast import get_autocast_state, recipe_token
from minifloat.graphs import _guard


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only error")
def test_without_cuda_says_so():
    model = mf.Linear(16, 16)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        mf.make_graphed_callables(model, (torch.randn(4, 16),))


def test_inside_autocast_is_refused():
    model = mf.Linear(16, 16)
    with mf.autocast(recipe=mf.DelayedScaling()), pytest.raises(RuntimeError, match="outside"):
        mf.make_graphed_callables(model, (torch.randn(4, 16),))


def test_replay_guard_checks_recipe_and_notes_delayed_states():
    recipe = mf.DelayedScaling()
    module = mf.Linear(16, 16)
    module.recipe_states(recipe)  # registers its delayed-scaling pair
    pair = module._delayed_handles[recipe]
    calls = []
    replay = _guard(lambda x: calls.append(x) or x, recipe_token(recipe), [pair], True, module)
    with pytest.raises(RuntimeError, match="replays only inside"):
        replay(1)
    with mf.autocast(recipe=mf.Float8CurrentScaling()), pytest.raises(RuntimeError):
        replay(2)
    assert calls == []
    with mf.autocast(recipe=recipe):
        assert replay(3) == 3
        assert list(get_autocast_state().delayed_round.used.values()) == [pair]
    module.eval()  # torch runs the eager forward when the training flag differs: no checks
    assert replay(4) == 4
    assert calls == [3, 4]
