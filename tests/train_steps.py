"""One optimizer step of a model under a recipe, returning what compiled-vs-eager tests compare.

Shared by the tests that train a model eagerly and compiled side by side and require equal
results over several optimizer steps (the compiled graph must read the bytes the optimizer
rewrote)."""

from __future__ import annotations

import torch
from torch import nn

import minifloat as mf


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, recipe: mf.Recipe,
                   x: torch.Tensor) -> list[torch.Tensor]:
    """Forward of a copy of `x` under `recipe`, backward of mean(y^2), one optimizer step:
    [y, dx, each parameter's gradient] (taken before the step)."""
    x = x.detach().clone().requires_grad_(True)
    with mf.autocast(recipe=recipe):
        y = model(x)
    y.float().pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, *grads]


def loss_step(model: nn.Module, optimizer: torch.optim.Optimizer, recipe: mf.Recipe):
    """A whole training step as a function of the input (what make_graphed_step captures):
    forward under `recipe`, backward of mean(y^2), the optimizer step; returns the loss."""

    def step(x: torch.Tensor) -> torch.Tensor:
        with mf.autocast(recipe=recipe):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step
