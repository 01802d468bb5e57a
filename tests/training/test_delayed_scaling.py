"""Delayed scaling (NUMERICS.md §3) through Linear and autocast: the forward amax history and
scales after each autocast exit, and the backward ones after the backward pass, equal a plain
Python/numpy recomputation from amaxes computed here (x.abs().max()); special amaxes (0, inf,
NaN) keep the scale; margin; 'most_recent'; each step's GEMMs use the previous step's scales."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import minifloat as mf

from ._reference import assert_bitwise_equal, linear_reference

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
FLT_MAX = float(np.finfo(np.float32).max)
IN_FEATURES, OUT_FEATURES, ROWS = 64, 32, 16


class PythonDelayedScaling:
    """NUMERICS.md §3 in plain Python floats, with the fp32 divisions done by numpy.float32."""

    def __init__(self, history_len, fp8_maxes, margin=0, algo="max"):
        self.history = [[0.0] * len(fp8_maxes) for _ in range(history_len)]
        self.scale = [1.0] * len(fp8_maxes)
        self.fp8_maxes, self.margin, self.algo = fp8_maxes, margin, algo

    def record(self, slot, amax):
        old = self.history[0][slot]
        self.history[0][slot] = amax if (math.isnan(amax) or math.isnan(old)) else max(old, amax)

    def update(self):
        for slot, fp8_max in enumerate(self.fp8_maxes):
            column = [row[slot] for row in self.history]
            if self.algo == "max":
                amax = math.nan if any(math.isnan(v) for v in column) else max(column)
            else:
                amax = column[0]
            if amax > 0 and math.isfinite(amax):
                scale = np.float32(fp8_max) / np.float32(amax) / np.float32(2.0**self.margin)
                self.scale[slot] = FLT_MAX if math.isinf(scale) else float(scale)
        self.history = self.history[1:] + [self.history[0]]
        self.history[0] = [0.0] * len(self.fp8_maxes)

    def check(self, state, what):
        torch.testing.assert_close(state.amax_history, torch.tensor(self.history),
                                   rtol=0, atol=0, equal_nan=True, msg=f"{what}: history")
        torch.testing.assert_close(state.scale, torch.tensor(self.scale), rtol=0, atol=0,
                                   msg=f"{what}: scale")


def amax_of(t):
    return t.detach().float().abs().max().item()


def make_linear(seed=0):
    torch.manual_seed(seed)
    return mf.Linear(IN_FEATURES, OUT_FEATURES)


def data(seed, x_amp, dy_amp):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, IN_FEATURES, generator=g)
    x = x / x.abs().max() * x_amp
    dy = torch.randn(ROWS, OUT_FEATURES, generator=g)
    dy = dy / dy.abs().max() * dy_amp
    return x, dy


@pytest.mark.parametrize(
    "history_len, margin, algo",
    [(4, 0, "max"), (4, 1, "max"), (3, 0, "most_recent"), (1, 2, "max"), (1024, 0, "max")],
)
def test_scales_and_history_follow_python_recomputation(history_len, margin, algo):
    recipe = mf.DelayedScaling(amax_history_len=history_len, margin=margin,
                               amax_compute_algo=algo)
    lin = make_linear()
    fwd_model = PythonDelayedScaling(history_len, [E4M3_MAX] * 3, margin, algo)
    bwd_model = PythonDelayedScaling(history_len, [E5M2_MAX] * 2, margin, algo)
    amplitudes = [(2.0, 1e-3), (8.0, 3e-2), (0.5, 1e-4), (1.0, 2.0), (3.0, 5e-3), (0.25, 1e-2)]
    for step, (x_amp, dy_amp) in enumerate(amplitudes):
        x, dy = data(step, x_amp, dy_amp)
        x.requires_grad_(True)
        used = {"input": fwd_model.scale[0], "weight": fwd_model.scale[1],
                "grad_output": bwd_model.scale[0]}
        with mf.autocast(recipe=recipe):
            y = lin(x)
            fwd_state, bwd_state = lin.recipe_states(recipe)
            # inside the autocast nothing is updated yet
            torch.testing.assert_close(fwd_state.scale, torch.tensor(fwd_model.scale),
                                       rtol=0, atol=0)
        fwd_model.record(0, amax_of(x))
        fwd_model.record(1, amax_of(lin.weight))
        fwd_model.update()
        fwd_model.check(fwd_state, f"step {step} forward")
        bwd_model.check(bwd_state, f"step {step} backward slots before backward")
        y.backward(dy)
        mf.update_delayed_backward_scales()  # backward slots update at the next entry
        bwd_model.record(0, amax_of(dy))
        bwd_model.update()
        bwd_model.check(bwd_state, f"step {step} backward")
        # this step's GEMMs used the scales of the previous updates
        ref_y, ref_dx, ref_dw, _ = linear_reference(
            "delayed", x.detach(), lin.weight.detach(), lin.bias.detach(), dy, scales=used)
        assert_bitwise_equal(y.detach(), ref_y, f"step {step} y")
        assert_bitwise_equal(x.grad, ref_dx, f"step {step} dx")
        assert_bitwise_equal(lin.weight.grad, ref_dw, f"step {step} dw")
        lin.zero_grad()
    assert fwd_model.scale[0] != 1.0 and bwd_model.scale[0] != 1.0
    assert fwd_model.scale[2] == 1.0  # the output slot is never cast by Linear


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_special_amaxes_keep_the_scale(algo):
    recipe = mf.DelayedScaling(amax_history_len=3, amax_compute_algo=algo)
    lin = make_linear(1)
    model = PythonDelayedScaling(3, [E4M3_MAX] * 3, 0, algo)
    x_good, _ = data(0, 4.0, 1.0)
    x_inf = x_good.clone()
    x_inf[3, 5] = math.inf
    x_nan = x_good.clone()
    x_nan[7, 1] = math.nan
    fwd_state = None
    zeros = torch.zeros_like(x_good)
    sequence = [("normal", x_good), ("zeros", zeros), ("inf", x_inf), ("nan", x_nan),
                ("normal again", x_good * 0.5), ("zeros", zeros)]
    for step, (label, x) in enumerate(sequence):
        scale_before = list(model.scale)
        with mf.autocast(recipe=recipe):
            lin(x)
        fwd_state, _ = lin.recipe_states(recipe)
        model.record(0, amax_of(x))
        model.record(1, amax_of(lin.weight))
        model.update()
        model.check(fwd_state, f"step {step} ({label})")
        if label in ("zeros", "inf", "nan") and algo == "most_recent":
            assert model.scale[0] == scale_before[0], label  # guard on the model itself
    # 'max' keeps 448/4 throughout (the inf and NaN stay in the 3-step history); 'most_recent'
    # moves to 448/2 at the "normal again" step and keeps it for the zeros after it
    final_amax = 4.0 if algo == "max" else 2.0
    assert fwd_state.scale[0].item() == float(np.float32(E4M3_MAX) / np.float32(final_amax))


def test_zero_inf_nan_amax_keep_scale_explicitly():
    # history_len 1: the new scale comes from this step's amax alone
    recipe = mf.DelayedScaling(amax_history_len=1)
    lin = make_linear(2)
    x, _ = data(3, 7.0, 1.0)
    with mf.autocast(recipe=recipe):
        lin(x)
    fwd_state, _ = lin.recipe_states(recipe)
    expected = np.float32(E4M3_MAX) / np.float32(7.0)
    assert fwd_state.scale[0].item() == float(expected)
    for bad in (torch.zeros_like(x), x.clone().fill_(math.inf), x.clone().fill_(math.nan)):
        with mf.autocast(recipe=recipe):
            lin(bad)
        assert fwd_state.scale[0].item() == float(expected), bad.flatten()[0]
        assert not fwd_state.amax_history.any()  # rolled and zeroed
    # an inf amax still casts with saturation: finite data (E4M3 has no inf)
    x_inf = x.clone()
    x_inf[0, 0] = math.inf
    with mf.autocast(recipe=recipe):
        y = lin(x_inf)
    assert torch.isfinite(y).all()


def test_tiny_amax_gives_flt_max_scale():
    recipe = mf.DelayedScaling(amax_history_len=1)
    lin = make_linear(3)
    x = torch.zeros(ROWS, IN_FEATURES)
    x[0, 0] = 1e-45  # subnormal: 448 / amax overflows fp32
    with mf.autocast(recipe=recipe):
        lin(x)
    fwd_state, _ = lin.recipe_states(recipe)
    assert fwd_state.scale[0].item() == FLT_MAX


def test_backward_slots_update_once_after_the_last_backward_of_the_step():
    recipe = mf.DelayedScaling(amax_history_len=4)
    torch.manual_seed(5)
    fc1 = mf.Linear(IN_FEATURES, 64, name="fc1")
    fc2 = mf.Linear(64, OUT_FEATURES, name="fc2")
    x, dy = data(6, 2.0, 1e-2)
    with mf.autocast(recipe=recipe):
        h = fc1(x)
        h.retain_grad()
        y = fc2(h)
    states = {name: m.recipe_states(recipe) for name, m in (("fc1", fc1), ("fc2", fc2))}
    for fwd, bwd in states.values():
        assert not bwd.amax_history.any() and torch.equal(bwd.scale, torch.ones(2))
        assert fwd.amax_history[-1].any()  # forward slots were rolled at the autocast exit
    y.backward(dy)
    mf.update_delayed_backward_scales()  # backward slots update at the next entry
    for name, grad in (("fc1", h.grad), ("fc2", dy)):
        _, bwd = states[name]
        amax = amax_of(grad)
        expected = torch.zeros(4, 2)
        expected[-1, 0] = amax  # rolled exactly once: the newest value sits at the end
        torch.testing.assert_close(bwd.amax_history, expected, rtol=0, atol=0,
                                   msg=f"{name} backward history")
        assert bwd.scale[0].item() == float(np.float32(E5M2_MAX) / np.float32(amax)), name
        assert bwd.scale[1].item() == 1.0


def test_forward_update_at_the_outermost_autocast_exit():
    recipe = mf.DelayedScaling(amax_history_len=2)
    lin = make_linear(7)
    x, _ = data(8, 5.0, 1.0)
    with mf.autocast(recipe=recipe):
        with mf.autocast(recipe=recipe):
            lin(x)
        fwd_state, _ = lin.recipe_states(recipe)
        assert torch.equal(fwd_state.scale, torch.ones(3)), "updated at an inner exit"
        assert fwd_state.amax_history[0, 0].item() == 5.0
    assert fwd_state.scale[0].item() == float(np.float32(E4M3_MAX) / np.float32(5.0))
    assert fwd_state.amax_history[-1, 0].item() == 5.0 and fwd_state.amax_history[0, 0] == 0


def test_no_update_for_other_recipes_nested_inside():
    recipe = mf.DelayedScaling(amax_history_len=2)
    lin = make_linear(9)
    x, _ = data(10, 3.0, 1.0)
    with mf.autocast(recipe=mf.MXFP8BlockScaling()):
        lin(torch.randn(32, IN_FEATURES))
        with mf.autocast(recipe=recipe):
            lin(x)
    fwd_state, _ = lin.recipe_states(recipe)
    assert fwd_state.scale[0].item() == float(np.float32(E4M3_MAX) / np.float32(3.0))


def test_backward_slots_update_when_the_first_module_is_frozen():
    recipe = mf.DelayedScaling(amax_history_len=4)
    torch.manual_seed(11)
    fc1 = mf.Linear(IN_FEATURES, 64, name="frozen")
    fc2 = mf.Linear(64, OUT_FEATURES, name="trained")
    fc1.requires_grad_(False)
    x, dy = data(12, 2.0, 1e-2)  # x needs no grad
    with mf.autocast(recipe=recipe):
        y = fc2(fc1(x))
    y.backward(dy)
    mf.update_delayed_backward_scales()  # backward slots update at the next entry
    assert fc2.weight.grad is not None
    _, bwd = fc2.recipe_states(recipe)
    amax = amax_of(dy)
    assert bwd.scale[0].item() == float(np.float32(E5M2_MAX) / np.float32(amax))
    assert bwd.amax_history[-1, 0].item() == amax and bwd.amax_history[0, 0].item() == 0.0
