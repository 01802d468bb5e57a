"""The lean FP8 current-scaling path (modules/lean_fp8.py) against the general path.

On the GPU both paths make the same kernel and torch._scaled_mm calls, so outputs and
gradients are equal bit for bit (tests/gpu/test_modules_cuda.py). Here, without a GPU, the lean
path is widened to the CPU (lean_fp8.DEVICES; torch._scaled_mm runs there too) to check what it
decides and keeps: the quantized copies it saves for backward equal the general path's byte for
byte, its results equal the independent reference (training/_reference.py) within the summation
order of a different GEMM, and every case it must not serve goes to the general path.
"""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from minifloat.modules import lean_fp8
from minifloat.modules.lean_fp8 import LeanFP8Gemm, LeanPlan
from training._reference import linear_reference, rel_err

CURRENT = mf.Float8CurrentScaling()


@pytest.fixture
def on_cpu(monkeypatch):
    """Let the lean path serve CPU tensors, and count the calls it serves."""
    monkeypatch.setattr(lean_fp8, "DEVICES", ("cuda", "cpu"))
    calls = []
    original = LeanFP8Gemm.forward

    def counting(ctx, *args):
        calls.append(args[0].shape)
        return original(ctx, *args)

    monkeypatch.setattr(LeanFP8Gemm, "forward", staticmethod(counting))
    return calls


def run(module, x, dy, recipe=CURRENT, **kwargs):
    x = x.clone().requires_grad_(True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t,
                                                  lambda t: t), mf.autocast(recipe=recipe):
        y = module(x, **kwargs)
    y.backward(dy)
    fp8 = [t for t in packed if t.element_size() == 1]
    grads = [None if p.grad is None else p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads, fp8


def data(m=64, k=96, n=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)


@pytest.mark.parametrize("bias", [True, False])
def test_lean_linear_saves_the_general_bytes_and_matches_the_reference(on_cpu, monkeypatch, bias):
    torch.manual_seed(0)
    lin = mf.Linear(96, 48, bias=bias)
    x, dy = data()
    y, dx, grads, saved = run(lin, x, dy)
    assert on_cpu == [x.shape], "the lean path did not serve the call"
    monkeypatch.setattr(lean_fp8, "ENABLED", False)
    y_g, dx_g, grads_g, saved_g = run(lin, x, dy)
    assert len(on_cpu) == 1
    assert len(saved) == len(saved_g) == 1  # the input's columnwise copy only
    assert torch.equal(saved[0].view(torch.uint8), saved_g[0].view(torch.uint8))
    ref_y, ref_dx, ref_dw, ref_db = linear_reference(
        "current", x, lin.weight.detach(), lin.bias.detach() if bias else None, dy)
    for got, general, ref in ((y, y_g, ref_y), (dx, dx_g, ref_dx), (grads[0], grads_g[0], ref_dw)):
        assert rel_err(got, ref) < 1e-5 and rel_err(general, ref) < 1e-5
    if bias:
        assert torch.equal(grads[1], grads_g[1])


def test_layernorm_mlp_gemms_both_take_the_lean_path(on_cpu, monkeypatch):
    torch.manual_seed(0)
    mlp = mf.LayerNormMLP(64, 128, normalization="RMSNorm")
    x, dy = data(32, 64, 64)
    y, dx, grads, _ = run(mlp, x, dy)
    assert len(on_cpu) == 2
    monkeypatch.setattr(lean_fp8, "ENABLED", False)
    y_g, dx_g, grads_g, _ = run(mlp, x, dy)
    assert rel_err(y, y_g) < 1e-5 and rel_err(dx, dx_g) < 1e-5
    for a, b in zip(grads, grads_g, strict=True):
        assert rel_err(a, b) < 1e-5


def test_no_grad_and_frozen_weight(on_cpu):
    torch.manual_seed(0)
    lin = mf.Linear(96, 48)
    x, dy = data()
    with torch.no_grad(), mf.autocast(recipe=CURRENT):
        y = lin(x)
    lin.weight.requires_grad_(False)
    lin.bias.requires_grad_(False)
    xg = x.clone().requires_grad_(True)
    with mf.autocast(recipe=CURRENT):
        out = lin(xg)
    out.backward(dy)
    assert len(on_cpu) == 2 and y.shape == (64, 48) and xg.grad is not None
    assert lin.weight.grad is None


def test_only_the_bias_needs_a_gradient(on_cpu):
    torch.manual_seed(0)
    lin = mf.Linear(96, 48)
    lin.weight.requires_grad_(False)
    x, dy = data()
    with mf.autocast(recipe=CURRENT):
        y = lin(x)  # x needs no gradient, the weight is frozen: dy is quantized for nothing
    y.backward(dy)
    assert len(on_cpu) == 1 and torch.equal(lin.bias.grad, dy.sum(dim=0))


def test_cases_the_lean_path_leaves_to_the_general_path(on_cpu):
    torch.manual_seed(0)
    x, dy = data()
    lin = mf.Linear(96, 48)
    run(lin, x[:40], dy[:40])  # M = 40: not a multiple of 16
    run(lin, x, dy, is_first_microbatch=True)  # keeps weight copies: the general path's job
    run(lin, x, dy, recipe=mf.Float8BlockScaling())
    run(mf.Linear(96, 64), x, torch.randn(64, 64),
        recipe=mf.HybridRecipe(fprop=CURRENT, dgrad=mf.MXFP8BlockScaling(),
                               wgrad=mf.MXFP8BlockScaling()))
    with mf.autocast(recipe=mf.DelayedScaling()):  # recompute replays the scales: general path
        mf.checkpoint(lin, x.clone().requires_grad_(True)).backward(dy)
    lin.weight.main_grad = torch.zeros(48, 96)
    run(lin, x, dy)
    del lin.weight.main_grad
    run(lin, x.t().contiguous().t(), dy)  # a non-contiguous input
    with mf.quantized_model_init(recipe=mf.Float8BlockScaling()):
        quantized = mf.Linear(96, 48)  # quantized, but not per-tensor FP8
    run(quantized, x, dy, recipe=mf.Float8BlockScaling())
    assert on_cpu == []


def test_quantized_fp8_weights_take_the_lean_path(on_cpu, monkeypatch):
    """quantized_model_init FP8 weights: the GEMMs read the weight's own bytes on both paths;
    the saved input copy is the same bytes, and the results agree."""
    x, dy = data()
    with mf.quantized_model_init(recipe=CURRENT):
        torch.manual_seed(0)
        lin = mf.Linear(96, 48)
    y, dx, grads, saved = run(lin, x, dy)
    assert on_cpu == [x.shape]
    monkeypatch.setattr(lean_fp8, "ENABLED", False)
    y_g, dx_g, grads_g, saved_g = run(lin, x, dy)
    assert len(saved) == len(saved_g) == 1
    assert torch.equal(saved[0].view(torch.uint8), saved_g[0].view(torch.uint8))
    for got, general in ((y, y_g), (dx, dx_g), (grads[0], grads_g[0]), (grads[1], grads_g[1])):
        assert rel_err(got, general) < 1e-5


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("rebuild", [True, False])
def test_a_transpose_made_in_backward_is_not_left_on_the_weight(on_cpu, monkeypatch, lean,
                                                                rebuild):
    """A quantized weight holding only its rowwise bytes (what FSDP2's FP8 all-gather brings):
    with rebuild_weight_copy_in_backward (FSDP2's setting) the transpose backward needs is made
    for the call and dropped after it, on the lean and the general path; on the weight it
    stayed until the next gather, every layer's at once at the end of backward (~1 GB of FP8 at
    the 1b preset). Without it, forward derives the copy and leaves it on the weight: the lazy
    rebuild that quantize_master_weights(manual_post_all_gather_processing=False) relies on."""
    monkeypatch.setattr(lean_fp8, "ENABLED", lean)
    x, dy = data()
    with mf.quantized_model_init(recipe=CURRENT):
        torch.manual_seed(0)
        lin = mf.Linear(96, 48)
    lin.rebuild_weight_copy_in_backward = rebuild
    results = run(lin, x, dy)[:3]
    lin.weight.update_usage(columnwise=False)
    again = run(lin, x, dy)[:3]
    assert lin.weight.quantized_storage.has_columnwise() == (not rebuild)
    assert on_cpu == ([x.shape] * 2 if lean else [])
    for a, b in ((results[0], again[0]), (results[1], again[1]),
                 *zip(results[2], again[2], strict=True)):
        assert torch.equal(a, b)


def test_fsdp2_fp8_gathered_weights_take_the_lean_path(on_cpu, monkeypatch, one_rank_group):
    """FSDP2's FP8 all-gather (one rank) hands the module a QuantizedTensor each step, and
    backward reads the re-gathered one: the lean path serves it, with the general path's
    results, and under an offload hook that copies what it saves."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from minifloat.distributed import enable_low_precision_all_gather

    x, dy = data()
    results = {}
    for enabled in (True, False):
        monkeypatch.setattr(lean_fp8, "ENABLED", enabled)
        torch.manual_seed(0)
        model = torch.nn.Sequential(mf.Linear(96, 48))
        enable_low_precision_all_gather(model, CURRENT)
        fully_shard(model, mesh=DeviceMesh("cpu", [0]))
        copy = torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)
        with copy:
            results[enabled] = run(model, x, dy)[:3]
    assert on_cpu == [x.shape]
    (y, dx, grads), (y_g, dx_g, grads_g) = results[True], results[False]
    for got, general in ((y, y_g), (dx, dx_g), *zip(grads, grads_g, strict=True)):
        assert rel_err(got.full_tensor() if hasattr(got, "full_tensor") else got,
                       general.full_tensor() if hasattr(general, "full_tensor") else general
                       ) < 1e-5


def test_plan_refuses_what_the_kernel_call_cannot_express():
    from minifloat.quantizers import Float8CurrentScalingQuantizer, Float8Quantizer

    e4m3 = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    e5m2 = Float8CurrentScalingQuantizer(torch.float8_e5m2)
    assert LeanPlan.for_quantizers(e4m3, e4m3, e5m2) is not None  # HYBRID
    assert LeanPlan.for_quantizers(e5m2, e4m3, e5m2) is None  # wgrad would be E5M2 x E5M2
    assert LeanPlan.for_quantizers(e4m3, e5m2, e5m2) is None  # dgrad would be E5M2 x E5M2
    grouped = e4m3.copy()
    grouped.amax_reduction_group = object()  # a TP layer's reduction: the general path's job
    assert LeanPlan.for_quantizers(grouped, e4m3, e5m2) is None

    class Custom(Float8CurrentScalingQuantizer):
        pass

    assert LeanPlan.for_quantizers(Custom(torch.float8_e4m3fn), e4m3, e5m2) is None
    delayed = Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float8_e4m3fn)
    assert LeanPlan.for_quantizers(delayed, e4m3, e5m2) is not None  # delayed scaling too
    delayed_e5m2 = Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float8_e5m2)
    assert LeanPlan.for_quantizers(delayed_e5m2, e4m3, e5m2) is None


def test_lean_path_is_cuda_only_by_default():
    assert lean_fp8.DEVICES == ("cuda",)
    lin = mf.Linear(96, 48)
    x, dy = data()
    with mf.autocast(recipe=CURRENT):
        y = lin(x.requires_grad_(True))
    assert "LeanFP8Gemm" not in type(y.grad_fn).__name__


def test_delayed_scaling_lean_path_records_the_general_amaxes(on_cpu, monkeypatch):
    """Three steps under delayed scaling, lean and general on equal copies: each step's saved
    bytes are equal, and so are the amax histories and scales the steps leave behind (the
    lean path records into the slots the quantizers record into). One GEMM: on the CPU the two
    paths' GEMMs round differently, so a second GEMM's input (and amax) would differ."""
    import copy

    recipe = mf.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    lean = mf.Linear(96, 48)
    general = copy.deepcopy(lean)
    for step in range(3):
        x, dy = data(seed=step)
        x = x * (1 + step)
        monkeypatch.setattr(lean_fp8, "ENABLED", True)
        y, _, _, saved = run(lean, x, dy, recipe)
        monkeypatch.setattr(lean_fp8, "ENABLED", False)
        y_g, _, _, saved_g = run(general, x, dy, recipe)
        mf.update_delayed_backward_scales()
        assert len(saved) == len(saved_g) == 1
        for a, b in zip(saved, saved_g, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"step {step}"
        assert rel_err(y, y_g) < 1e-5
    assert len(on_cpu) == 3
    for mine, theirs in zip(lean.recipe_states(recipe), general.recipe_states(recipe),
                            strict=True):
        for a, b in zip(mine.state_tensors(), theirs.state_tensors(), strict=True):
            assert torch.equal(a, b)
    assert lean.recipe_states(recipe)[0].amax_history.abs().sum() > 0


@pytest.mark.parametrize("recipe", [CURRENT, mf.DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
def test_lean_path_rebuilds_weight_copies_for_fsdp2(on_cpu, monkeypatch, recipe):
    """rebuild_weight_copy_in_backward on the lean path: no weight copy kept, backward casts
    the weight again (delayed: with forward's scale, recording nothing), and three steps equal
    the lean path keeping its copy bit for bit (states included)."""
    import copy

    torch.manual_seed(0)
    kept = mf.Linear(96, 48)
    rebuilt = copy.deepcopy(kept)
    rebuilt.rebuild_weight_copy_in_backward = True
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (kept, rebuilt)]
    for step in range(3):
        x, dy = data(seed=step)
        results = []
        for model, optimizer in zip((kept, rebuilt), optimizers, strict=True):
            xi = (x * (1 + step)).requires_grad_(True)
            with mf.autocast(recipe=recipe):
                y = model(xi)
            node = y.grad_fn
            while not hasattr(node, "rebuild"):
                node = node.next_functions[0][0]
            assert (node.weight_copy is None) == (model is rebuilt)
            y.backward(dy)
            mf.update_delayed_backward_scales()
            results.append([y.detach(), xi.grad, *(p.grad.clone() for p in model.parameters())])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b), f"step {step}"
    assert len(on_cpu) == 6
    for mine, theirs in zip(rebuilt.recipe_states(recipe), kept.recipe_states(recipe),
                            strict=True):
        for a, b in zip(mine.state_tensors(), theirs.state_tensors(), strict=True):
            assert torch.equal(a, b)
