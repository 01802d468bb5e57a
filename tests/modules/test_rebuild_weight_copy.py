"""rebuild_weight_copy_in_backward: backward quantizes the weight again instead of keeping a
copy from forward (what FSDP2 needs to keep weights sharded between forward and backward).

The rebuilt copy must be the one forward would have kept, so every step equals the default
path bit for bit, under every recipe, including delayed scaling (whose scale changes between
forward and backward: the rebuild uses forward's) and a hybrid whose dgrad format differs; and
nothing weight-sized may be kept on the autograd graph besides the weight itself.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.distributed import rebuild_weight_copies_in_backward

NVFP4 = mf.NVFP4BlockScaling(disable_stochastic_rounding=True)
RECIPES = {
    "current": mf.Float8CurrentScaling(),
    "delayed": mf.DelayedScaling(amax_history_len=2),
    "block": mf.Float8BlockScaling(),
    "mxfp8": mf.MXFP8BlockScaling(),
    "nvfp4": NVFP4,
    "hybrid": mf.HybridRecipe(fprop=mf.MXFP8BlockScaling(), dgrad=NVFP4, wgrad=NVFP4),
    # a delayed-scaling dgrad copy is recorded by forward's cast: that weight keeps its copy
    "hybrid-delayed-dgrad": mf.HybridRecipe(fprop=mf.MXFP8BlockScaling(),
                                            dgrad=mf.DelayedScaling(), wgrad=NVFP4),
}


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(mf.LayerNormLinear(128, 256, normalization="RMSNorm", name="a"),
                         nn.GELU(), mf.LayerNormMLP(256, 256, normalization="RMSNorm", name="b"),
                         mf.Linear(256, 128, name="c"))


def train_alike(models: list[nn.Module], recipe: mf.Recipe, steps: int = 3) -> None:
    """Train the models on the same batches; every output and gradient equal bit for bit."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(64, 128, generator=g) * (1 + step)
        dy = torch.randn(64, 128, generator=g)
        results = []
        for model, optimizer in zip(models, optimizers, strict=True):
            xi = x.clone().requires_grad_(True)
            with mf.autocast(recipe=recipe):
                y = model(xi)
            y.backward(dy)
            mf.update_delayed_backward_scales()
            results.append([y.detach(), xi.grad] + [p.grad.clone() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for other in results[1:]:
            for index, (a, b) in enumerate(zip(results[0], other, strict=True)):
                assert torch.equal(a, b), f"step {step} result {index}"


def recipe_state_tensors(model: nn.Module, recipe: mf.Recipe) -> list[torch.Tensor]:
    return [t for m in model.modules() if isinstance(m, mf.modules.QuantizedModule)
            for state in m.recipe_states(recipe) for t in state.state_tensors()]


@pytest.mark.parametrize("kind", list(RECIPES))
def test_rebuilt_copies_train_like_kept_copies_bitwise(kind):
    recipe = RECIPES[kind]
    kept = build()
    rebuilt = rebuild_weight_copies_in_backward(copy.deepcopy(kept))
    train_alike([kept, rebuilt], recipe)
    for a, b in zip(recipe_state_tensors(kept, recipe), recipe_state_tensors(rebuilt, recipe),
                    strict=True):
        assert torch.equal(a, b), f"{kind}: delayed-scaling state"


def _gemm_node(output):
    node = output.grad_fn
    while not hasattr(node, "w_tensors"):
        node = node.next_functions[0][0]
    return node


@pytest.mark.parametrize("kind", ["current", "block"])
def test_no_weight_copy_is_kept_between_forward_and_backward(kind):
    layer = mf.Linear(256, 128)
    layer.rebuild_weight_copy_in_backward = True
    x = torch.randn(64, 256, requires_grad=True)
    with mf.autocast(recipe=RECIPES[kind]):
        y = layer(x)
    node = _gemm_node(y)
    assert list(node.w_tensors) == []
    saved = node.saved_tensors
    assert any(t is layer.weight for t in saved)  # the weight itself, as F.linear keeps it
    weight_sized = [t for t in saved if t is not None and t is not layer.weight
                    and t.numel() == layer.weight.numel()]
    assert weight_sized == []
    layer.rebuild_weight_copy_in_backward = False
    with mf.autocast(recipe=RECIPES[kind]):
        assert len(_gemm_node(layer(x)).w_tensors) > 0  # the default keeps one


@pytest.mark.parametrize("option", ["rebuild_weight_copy_in_backward", "save_original_input"])
@pytest.mark.parametrize("kind", ["current", "delayed", "mxfp8", "nvfp4", "hybrid"])
def test_grouped_linear_rebuilds_every_expert_bitwise(kind, option):
    """GroupedLinear keeps (or rebuilds) one weight copy, and one input copy, per expert; an
    empty expert has none. Also the grouped case of tests/modules/test_memory_options.py."""
    recipe = RECIPES[kind]
    torch.manual_seed(0)
    kept = mf.GroupedLinear(3, 128, 64, name="experts")
    rebuilt = copy.deepcopy(kept)
    setattr(rebuilt, option, True)
    splits = [64, 0, 64]
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, dy = torch.randn(128, 128, generator=g), torch.randn(128, 64, generator=g)
        results = []
        for model in (kept, rebuilt):
            xi = x.clone().requires_grad_(True)
            with mf.autocast(recipe=recipe):
                y = model(xi, splits)
            y.backward(dy)
            mf.update_delayed_backward_scales()
            results.append([y.detach(), xi.grad] + [p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b), f"{kind} step {step}"
