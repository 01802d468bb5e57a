"""minifloat.make_graphed_callables against the same model run eagerly.

Two copies of one model, equal weights: one graphed, one eager. Each step (inside autocast)
runs forward, backward and an in-place SGD step on both. A replay runs the kernels the eager
call launches, on the same data, so outputs, gradients, weights and delayed-scaling state must
be equal bit for bit, step after step (the delayed scales change from step to step, so a replay
that did not read the live state, or did not note its states for the update, would diverge).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import minifloat as mf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

RECIPES = {
    "current": mf.Float8CurrentScaling(),
    "delayed": mf.DelayedScaling(amax_history_len=4),
    "block": mf.Float8BlockScaling(),
    "mxfp8": mf.MXFP8BlockScaling(),
}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn_in = mf.LayerNormLinear(width, 3 * width, normalization="RMSNorm",
                                          params_dtype=torch.bfloat16, device="cuda")
        self.proj = mf.Linear(3 * width, width, params_dtype=torch.bfloat16, device="cuda")
        self.mlp = mf.LayerNormMLP(width, 4 * width, normalization="RMSNorm",
                                   params_dtype=torch.bfloat16, device="cuda")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(torch.nn.functional.gelu(self.attn_in(x)))
        return x + self.mlp(x)


def delayed_state(model: nn.Module, recipe) -> list[torch.Tensor]:
    tensors = []
    for module in model.modules():
        if isinstance(module, mf.Linear | mf.LayerNormLinear | mf.LayerNormMLP):
            forward, backward = module.recipe_states(recipe)
            tensors += [t.clone() for t in forward.state_tensors() + backward.state_tensors()]
    return tensors


@pytest.mark.parametrize("kind", list(RECIPES))
def test_graphed_steps_equal_eager_steps_bitwise(kind):
    recipe = RECIPES[kind]
    torch.manual_seed(0)
    eager = nn.Sequential(Block(128), Block(128))
    graphed = copy.deepcopy(eager)
    sample = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    before = delayed_state(graphed, recipe)
    graphed = mf.make_graphed_callables(graphed, (sample,), recipe=recipe)
    # warm-up and capture are not training steps: the recipe state is as it was
    for a, b in zip(delayed_state(graphed, recipe), before, strict=True):
        assert torch.equal(a, b)
    # a small step: the weights change (the replays must quantize the new ones) but stay finite
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (eager, graphed)]
    for step in range(4):
        x = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16) * (1 + step / 2)
        results = []
        for model, optimizer in zip((eager, graphed), optimizers, strict=True):
            xi = x.clone().requires_grad_()
            with mf.autocast(recipe=recipe):
                y = model(xi)
            y.backward(torch.ones_like(y) / 64)
            results.append((y.detach().clone(), xi.grad.clone(),
                            [p.grad.clone() for p in model.parameters()]))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        (y_e, dx_e, dw_e), (y_g, dx_g, dw_g) = results
        assert torch.isfinite(y_e).all() and torch.isfinite(dx_e).all(), "the test diverged"
        assert torch.equal(y_g, y_e), f"step {step}: output"
        assert torch.equal(dx_g, dx_e), f"step {step}: input grad"
        for a, b in zip(dw_g, dw_e, strict=True):
            assert torch.equal(a, b), f"step {step}: weight grad"
        mf.update_delayed_backward_scales()
        for a, b in zip(delayed_state(graphed, recipe), delayed_state(eager, recipe),
                        strict=True):
            assert torch.equal(a, b), f"step {step}: delayed-scaling state"
    for a, b in zip(graphed.parameters(), eager.parameters(), strict=True):
        assert torch.equal(a, b)


def test_replay_outside_its_recipe_raises():
    recipe = mf.Float8CurrentScaling()
    model = mf.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
    sample = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    model = mf.make_graphed_callables(model, (sample,), recipe=recipe)
    with pytest.raises(RuntimeError, match="replays only inside"):
        model(sample)
    with mf.autocast(recipe=mf.DelayedScaling()), pytest.raises(RuntimeError,
                                                                 match="replays only inside"):
        model(sample)
    with mf.autocast(recipe=recipe):
        model(sample).sum().backward()
