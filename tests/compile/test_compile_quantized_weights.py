"""torch.compile(fullgraph=True) of modules whose weights are QuantizedTensor parameters
(quantized_model_init): dynamo and AOTAutograd take the weights as their buffers, and the GEMM
ops' twins run on those buffers (modules/quantized_weight_ops.py).

With the aot_eager backend the compiled step runs the same ops as the eager one, so outputs,
input gradients and weight gradients must be equal bit for bit, over two optimizer steps (the
compiled graph must read the bytes the optimizer rewrote, not bytes captured at compile time).
Blocks compiled one by one must share one graph: the weights' quantizers (one object per
layer) stay out of the guards.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn

import minifloat as mf
from recipe_factories import FORMAT_RECIPES
from train_steps import optimizer_step

RECIPES = FORMAT_RECIPES
HIDDEN, FFN, ROWS = 128, 256, 128

pytestmark = pytest.mark.filterwarnings("error:Accessing the data pointer of FakeTensor")


class Block(nn.Module):
    """Every module kind with quantized weights: a LayerNormLinear, a Linear, a LayerNormMLP,
    two experts."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = mf.LayerNormLinear(HIDDEN, HIDDEN, normalization="RMSNorm", name="qkv")
        self.proj = mf.Linear(HIDDEN, HIDDEN, name="proj")
        self.mlp = mf.LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm", name="mlp")
        self.experts = mf.GroupedLinear(2, HIDDEN, HIDDEN, bias=False, name="experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mlp(self.proj(self.qkv(x)))
        return self.experts(x, [ROWS // 2, ROWS // 2])


def _build(recipe: mf.Recipe, blocks: int = 1) -> nn.Module:
    torch.manual_seed(0)
    with mf.quantized_model_init(recipe=recipe):
        return nn.Sequential(*(Block() for _ in range(blocks)))


@pytest.mark.parametrize("name", list(RECIPES))
def test_quantized_weights_compile_without_breaks_and_train_like_eager(name):
    recipe = RECIPES[name]()
    eager, model = _build(recipe), _build(recipe)
    assert isinstance(model[0].proj.weight, mf.QuantizedTensor)
    torch._dynamo.reset()
    x0 = torch.randn(ROWS, HIDDEN)
    with mf.autocast(recipe=recipe):
        explanation = torch._dynamo.explain(_build(recipe))(x0.requires_grad_(True))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, model)]
    for step in range(3):
        x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(step))
        want = optimizer_step(eager, optimizers[0], recipe, x)
        got = optimizer_step(compiled, optimizers[1], recipe, x)
        assert len(got) == len(want) > 3
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a.dtype == b.dtype and torch.equal(a, b), (name, step, index)
    # the optimizer rewrote the quantized bytes: the models moved, and moved alike
    first, later = _build(recipe)[0].proj.weight, model[0].proj.weight
    assert not torch.equal(first.dequantize(), later.dequantize())
    assert torch.equal(eager[0].proj.weight.dequantize(), later.dequantize())


def test_blocks_with_quantized_weights_compiled_one_by_one_share_one_graph():
    recipe = RECIPES["current"]()
    model = _build(recipe, blocks=4)
    torch._dynamo.reset()
    for block in model:
        block.compile(backend="aot_eager", fullgraph=True)
    torch._dynamo.utils.counters.clear()
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    with mf.autocast(recipe=recipe):
        model(x).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert torch.isfinite(x.grad).all()


def test_hybrid_quantized_weights_say_they_do_not_compile():
    recipe = mf.HybridRecipe(fprop=mf.Float8CurrentScaling(), dgrad=mf.MXFP8BlockScaling(),
                             wgrad=mf.Float8CurrentScaling())
    torch.manual_seed(0)
    with mf.quantized_model_init(recipe=recipe):
        layer = mf.Linear(HIDDEN, HIDDEN, name="hybrid")
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with (pytest.raises(Exception, match="do not run under torch.compile yet"),
          mf.autocast(recipe=recipe)):
        compiled(torch.randn(ROWS, HIDDEN))
