"""convert_model: swaps nn.Linear for minifloat.Linear in place, keeping the Parameter objects;
filter_fn; layers a recipe cannot hold stay nn.Linear with one warning; then the README-style
flow: convert an nn.Sequential and train it on CPU under autocast with every recipe."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import minifloat as mf

from ._reference import assert_bitwise_equal, linear_reference

ALL_RECIPES = {
    "delayed": mf.DelayedScaling(),
    "current": mf.Float8CurrentScaling(),
    "block": mf.Float8BlockScaling(),
    "mxfp8": mf.MXFP8BlockScaling(),
    "nvfp4": mf.NVFP4BlockScaling(),
    "custom": mf.CustomRecipe(mf.factories.nvfp4_like),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.proj = nn.Linear(64, 32, bias=False)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(self.proj(torch.relu(self.fc(x))))


def model_with_nesting():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), Block(), nn.Linear(32, 32))


def convert_quietly(model, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = mf.convert_model(model, **kwargs)
    return out, caught


def test_convert_swaps_in_place_and_keeps_parameters():
    model = model_with_nesting()
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    params = {name: (m.weight, m.bias) for name, m in linears.items()}
    values = {name: (m.weight.detach().clone(), m.bias) for name, m in linears.items()}
    x = torch.randn(64, 32)
    expected = model(x)
    out, caught = convert_quietly(model, recipe=mf.MXFP8BlockScaling())
    assert out is model
    assert not caught
    converted = dict(model.named_modules())
    for name, (weight, bias) in params.items():
        module = converted[name]
        assert isinstance(module, mf.Linear), name
        assert module.weight is weight and module.bias is bias, name
        assert_bitwise_equal(module.weight.detach(), values[name][0], name)
        assert module.name == name
        assert (module.in_features, module.out_features) == tuple(weight.shape[::-1])
    assert isinstance(converted["2.norm"], nn.LayerNorm)
    assert converted["2.proj"].bias is None
    # same parameters, so the optimizer built before conversion still drives the model
    assert {id(p) for p in model.parameters()} == {
        id(p) for pair in params.values() for p in pair if p is not None} | {
        id(converted["2.norm"].weight), id(converted["2.norm"].bias)}
    # outside autocast the converted model computes exactly what it did before
    assert_bitwise_equal(model(x), expected, "outputs outside autocast")


def test_filter_fn_is_honoured():
    model = model_with_nesting()
    seen = []

    def only_block(name, module):
        seen.append((name, type(module)))
        return name.startswith("2.")

    mf.convert_model(model, recipe=mf.Float8CurrentScaling(), filter_fn=only_block)
    modules = dict(model.named_modules())
    assert type(modules["0"]) is nn.Linear and type(modules["3"]) is nn.Linear
    assert isinstance(modules["2.fc"], mf.Linear) and isinstance(modules["2.proj"], mf.Linear)
    assert sorted(seen) == sorted([("0", nn.Linear), ("2.fc", nn.Linear),
                                   ("2.proj", nn.Linear), ("3", nn.Linear)])


def test_layers_the_recipe_cannot_hold_stay_with_one_warning():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 64), nn.ReLU(),
                          nn.Linear(64, 64))
    out, caught = convert_quietly(model, recipe=mf.MXFP8BlockScaling())
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    # each skipped layer by name with its weight shape, and nothing about the layer that fits
    assert "0 (Linear)" in message and "[100, 64]" in message, message
    assert "2 (Linear)" in message and "[64, 100]" in message, message
    assert "4 (Linear)" not in message and "[64, 64]" not in message, message
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear
    assert isinstance(model[4], mf.Linear)
    # 100 features fit per-tensor FP8: nothing skipped, no warning
    model = nn.Sequential(nn.Linear(64, 100), nn.Linear(100, 64))
    _, caught = convert_quietly(model, recipe=mf.Float8CurrentScaling())
    assert not caught and all(isinstance(m, mf.Linear) for m in model)
    # NVFP4 needs 16: 40 features stay
    model = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 64), nn.Linear(64, 48))
    _, caught = convert_quietly(model, recipe=mf.NVFP4BlockScaling())
    assert len(caught) == 1
    assert [type(m) for m in model] == [nn.Linear, nn.Linear, mf.Linear]


def test_converted_layer_is_bit_exact():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(96, 64))
    mf.convert_model(model, recipe=mf.MXFP8BlockScaling())
    layer = model[0]
    x = torch.randn(64, 96, requires_grad=True)
    dy = torch.randn(64, 64)
    with mf.autocast(recipe=mf.MXFP8BlockScaling()):
        y = model(x)
    y.backward(dy)
    ref_y, ref_dx, ref_dw, ref_db = linear_reference("mxfp8", x.detach(), layer.weight.detach(),
                                                     layer.bias.detach(), dy)
    assert_bitwise_equal(y.detach(), ref_y, "y")
    assert_bitwise_equal(x.grad, ref_dx, "dx")
    assert_bitwise_equal(layer.weight.grad, ref_dw, "dw")
    assert_bitwise_equal(layer.bias.grad, ref_db, "db")


@pytest.mark.parametrize("kind", list(ALL_RECIPES))
def test_readme_flow_convert_and_train(kind):
    recipe = ALL_RECIPES[kind]
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # built before conversion
    _, caught = convert_quietly(model, recipe=recipe)
    assert not caught
    assert all(isinstance(model[i], mf.Linear) for i in (0, 2, 4))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 32, generator=g)
    target = torch.sin(x @ torch.randn(32, 32, generator=g) * 0.3)
    losses = []
    for _ in range(25):
        optimizer.zero_grad()
        with mf.autocast(recipe=recipe):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses


class Experts(nn.Module):
    """A mixture of experts' fused expert weights (3-D, run with grouped matmuls), as
    transformers implements them: no nn.Linear inside."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 128, 64))

    def forward(self, x):
        return x


def test_the_report_names_every_layer_and_its_fate(caplog):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 40), Experts(), nn.Linear(64, 64))
    with caplog.at_level("INFO", logger="minifloat"), pytest.warns(UserWarning) as caught:
        mf.convert_model(model, recipe=mf.NVFP4BlockScaling(),
                         filter_fn=lambda name, _: name != "3")
    report = model.minifloat_conversion
    assert [name for name, _, _ in report.converted] == ["0"]
    skipped = {name: reason for name, _, reason in report.skipped}
    assert skipped["1"].startswith("the recipe's formats cannot hold")
    assert skipped["2"].startswith("unknown module type")
    assert skipped["3"] == "refused by filter_fn"
    assert "1 layers converted, 3 skipped" in caplog.text
    message = str(caught[0].message)  # what stays in high precision unasked, not the filter's
    assert "1 (Linear)" in message and "2 (Experts)" in message and "3 (" not in message


def test_strict_turns_a_skip_into_an_error_and_nothing_converted_warns():
    with pytest.raises(ValueError, match=r"strict=True.*2 \(Experts\): unknown module type"):
        mf.convert_model(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), Experts()),
                         recipe=mf.Float8CurrentScaling(), strict=True)
    with pytest.warns(UserWarning, match="converted no layer"):
        mf.convert_model(nn.Sequential(nn.ReLU(), nn.LayerNorm(8)))
    model = nn.Sequential(nn.Linear(64, 64))
    mf.convert_model(model, recipe=mf.Float8CurrentScaling(), strict=True)  # nothing skipped
    assert isinstance(model[0], mf.Linear)
