"""Seed 002 in the fusible ops: a no-grad evaluation step between training steps must not strip
a usage a weight needs later. BasicLinear and the GroupedLinear op configure their weight
quantizer completely for each forward (rowwise always, columnwise when dgrad will run), then
OR-merge those usages into the quantizer recorded on a quantized weight and never drop a copy.

train step, eval step (no_grad), optimizer step, train step equals bit for bit the run without
the eval step. Without the preservation in modules/weights.py the eval step drops the
quantized weight's columnwise copy, the optimizer step requantizes rowwise only, and the
second training step fails: MXFP8 and hybrid (MXFP8/NVFP4) weights cannot derive it back."""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from minifloat import ops
from training._reference import assert_bitwise_equal

NVFP4 = mf.NVFP4BlockScaling(disable_stochastic_rounding=True)
RECIPES = {
    "mxfp8": mf.MXFP8BlockScaling(),
    "hybrid": mf.HybridRecipe(fprop=mf.MXFP8BlockScaling(), dgrad=NVFP4, wgrad=NVFP4),
}
IN, HID, OUT, ROWS = 64, 64, 32, 64
SPLITS = [32, 0, 32]


def build(network, recipe, quantized_init):
    torch.manual_seed(3)
    with mf.quantized_model_init(enabled=quantized_init, recipe=recipe):
        if network == "basic":
            return ops.Sequential(ops.BasicLinear(IN, HID, name="fc1"), ops.Bias(HID),
                                  ops.GELU(), ops.BasicLinear(HID, OUT, name="fc2"))
        return ops.Sequential(ops.BasicLinear(IN, HID, name="fc1"), ops.GELU(),
                              ops.GroupedLinear(len(SPLITS), HID, OUT, name="experts"))


def run(seq, network, x):
    return seq(x, m_splits=SPLITS) if network == "grouped" else seq(x)


def gemm_ops(seq):
    return [op for op in seq if isinstance(op, ops.GemmOperation)]


def quantized_weights(seq):
    return [p for op in gemm_ops(seq) for p in op.gemm_weights()
            if isinstance(p, mf.QuantizedTensor)]


def session(network, recipe, quantized_init, with_eval):
    """train, (eval under no_grad), optimizer step, train: each train step's y, dx and
    parameter gradients, and the parameters at the end."""
    seq = build(network, recipe, quantized_init)
    optimizer = torch.optim.SGD(seq.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(7)
    results = []
    for index in range(2):
        x = torch.randn(ROWS, IN, generator=g).requires_grad_(True)
        dy = torch.randn(ROWS, OUT, generator=g)
        with mf.autocast(recipe=recipe):
            y = run(seq, network, x)
        y.backward(dy)
        results.append((y.detach(), x.grad, [p.grad.clone() for p in seq.parameters()]))
        if index == 0:
            if with_eval:
                x_eval = torch.randn(ROWS, IN, generator=torch.Generator().manual_seed(9))
                with torch.no_grad(), mf.autocast(recipe=recipe):
                    run(seq, network, x_eval)
                check_usages_after_eval(seq, recipe)
            optimizer.step()
            optimizer.zero_grad()
    params = [p.dequantize() if isinstance(p, mf.QuantizedTensor) else p.detach()
              for p in seq.parameters()]
    return results, params


def check_usages_after_eval(seq, recipe):
    for weight in quantized_weights(seq):
        storage = weight.quantized_storage
        assert storage.has_rowwise() and storage.has_columnwise(), "eval dropped a copy"
        recorded = storage.quantizer
        assert recorded.rowwise_usage and recorded.columnwise_usage, "usage removed"
    for op in gemm_ops(seq):
        # step one of the rule: the op's own quantizer is configured for that no-grad forward
        weight_quantizer = op.quantizers(recipe)[0][1]
        assert weight_quantizer.rowwise_usage and not weight_quantizer.columnwise_usage


@pytest.mark.parametrize("quantized_init", [True, False], ids=["quantized-init", "hp-weights"])
@pytest.mark.parametrize("kind", list(RECIPES))
@pytest.mark.parametrize("network", ["basic", "grouped"])
def test_eval_step_between_training_steps_changes_nothing(network, kind, quantized_init):
    recipe = RECIPES[kind]
    plain, plain_params = session(network, recipe, quantized_init, with_eval=False)
    evaluated, evaluated_params = session(network, recipe, quantized_init, with_eval=True)
    if quantized_init:
        assert quantized_weights(build(network, recipe, quantized_init))
    for index, ((y_a, dx_a, grads_a), (y_b, dx_b, grads_b)) in enumerate(
            zip(plain, evaluated, strict=True)):
        assert_bitwise_equal(y_b, y_a, f"step {index}: y")
        assert_bitwise_equal(dx_b, dx_a, f"step {index}: dx")
        for number, (a, b) in enumerate(zip(grads_a, grads_b, strict=True)):
            assert_bitwise_equal(b, a, f"step {index}: grad of parameter {number}")
    for a, b in zip(plain_params, evaluated_params, strict=True):
        assert_bitwise_equal(b, a, "parameters at the end")


@pytest.mark.parametrize("kind", list(RECIPES))
def test_eval_before_any_training_keeps_both_copies(kind):
    recipe = RECIPES[kind]
    seq = build("grouped", recipe, quantized_init=True)
    with torch.no_grad(), mf.autocast(recipe=recipe):
        run(seq, "grouped", torch.randn(ROWS, IN))
    check_usages_after_eval(seq, recipe)
    x = torch.randn(ROWS, IN, requires_grad=True)
    with mf.autocast(recipe=recipe):
        y = run(seq, "grouped", x)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
