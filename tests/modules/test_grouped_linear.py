"""GroupedLinear: per-expert GEMMs over row splits, against per-split independent references."""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
import minifloat.modules.linear_function as linear_function_module
from minifloat.recipes import QuantizerRole
from training._reference import assert_bitwise_equal, linear_reference

RECIPES = {
    "current": mf.Float8CurrentScaling(),
    "block": mf.Float8BlockScaling(),
    "mxfp8": mf.MXFP8BlockScaling(),
    "nvfp4": mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
}
IN_FEATURES, OUT_FEATURES = 64, 32
SPLITS = [64, 0, 32, 96]  # uneven, one expert without tokens; multiples of 32 for MXFP8
NUM_EXPERTS = len(SPLITS)


def make_grouped(seed=0, bias=True, num_gemms=NUM_EXPERTS):
    torch.manual_seed(seed)
    return mf.GroupedLinear(num_gemms, IN_FEATURES, OUT_FEATURES, bias=bias, name="experts")


def make_data(rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, IN_FEATURES, generator=g),
            torch.randn(rows, OUT_FEATURES, generator=g))


def run(module, recipe, x, dy, splits):
    x = x.clone().requires_grad_(True)
    with mf.autocast(recipe=recipe):
        y = module(x, splits)
    y.backward(dy)
    return y.detach(), x.grad


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", list(RECIPES))
def test_each_expert_equals_the_independent_linear_reference(kind, bias):
    module = make_grouped(bias=bias)
    x, dy = make_data(sum(SPLITS))
    y, dx = run(module, RECIPES[kind], x, dy, SPLITS)
    start = 0
    for expert, rows in enumerate(SPLITS):
        weight = getattr(module, f"weight{expert}")
        bias_param = getattr(module, f"bias{expert}")
        stop = start + rows
        if rows == 0:
            assert torch.equal(weight.grad, torch.zeros_like(weight)), "idle expert: dW = 0"
            if bias:
                assert torch.equal(bias_param.grad, torch.zeros_like(bias_param))
            continue
        ref_y, ref_dx, ref_dw, ref_db = linear_reference(
            kind, x[start:stop], weight.detach(), None if bias_param is None else
            bias_param.detach(), dy[start:stop])
        assert_bitwise_equal(y[start:stop], ref_y, f"y of expert {expert}")
        assert_bitwise_equal(dx[start:stop], ref_dx, f"dx of expert {expert}")
        assert_bitwise_equal(weight.grad, ref_dw, f"dW of expert {expert}")
        if bias:
            assert_bitwise_equal(bias_param.grad, ref_db, f"db of expert {expert}")
        start = stop
    assert y.shape == (sum(SPLITS), OUT_FEATURES)


def test_every_split_empty_but_one_and_3d_input():
    module = make_grouped(num_gemms=3)
    x, dy = make_data(64)
    splits = [0, 64, 0]
    y, dx = run(module, RECIPES["current"], x.reshape(4, 16, IN_FEATURES),
                dy.reshape(4, 16, OUT_FEATURES), splits)
    ref_y, ref_dx, ref_dw, _ = linear_reference("current", x, module.weight1.detach(),
                                                module.bias1.detach(), dy)
    assert_bitwise_equal(y.reshape(64, OUT_FEATURES), ref_y, "y")
    assert_bitwise_equal(dx.reshape(64, IN_FEATURES), ref_dx, "dx")
    assert_bitwise_equal(module.weight1.grad, ref_dw, "dW")
    assert torch.equal(module.weight0.grad, torch.zeros_like(module.weight0))


def test_one_quantize_call_over_all_splits_per_direction(monkeypatch):
    calls = []
    original = linear_function_module.split_quantize

    def spy(x, m_splits, quantizers):
        calls.append(list(m_splits))
        return original(x, m_splits, quantizers)

    monkeypatch.setattr(linear_function_module, "split_quantize", spy)
    module = make_grouped()
    x, dy = make_data(sum(SPLITS))
    run(module, RECIPES["mxfp8"], x, dy, SPLITS)
    assert calls == [SPLITS, SPLITS], "one call for the inputs, one for the gradients"


def test_each_expert_has_its_own_quantizer_and_scale():
    module = make_grouped(num_gemms=2)
    x = torch.cat([torch.randn(32, IN_FEATURES) * 1000, torch.randn(32, IN_FEATURES) * 1e-3])
    with mf.autocast(recipe=RECIPES["current"]):
        module(x.requires_grad_(), [32, 32]).sum().backward()
    forward = module.quantizers(RECIPES["current"])[0]
    input_quantizers = [forward[0], forward[3]]
    assert input_quantizers[0] is not input_quantizers[1]
    # each split's own amax decides its scale: the small expert keeps its precision
    x_small = x[32:].detach()
    quantized = mf.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(x_small)
    rel = ((quantized.dequantize() - x_small).norm() / x_small.norm()).item()
    assert rel < 0.05


@pytest.mark.parametrize("bad, message", [
    ([64, 0, 32], "entries"),
    ([64, 0, 32, 90], "sum"),
    ([64, -32, 64, 96], ">= 0"),
])
def test_bad_splits_are_clear_errors(bad, message):
    module = make_grouped()
    x, _ = make_data(sum(SPLITS))
    with pytest.raises(ValueError, match=message), mf.autocast(recipe=RECIPES["current"]):
        module(x, bad)


def test_wrong_feature_size_and_num_gemms_errors():
    module = make_grouped()
    with pytest.raises(ValueError, match="last dim"):
        module(torch.randn(8, IN_FEATURES + 1), [8, 0, 0, 0])
    with pytest.raises(ValueError, match="num_gemms"):
        mf.GroupedLinear(0, 8, 8)


def test_roles_are_grouped_linear_per_expert():
    module = make_grouped(num_gemms=2)
    forward = module.get_quantizer_roles(True)
    backward = module.get_quantizer_roles(False)
    assert len(forward) == 6 and len(backward) == 4
    assert forward[0] == QuantizerRole("grouped_linear", "input", "experts")
    assert forward[1] == QuantizerRole("grouped_linear", "weight", "experts")
    assert forward[2] == QuantizerRole("linear", "input", "experts")  # the consumer's role
    assert backward[0] == QuantizerRole("grouped_linear", "grad_output", "experts")
    seen = []

    def factory(role):
        seen.append(role)
        return mf.IdentityQuantizer()

    module.quantizers(mf.CustomRecipe(factory))
    assert {role.module_type for role in seen} >= {"grouped_linear"}


def test_outside_autocast_is_plain_per_expert_linear():
    module = make_grouped()
    x, _ = make_data(sum(SPLITS))
    y = module(x, SPLITS)
    start = 0
    for expert, rows in enumerate(SPLITS):
        expected = torch.nn.functional.linear(x[start:start + rows],
                                              getattr(module, f"weight{expert}"),
                                              getattr(module, f"bias{expert}"))
        assert torch.equal(y[start:start + rows], expected)
        start += rows


def test_main_grad_accumulates_per_expert():
    module = make_grouped(bias=False)
    for weight in module.weights:
        weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)
    x, dy = make_data(sum(SPLITS))
    for _ in range(2):
        run(module, RECIPES["mxfp8"], x, dy, SPLITS)
    start = 0
    for expert, rows in enumerate(SPLITS):
        weight = module.weights[expert]
        assert weight.grad is None
        if rows:
            ref_dw = linear_reference("mxfp8", x[start:start + rows], weight.detach(), None,
                                      dy[start:start + rows], wgrad_dtype=torch.float32)[2]
            assert torch.equal(weight.main_grad, ref_dw + ref_dw)
        else:
            assert torch.equal(weight.main_grad, torch.zeros_like(weight.main_grad))
        start += rows


def test_quantized_model_init_gives_quantized_expert_weights():
    recipe = mf.HybridRecipe(fprop=mf.MXFP8BlockScaling(), dgrad=mf.Float8CurrentScaling(),
                             wgrad=mf.MXFP8BlockScaling())
    with mf.quantized_model_init(recipe=recipe, keep_high_precision_copy=True):
        module = make_grouped(num_gemms=2)
    for expert in range(2):
        weight = getattr(module, f"weight{expert}")
        assert isinstance(weight, mf.HybridQuantizedTensor)
        hp = getattr(module, f"weight{expert}_hp_init")
        assert (weight.dequantize() - hp).norm() / hp.norm() < 0.05
    x, dy = make_data(64)
    run(module, recipe, x, dy, [32, 32])
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in module.weights)


class TinyMoE(torch.nn.Module):
    """A router (top-1) and GroupedLinear experts: tokens sorted by expert, then unsorted."""

    def __init__(self, experts=4, features=32):
        super().__init__()
        self.router = torch.nn.Linear(features, experts)
        self.experts = mf.GroupedLinear(experts, features, features, name="experts")

    def forward(self, x):
        probs = torch.softmax(self.router(x), dim=-1)
        weight, choice = probs.max(dim=-1)
        order = torch.argsort(choice, stable=True)
        splits = torch.bincount(choice, minlength=self.experts.num_gemms).tolist()
        out_sorted = self.experts(x[order], splits)
        out = torch.empty_like(out_sorted)
        out[order] = out_sorted
        return out * weight[:, None]


@pytest.mark.parametrize("recipe", [mf.Float8CurrentScaling(), mf.DelayedScaling()],
                         ids=["current", "delayed"])
def test_small_moe_trains(recipe):
    torch.manual_seed(0)
    model = TinyMoE()
    target_map = torch.nn.Linear(32, 32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(80):
        x = torch.randn(64, 32)
        with torch.no_grad():
            target = target_map(x)
        with mf.autocast(recipe=recipe):
            loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(loss == loss for loss in losses)
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
