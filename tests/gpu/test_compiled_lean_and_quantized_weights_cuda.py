"""On CUDA: quantized weights under torch.compile, and the lean path inside the compiled ops.

- quantized_model_init weights, every format, compiled with inductor (fullgraph): the graph takes
  the weights' buffers (quantized_weight_ops.py); outputs and all gradients equal eager ones bit
  for bit over two optimizer steps (a stack of minifloat Linears: inductor adds no arithmetic);
- FP8 current scaling compiled runs the lean ops (lean_ops.py): their results equal the eager
  *general* path (LinearGemms, lean path off) bit for bit, with plain and FP8 weights, with and
  without the weight copy kept for backward;
- with MINIFLOAT_GRAPH_CASTS (graph_casts.py) inductor generates the casts itself: the results
  equal the eager lean path's (the Triton kernels) bit for bit, with and without the memory
  options, and under CUDA graphs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.modules import graph_casts, lean_fp8
from recipe_factories import FORMAT_RECIPES
from train_steps import optimizer_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

RECIPES = FORMAT_RECIPES


def _stack(recipe: mf.Recipe | None, rebuild: bool = False) -> nn.Module:
    torch.manual_seed(0)
    context = (mf.quantized_model_init(recipe=recipe) if recipe is not None
               else contextlib.nullcontext())
    with context:
        model = nn.Sequential(
            mf.Linear(1024, 2048, name="a", params_dtype=torch.bfloat16, device="cuda"),
            mf.Linear(2048, 1024, name="b", params_dtype=torch.bfloat16, device="cuda",
                      bias=False))
    return mf.rebuild_weight_copies_in_backward(model) if rebuild else model


def _step(model: nn.Module, optimizer, recipe: mf.Recipe, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, generator=generator)
    return optimizer_step(model, optimizer, recipe, x)


def _assert_equal_runs(eager: nn.Module, model: nn.Module, compiled, recipe: mf.Recipe,
                       eager_lean: bool = True) -> None:
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    for step in range(2):
        lean_fp8.ENABLED = eager_lean
        try:
            want = _step(eager, optimizers[0], recipe, step)
        finally:
            lean_fp8.ENABLED = True
        got = _step(compiled, optimizers[1], recipe, step)
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), (step, index, (a.float() - b.float()).abs().max())


@pytest.mark.parametrize("name", list(RECIPES))
def test_quantized_weights_compiled_with_inductor_equal_eager(name):
    recipe = RECIPES[name]()
    eager, model = _stack(recipe), _stack(recipe)
    assert isinstance(model[0].weight, mf.QuantizedTensor)
    torch._dynamo.reset()
    _assert_equal_runs(eager, model, torch.compile(model, fullgraph=True), recipe)


@pytest.mark.parametrize("weights", ["plain", "plain-rebuilt", "fp8"])
def test_lean_ops_equal_the_eager_general_path(weights):
    recipe = mf.Float8CurrentScaling()
    quantized = recipe if weights == "fp8" else None
    rebuild = weights == "plain-rebuilt"
    eager, model = _stack(quantized, rebuild), _stack(quantized, rebuild)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _assert_equal_runs(eager, model, compiled, recipe, eager_lean=False)


@pytest.mark.parametrize("name", ["current", "delayed", "nvfp4"])
def test_quantized_weights_under_cuda_graphs_follow_the_optimizer(name):
    """mode="reduce-overhead": the graphs read the weights' buffers at fixed addresses, so the
    optimizer's in-place requantization (QuantizedTensor's copy_) must be seen by every replay:
    three steps equal the eager ones bit for bit (a stack of minifloat Linears: inductor adds
    no arithmetic)."""
    recipe = RECIPES[name]()
    eager, model = _stack(recipe), _stack(recipe)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    for step in range(3):
        want = _step(eager, optimizers[0], recipe, step)
        torch.compiler.cudagraph_mark_step_begin()
        got = [t.clone() for t in _step(compiled, optimizers[1], recipe, step)]
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), (name, step, index)


@pytest.mark.parametrize("mode", ["default", "low-memory", "reduce-overhead"])
def test_graph_casts_with_inductor_equal_the_kernels(mode, monkeypatch):
    recipe = mf.Float8CurrentScaling()
    low_memory = mode == "low-memory"
    eager, model = _stack(None, low_memory), _stack(None, low_memory)
    if low_memory:
        mf.save_original_inputs(model)
    monkeypatch.setattr(graph_casts, "ENABLED", True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True,
                             mode="reduce-overhead" if mode == "reduce-overhead" else None)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    for step in range(3):
        want = _step(eager, optimizers[0], recipe, step)  # eager: the lean path's kernels
        torch.compiler.cudagraph_mark_step_begin()
        got = [t.clone() for t in _step(compiled, optimizers[1], recipe, step)]
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), (mode, step, index, (a.float() - b.float()).abs().max())
