"""torch.compile on CUDA: the custom ops run the Triton kernels and scaled matmul.

On the CPU (tests/compile) the traced and the real op take the same reference path. On CUDA the
real op launches kernels while tracing runs the reference path on fake tensors, so these tests
check what only a GPU shows: the buffers the kernels lay out match what the fake pass told the
graph (shapes, dtypes, strides: inductor asserts them), compiled results equal eager ones, and
CUDA graphs (mode="reduce-overhead") keep delayed scaling's state.

- backend "aot_eager" runs the same ops on the same inputs as eager: outputs, gradients and
  delayed-scaling histories must be bitwise equal; so must reduce-overhead on a model that is
  minifloat Linears only (inductor then generates no arithmetic of its own);
- inductor generates the norm and activation code around the ops: a bf16-level tolerance.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import minifloat as mf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

RECIPES = {
    "current": mf.Float8CurrentScaling(),
    "delayed": mf.DelayedScaling(amax_history_len=4),
    "block": mf.Float8BlockScaling(),
    "mxfp8": mf.MXFP8BlockScaling(),
    "nvfp4": mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
}
HIDDEN, FFN, ROWS = 256, 512, 256


class PlainMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


MODULES = {
    "linear": lambda: mf.Linear(HIDDEN, FFN, name="fc"),
    "layernorm_mlp": lambda: mf.LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm", name="mlp"),
    "convert_model": lambda: mf.convert_model(PlainMLP()),
}


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODULES[kind]().to(device="cuda", dtype=torch.bfloat16)


def _data(seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator)


def _step(model, recipe, x, dy):
    x = x.clone().requires_grad_(True)
    with mf.autocast(recipe=recipe):
        y = model(x)
    y.backward(dy)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [y.detach().clone(), x.grad.clone(), *grads]


def _histories(model, recipe):
    mf.update_delayed_backward_scales()
    out = []
    if not isinstance(recipe, mf.DelayedScaling):
        return out
    for module in model.modules():
        if isinstance(module, mf.Linear | mf.LayerNormMLP):
            for state in module.recipe_states(recipe):
                out += [state.amax_history.clone(), state.scale.clone()]
    return out


def _run(kind, recipe, compile_kwargs, steps):
    torch._dynamo.reset()  # each test compiles afresh (the recompile limit counts per process)
    eager, model = _build(kind), _build(kind)
    compiled = torch.compile(model, fullgraph=True, **compile_kwargs)
    with torch.no_grad():
        shape = eager(_data(99)).shape
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16,
                     generator=torch.Generator(device="cuda").manual_seed(99))
    results = []
    for step in range(steps):
        x = _data(step)
        results.append((_step(eager, recipe, x, dy), _step(compiled, recipe, x, dy)))
    return results, eager, model


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", list(MODULES))
def test_aot_eager_bitwise_equal_to_eager(kind, recipe_name):
    recipe = RECIPES[recipe_name]
    results, eager, model = _run(kind, recipe, {"backend": "aot_eager"}, steps=2)
    for step, (want, got) in enumerate(results):
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), f"{kind} {recipe_name} step {step} tensor {index}"
    for a, b in zip(_histories(model, recipe), _histories(eager, recipe), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_inductor_close_to_eager(recipe_name):
    recipe = RECIPES[recipe_name]
    results, _, _ = _run("convert_model", recipe, {}, steps=2)
    for want, got in results:
        for a, b in zip(got, want, strict=True):
            error = ((a.float() - b.float()).norm() / b.float().norm()).item()
            assert error < 3e-2, (recipe_name, error)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_reduce_overhead_keeps_delayed_state(recipe_name):
    """mode="reduce-overhead" (inductor + CUDA graph trees): replays run no Python, so the ops
    must record amaxes into the module's own history (marked static, so the graph writes
    there and not into a copy of the input). Two Linears and nothing else, so inductor writes
    no arithmetic of its own and results must equal eager bit for bit, over more steps than the
    4-row history holds (a lost amax shows once the recorded ones roll out).

    Eager first, to the end, then the compiled model alone: a replay's autocast round updates
    every live state registered for the recipe (it cannot see which ones the graph used).
    The "cudagraphs" dynamo backend is not covered: it copies every input that is not a
    parameter into its own buffer, whatever is marked static, so amaxes would be lost."""
    recipe = RECIPES[recipe_name]
    torch._dynamo.reset()

    def build():
        torch.manual_seed(0)
        return nn.Sequential(mf.Linear(HIDDEN, FFN, name="fc1"),
                             mf.Linear(FFN, HIDDEN, name="fc2")).to("cuda", torch.bfloat16)

    steps = 6
    dy = _data(99)
    eager = build()
    wants = [_step(eager, recipe, _data(step), dy) for step in range(steps)]
    theirs = _histories(eager, recipe)
    del eager
    gc.collect()
    model = build()
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    for step in range(steps):
        got = _step(compiled, recipe, _data(step), dy)
        for index, (a, b) in enumerate(zip(got, wants[step], strict=True)):
            assert torch.equal(a, b), f"{recipe_name} step {step} tensor {index}"
    mine = _histories(model, recipe)
    assert len(mine) == len(theirs)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_reduce_overhead_trains_like_eager():
    recipe = RECIPES["delayed"]
    results, _, _ = _run("convert_model", recipe, {"mode": "reduce-overhead"}, steps=4)
    for want, got in results:
        error = ((got[0].float() - want[0].float()).norm() / want[0].float().norm()).item()
        assert error < 3e-2, error
