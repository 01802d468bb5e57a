"""Checkpoints resume exactly (issue 20, items 1-2): recipe state travels in each module's
`_extra_state` (modules/extra_state.py), so training N steps, saving, loading into a fresh
model and optimizer and training M more equals N + M uninterrupted steps, bit for bit."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.modules.extra_state import decode

RECIPES = {
    "delayed": lambda: mf.DelayedScaling(amax_history_len=4),
    "current": lambda: mf.Float8CurrentScaling(),
    # stochastic rounding (gradients) and RHT (wgrad copies): SR draws from torch's generator,
    # whose state the checkpoint carries as any training checkpoint does
    "nvfp4": lambda: mf.NVFP4BlockScaling(),
    "block": lambda: mf.Float8BlockScaling(),
    "mxfp8": lambda: mf.MXFP8BlockScaling(),
    "hybrid-delayed": lambda: mf.HybridRecipe(fprop=mf.DelayedScaling(amax_history_len=3),
                                              dgrad=mf.MXFP8BlockScaling(),
                                              wgrad=mf.MXFP8BlockScaling()),
}


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(mf.LayerNormMLP(64, 128, normalization="RMSNorm", name="mlp"),
                         mf.Linear(64, 64, name="proj"))


def batch(step: int) -> torch.Tensor:
    return torch.randn(32, 64, generator=torch.Generator().manual_seed(100 + step)) * 3


def train(model: nn.Module, optimizer, recipe, steps: range, recompute: bool = False
          ) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        with mf.autocast(recipe=recipe):
            x = batch(step)  # with recompute, the MLP's activations are recomputed in backward
            y = model[1](mf.checkpoint(model[0], x)) if recompute else model(x)
            loss = y.float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def roundtrip(obj) -> object:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # tensors, lists, dicts, strings only


@pytest.mark.parametrize("name", [*RECIPES, "delayed+recompute"])
def test_save_load_resume_equals_uninterrupted_bitwise(name):
    recompute = name.endswith("+recompute")
    recipe = RECIPES[name.removesuffix("+recompute")]()
    whole = build(0)
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    want = train(whole, whole_optimizer, recipe, range(6), recompute)

    first = build(0)
    first_optimizer = torch.optim.AdamW(first.parameters(), lr=1e-2)
    got = train(first, first_optimizer, recipe, range(3), recompute)
    mf.update_delayed_backward_scales()  # fold the last backward's amaxes in before saving
    saved = roundtrip({"model": first.state_dict(), "optimizer": first_optimizer.state_dict(),
                       "rng": torch.get_rng_state()})
    torch.manual_seed(999)  # a fresh process's generator: the checkpoint must restore it
    resumed = build(1)  # other initial weights: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    got += train(resumed, optimizer, recipe, range(3, 6), recompute)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{name} step {step}"
    for (key, a), b in zip(resumed.state_dict().items(), whole.state_dict().values(),
                           strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), key


def test_delayed_state_is_what_the_checkpoint_carries():
    """Without the extra state the resumed outputs differ (the histories start afresh): the
    test above would fail if the state were not saved."""
    recipe = RECIPES["delayed"]()
    model = build(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    train(model, optimizer, recipe, range(4))
    mf.update_delayed_backward_scales()
    state = model.state_dict()
    assert decode(state["0._extra_state"])["recipes"][0]["forward"][1].abs().sum() > 0
    with_state, without = build(1), build(1)
    with_state.load_state_dict(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        without.load_state_dict({k: v for k, v in state.items() if "_extra_state" not in k})
    assert any("start afresh" in str(w.message) for w in caught)
    x = batch(99)
    with mf.autocast(recipe=recipe):
        reference, restored, fresh = model(x), with_state(x), without(x)
    assert torch.equal(restored, reference) and not torch.equal(fresh, reference)


def test_another_recipe_or_history_length_is_a_clear_error():
    model = build(0)
    train(model, torch.optim.SGD(model.parameters(), lr=1e-2), RECIPES["delayed"](), range(2))
    state = model.state_dict()
    for other in (mf.DelayedScaling(amax_history_len=8), mf.DelayedScaling(margin=1)):
        fresh = build(0)
        fresh.load_state_dict(state)
        with pytest.raises(ValueError, match="saved under DelayedScaling"), \
                mf.autocast(recipe=other):
            fresh(batch(0))
    fresh = build(0)
    fresh.load_state_dict(state)
    for module in fresh:
        module.drop_loaded_recipe_state()  # the documented way to start afresh
    with mf.autocast(recipe=mf.DelayedScaling(amax_history_len=8)):
        fresh(batch(0))
    with pytest.raises(ValueError, match="not minifloat recipe state"):
        build(0).load_state_dict({**state, "1._extra_state": b"bytes"})
    with pytest.raises(ValueError, match="not minifloat recipe state"):
        build(0).load_state_dict({**state, "1._extra_state": [1, 2]})


def test_a_save_right_after_loading_keeps_the_unused_state():
    model = build(0)
    train(model, torch.optim.SGD(model.parameters(), lr=1e-2), RECIPES["delayed"](), range(2))
    state = model.state_dict()
    again = build(1)
    again.load_state_dict(state)
    resaved = again.state_dict()  # before any forward: the loaded state is still pending
    for key in ("0._extra_state", "1._extra_state"):
        for a, b in zip(decode(state[key])["recipes"][0]["forward"],
                        decode(resaved[key])["recipes"][0]["forward"], strict=True):
            assert torch.equal(a, b)


# weights stored quantized take every single-format recipe (hybrids have their own tests)
QUANTIZED_WEIGHT_RECIPES = {k: v for k, v in RECIPES.items() if not k.startswith("hybrid")}


@pytest.mark.parametrize("name", QUANTIZED_WEIGHT_RECIPES)
def test_quantized_model_init_weights_resume_exactly(name):
    """Weights stored quantized only (quantized_model_init): the checkpoint holds their bytes
    and scales (a QuantizedTensor, read with weights_only), AdamW's state and the recipe state;
    3 + 3 steps equal 6, bitwise."""
    recipe = QUANTIZED_WEIGHT_RECIPES[name]()

    def build_quantized(seed: int) -> nn.Module:
        with mf.quantized_model_init(recipe=recipe):
            return build(seed)

    whole = build_quantized(0)
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    want = train(whole, whole_optimizer, recipe, range(6))
    first = build_quantized(0)
    first_optimizer = torch.optim.AdamW(first.parameters(), lr=1e-2)
    got = train(first, first_optimizer, recipe, range(3))
    mf.update_delayed_backward_scales()
    saved = roundtrip({"model": first.state_dict(), "optimizer": first_optimizer.state_dict(),
                       "rng": torch.get_rng_state()})
    assert isinstance(saved["model"]["1.weight"], mf.QuantizedTensor)  # bytes, not values
    torch.manual_seed(999)
    resumed = build_quantized(1)
    resumed.load_state_dict(saved["model"])
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    got += train(resumed, optimizer, recipe, range(3, 6))
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{name} step {step}"
    assert torch.equal(resumed[1].weight.dequantize(), whole[1].weight.dequantize())
