"""Seed 002 on quantized weights: a no-grad evaluation step between training steps must not
strip a usage the weight needs later. The second training step equals, bit for bit, a run
without the evaluation step; without usage preservation it fails (the eval drops the weight's
columnwise copy, which MXFP8 and hybrid weights cannot derive back)."""

from __future__ import annotations

import pytest
import torch

import minifloat as mf

RECIPES = {
    "mxfp8": mf.MXFP8BlockScaling(),
    "hybrid": mf.HybridRecipe(fprop=mf.Float8CurrentScaling(), dgrad=mf.MXFP8BlockScaling(),
                              wgrad=mf.MXFP8BlockScaling()),
    "current": mf.Float8CurrentScaling(),
}


def build(kind_of_module, recipe):
    torch.manual_seed(3)
    with mf.quantized_model_init(recipe=recipe):
        if kind_of_module == "linear":
            return mf.Linear(64, 32, name="fc")
        return mf.GroupedLinear(2, 64, 32, name="experts")


def call(module, x):
    if isinstance(module, mf.GroupedLinear):
        return module(x, [32, 32])
    return module(x)


def training_run(kind_of_module, recipe, with_eval):
    module = build(kind_of_module, recipe)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(7)
    results = []
    for step in range(2):
        x = torch.randn(64, 64, generator=g).requires_grad_()
        dy = torch.randn(64, 32, generator=g)
        with mf.autocast(recipe=recipe):
            y = call(module, x)
        y.backward(dy)
        results.append((y.detach(), x.grad.clone(),
                        [p.grad.clone() for p in module.parameters()]))
        optimizer.step()
        optimizer.zero_grad()
        if step == 0 and with_eval:
            with torch.no_grad(), mf.autocast(recipe=recipe):
                call(module, torch.randn(64, 64, generator=torch.Generator().manual_seed(9)))
    return results, [p.dequantize() if isinstance(p, mf.QuantizedTensor) else p.detach()
                     for p in module.parameters()]


@pytest.mark.parametrize("kind", list(RECIPES))
@pytest.mark.parametrize("kind_of_module", ["linear", "grouped"])
def test_eval_step_between_training_steps_changes_nothing(kind_of_module, kind):
    recipe = RECIPES[kind]
    plain, plain_params = training_run(kind_of_module, recipe, with_eval=False)
    evaluated, evaluated_params = training_run(kind_of_module, recipe, with_eval=True)
    for (y_a, dx_a, grads_a), (y_b, dx_b, grads_b) in zip(plain, evaluated, strict=True):
        assert torch.equal(y_a, y_b)
        assert torch.equal(dx_a, dx_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain_params, evaluated_params, strict=True))


@pytest.mark.parametrize("kind", ["mxfp8", "hybrid"])
def test_eval_keeps_the_columnwise_copy_and_merges_usages_into_the_weights_quantizer(kind):
    recipe = RECIPES[kind]
    module = build("linear", recipe)
    storage = module.weight.quantized_storage
    assert storage.has_columnwise()
    with torch.no_grad(), mf.autocast(recipe=recipe):
        module(torch.randn(32, 64))
    assert storage.has_rowwise() and storage.has_columnwise()
    recorded = storage.quantizer
    assert recorded.rowwise_usage and recorded.columnwise_usage
    # the module's own quantizer is configured completely for that no-grad forward
    module_quantizer = module.quantizers(recipe)[0][1]
    assert module_quantizer.rowwise_usage and not module_quantizer.columnwise_usage
