"""save_original_input (and, with it, rebuild_weight_copy_in_backward) in eager mode: backward
quantizes the kept high-precision input again instead of reading a copy kept from forward.

The rebuilt copy must be the one forward would have kept, so every step equals the default
path bit for bit, under every recipe: delayed scaling (whose scale changes between forward and
backward: the rebuild uses forward's and records no amax), hybrids whose wgrad format differs,
grouped GEMMs with an empty split (tests/modules/test_rebuild_weight_copy.py), and the lean
per-tensor path. What is kept must be the input
itself and no input-sized quantized copy. The compiled path has its own tests
(tests/compile/test_compile_memory.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.modules import lean_fp8
from minifloat.modules.input_recast import per_tensor_copy
from minifloat.modules.lean_fp8 import LeanFP8Gemm

from .test_rebuild_weight_copy import NVFP4, build, recipe_state_tensors, train_alike
from .test_rebuild_weight_copy import RECIPES as REBUILD_RECIPES

# the wgrad copy of the input takes delayed scaling: kept from forward (its cast records)
RECIPES = {**REBUILD_RECIPES, "hybrid-delayed-wgrad": mf.HybridRecipe(
    fprop=mf.MXFP8BlockScaling(), dgrad=NVFP4, wgrad=mf.DelayedScaling())}


@pytest.mark.parametrize("kind", list(RECIPES))
def test_original_inputs_train_like_kept_copies_bitwise(kind):
    recipe = RECIPES[kind]
    kept = build()
    original = mf.save_original_inputs(copy.deepcopy(kept))
    lowest = mf.rebuild_weight_copies_in_backward(mf.save_original_inputs(copy.deepcopy(kept)))
    train_alike([kept, original, lowest], recipe)
    for other in (original, lowest):
        for a, b in zip(recipe_state_tensors(kept, recipe), recipe_state_tensors(other, recipe),
                        strict=True):
            assert torch.equal(a, b), f"{kind}: recipe state"


def _saved_by_gemm(layer: nn.Module, x: torch.Tensor, recipe: mf.Recipe) -> list[torch.Tensor]:
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t,
                                                  lambda t: t), mf.autocast(recipe=recipe):
        layer(x)
    return packed


@pytest.mark.parametrize("kind", ["current", "mxfp8", "nvfp4"])
def test_the_input_itself_is_kept_and_no_input_sized_copy(kind):
    recipe = RECIPES[kind]
    layer = mf.Linear(256, 128)
    x = torch.randn(64, 256, requires_grad=True)
    default = _saved_by_gemm(layer, x, recipe)
    assert not any(t is x for t in default)
    assert any(t.element_size() == 1 and t.numel() >= x.numel() // 2 for t in default)
    layer.save_original_input = True
    saved = _saved_by_gemm(layer, x, recipe)
    assert any(t is x for t in saved)
    assert [t for t in saved if t is not x and t.element_size() == 1] == []


@pytest.mark.parametrize("kind", ["current", "delayed"])
def test_lean_path_keeps_the_input_and_casts_it_again_bitwise(monkeypatch, kind):
    """The lean per-tensor path (widened to the CPU, as tests/modules/test_lean_fp8.py does):
    it serves the calls, keeps the input, and trains like the lean path keeping its copy."""
    monkeypatch.setattr(lean_fp8, "DEVICES", ("cuda", "cpu"))
    served = []
    forward = LeanFP8Gemm.forward

    def counting(ctx, *args):
        served.append(args[7])  # save_original (x, weight, bias, plan, dgrad, wgrad, rebuild, it)
        return forward(ctx, *args)

    monkeypatch.setattr(LeanFP8Gemm, "forward", staticmethod(counting))
    torch.manual_seed(0)
    kept = nn.Sequential(mf.Linear(128, 96), nn.GELU(), mf.Linear(96, 128))
    original = mf.rebuild_weight_copies_in_backward(mf.save_original_inputs(copy.deepcopy(kept)))
    train_alike([kept, original], RECIPES[kind])
    assert served.count(True) == served.count(False) == 6  # 2 layers x 3 steps each
    for a, b in zip(recipe_state_tensors(kept, RECIPES[kind]),
                    recipe_state_tensors(original, RECIPES[kind]), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("options", [{}, {"amax_epsilon": 1e-3}, {"power_2_scale": True}])
def test_traceable_per_tensor_copy_equals_the_quantizer(fp8_dtype, options):
    """input_recast.per_tensor_copy (the cast the compiled backward makes) against the
    quantizer's own copy, on values that exercise rounding ties, subnormals, saturation,
    infinities and NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g) * torch.logspace(-12, 4, 48)
    x[0, :6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -3e-41])
    x[1, :4] = torch.tensor([448.0, -57344.0, 1.0 + 2 ** -4, 1.0 + 3 * 2 ** -4])
    for case in (x, x.masked_fill(torch.isinf(x), 7.0), torch.zeros(64, 48),
                 x.masked_fill(torch.isinf(x), float("nan")), torch.zeros(0, 48)):
        quantizer = mf.Float8CurrentScalingQuantizer(fp8_dtype, rowwise=False, columnwise=True,
                                                     internal=True, **options)
        want = quantizer(case.bfloat16())
        got = per_tensor_copy(case.bfloat16(), quantizer)
        assert torch.equal(got.data_transpose.view(torch.uint8),
                           want.data_transpose.view(torch.uint8))
        assert torch.equal(got.scale_inv.view(torch.int32), want.scale_inv.view(torch.int32))


@pytest.mark.parametrize("kind", ["current", "delayed", "mxfp8"])
def test_original_inputs_under_activation_recompute_bitwise(kind):
    """minifloat.checkpoint recomputes forward in backward (replaying delayed scaling's scales):
    with original inputs kept, the recomputed forward keeps them and the results equal a run
    without recompute keeping copies."""
    recipe = RECIPES[kind]
    kept = build()
    recomputed = mf.save_original_inputs(copy.deepcopy(kept))
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, dy = torch.randn(64, 128, generator=g), torch.randn(64, 128, generator=g)
        results = []
        for model, recompute in ((kept, False), (recomputed, True)):
            xi = x.clone().requires_grad_(True)
            with mf.autocast(recipe=recipe):
                y = mf.checkpoint(model, xi) if recompute else model(xi)
            y.backward(dy)
            mf.update_delayed_backward_scales()
            results.append([y.detach(), xi.grad] + [p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        for index, (a, b) in enumerate(zip(*results, strict=True)):
            assert torch.equal(a, b), f"{kind} step {step} result {index}"
