"""Convergence: a 2-layer MLP of minifloat Linears (32 -> 64 -> 32, ReLU, 64 rows per step)
trained 200 Adam steps on a synthetic teacher-student regression under each recipe reaches a
held-out loss within a per-format factor of the same model trained in fp32 without autocast.

Setup: fresh batches every step (so the model cannot memorise a fixed set and the loss floors at
the noise variance 0.09 plus the student's approximation error, ~0.23 for fp32 after 200 steps);
the held-out loss is measured with the recipe active (quantized inference), on 256 rows.
"""

from __future__ import annotations

import pytest
import torch

import minifloat as mf

STEPS, ROWS, NOISE, LR = 200, 64, 0.3, 1e-2

# Bounds on loss / fp32 loss. Measured: ~1.02 for every FP8 recipe and MXFP8, ~1.3-1.5 for
# NVFP4. Why: the quantized forward adds an output error of relative size ~4% (E4M3 operands) or
# ~15% (NVFP4), i.e. an extra MSE of (0.04 * rms(y))^2 ~ 0.003 and (0.15 * rms(y))^2 ~ 0.05 at
# rms(y) ~ 1.5, on top of a 0.23 floor, plus some optimisation noise from quantized gradients.
# A training path that does not learn ends near the initial loss (~1.7, ratio ~7), and one with
# a systematically wrong gradient (transposed, missing a scale) far above the bounds.
RECIPES = {
    "delayed": (mf.DelayedScaling(), 1.3),
    "current": (mf.Float8CurrentScaling(), 1.3),
    "block": (mf.Float8BlockScaling(), 1.3),
    "mxfp8": (mf.MXFP8BlockScaling(), 1.3),
    "nvfp4": (mf.NVFP4BlockScaling(), 2.0),
    "nvfp4-nosr": (mf.NVFP4BlockScaling(disable_stochastic_rounding=True), 2.0),
}

TEACHER = torch.randn(32, 32, generator=torch.Generator().manual_seed(7)) / 32**0.5


def teacher_batch(generator, rows):
    x = torch.randn(rows, 32, generator=generator)
    y = torch.tanh(x @ TEACHER) * 2 + NOISE * torch.randn(rows, 32, generator=generator)
    return x, y


def train(recipe):
    """(held-out loss before training, after training) for a fixed init and data stream."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(mf.Linear(32, 64, name="fc1"), torch.nn.ReLU(),
                                mf.Linear(64, 32, name="fc2"))
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    x_eval, y_eval = teacher_batch(torch.Generator().manual_seed(999), 256)
    enabled = recipe is not None

    def evaluate():
        with torch.no_grad(), mf.autocast(enabled=enabled, recipe=recipe):
            return torch.nn.functional.mse_loss(model(x_eval), y_eval).item()

    initial = evaluate()
    generator = torch.Generator().manual_seed(123)
    for _ in range(STEPS):
        x, y = teacher_batch(generator, ROWS)
        optimizer.zero_grad()
        with mf.autocast(enabled=enabled, recipe=recipe):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        loss.backward()
        optimizer.step()
    assert torch.isfinite(loss)
    return initial, evaluate()


@pytest.fixture(scope="module")
def fp32_loss():
    initial, final = train(None)
    assert final < 0.25 * initial  # the baseline itself learns
    return final


@pytest.mark.parametrize("kind", list(RECIPES))
def test_mlp_converges_like_fp32(kind, fp32_loss):
    recipe, bound = RECIPES[kind]
    initial, final = train(recipe)
    assert final < 0.25 * initial, f"{kind}: loss {initial:.4f} -> {final:.4f}"
    ratio = final / fp32_loss
    assert ratio < bound, f"{kind}: final loss {final:.4f} is {ratio:.2f}x fp32's {fp32_loss:.4f}"
