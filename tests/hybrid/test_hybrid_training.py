"""Hybrid (per-GEMM) quantization through Linear (seed 000): a hybrid of one recipe with itself
equals that recipe bit for bit; the seed's mixed factory trains and matches an independent
numerics reference; HybridRecipe's direction table, None GEMMs and high_precision patterns;
delayed scaling inside a hybrid; quantized_model_init with a HybridRecipe."""

from __future__ import annotations

import dataclasses
import functools
import io
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minifloat as mf
from minifloat.recipe_state import fp8_dtype_for, quantizer_for_role
from training._reference import (
    E4M3,
    E5M2,
    assert_bitwise_equal,
    gemm,
    op_current,
    op_delayed,
    op_mxfp8,
    op_nvfp4,
)

IN, OUT, BATCH = 64, 128, 32
# recipes are frozen values: one instance of each default serves every test
MX, NV4, CUR, BLOCK = (mf.MXFP8BlockScaling(), mf.NVFP4BlockScaling(), mf.Float8CurrentScaling(),
                       mf.Float8BlockScaling())


def hybrid_recipe(fprop, dgrad, wgrad, **kwargs):
    return mf.HybridRecipe(fprop=fprop, dgrad=dgrad, wgrad=wgrad, **kwargs)


def make_linear(seed=0, bias=True, name="fc"):
    torch.manual_seed(seed)
    return mf.Linear(IN, OUT, bias=bias, name=name)


def make_data(seed, lead=(BATCH,)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*lead, IN, generator=g), torch.randn(*lead, OUT, generator=g)


def one_step(lin, recipe, x, dy):
    """(y, dx) of one forward + backward under autocast; dW and db land on the module."""
    xg = x.clone().requires_grad_(True)
    with mf.autocast(recipe=recipe):
        y = lin(xg)
    y.backward(dy)
    mf.update_delayed_backward_scales()  # backward slots update at the next entry
    return y.detach(), xg.grad


def run_steps(recipe, steps=3, bias=True, lead=(BATCH,), lr=0.05):
    """(y, dx, dW, db) of each step of a Linear trained with SGD, torch's generator seeded
    identically for every run (NVFP4 gradients draw stochastic rounding from it)."""
    lin = make_linear(seed=7, bias=bias)
    optimizer = torch.optim.SGD(lin.parameters(), lr=lr)
    torch.manual_seed(1234)
    results = []
    for step in range(steps):
        y, dx = one_step(lin, recipe, *make_data(100 + step, lead))
        db = None if lin.bias is None else lin.bias.grad.clone()
        results.append((y, dx, lin.weight.grad.clone(), db))
        optimizer.step()
        optimizer.zero_grad()
    return lin, results


def assert_same_results(actual, expected):
    for step, (got, want) in enumerate(zip(actual, expected, strict=True)):
        for label, a, e in zip(("y", "dx", "dW", "db"), got, want, strict=True):
            if e is None:
                assert a is None
            else:
                assert_bitwise_equal(a, e, f"step {step} {label}")


# ---------------------------------------------------------------------------------------------
# 1. hybrid(X, X) == X


def same_recipe_hybrid(recipe, role):
    """Module-level factory: both children are what `recipe` gives this role. DelayedScaling
    has no stateless quantizer: its children share a fresh (scale 1) state, as a fresh module's
    first step has."""
    if isinstance(recipe, mf.DelayedScaling):
        dtype = fp8_dtype_for(recipe.fp8_format, role)
        scale, amax = torch.ones(1), torch.zeros(1)
        return mf.HybridQuantizer(mf.Float8Quantizer(scale, amax, dtype),
                                  mf.Float8Quantizer(scale, amax, dtype))
    return mf.HybridQuantizer(quantizer_for_role(recipe, role), quantizer_for_role(recipe, role))


BUILTIN = {
    "delayed": mf.DelayedScaling(amax_history_len=2),  # scales change from step to step
    "current": mf.Float8CurrentScaling(),
    "block": mf.Float8BlockScaling(),
    "mxfp8": mf.MXFP8BlockScaling(),
    "nvfp4": mf.NVFP4BlockScaling(),  # stochastic rounding on gradients
    "nvfp4-no-sr": mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
    "nvfp4-no-rht": mf.NVFP4BlockScaling(disable_rht=True),
    "nvfp4-1d-weights": mf.NVFP4BlockScaling(disable_2d_quantization=True),
}
VARIANTS = {"nobias": (False, (BATCH,)), "bias-3d": (True, (4, 8))}


def assert_same_delayed_states(plain_lin, plain, hybrid_lin, hybrid):
    for plain_state, hybrid_state in zip(plain_lin.recipe_states(plain),
                                         hybrid_lin.recipe_states(hybrid), strict=True):
        (sub,) = hybrid_state.delayed_states()  # one sub-state: the three GEMMs share it
        assert_bitwise_equal(sub.amax_history, plain_state.amax_history, "amax history")
        assert_bitwise_equal(sub.scale, plain_state.scale, "scale")
        assert not torch.all(plain_state.scale == 1)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", list(BUILTIN))
def test_hybrid_of_one_recipe_equals_that_recipe(kind, variant):
    """HybridRecipe(X, X, X) and CustomRecipe(hybrid of X's quantizers) equal X bit for bit over
    SGD steps. NVFP4 with SR too: the hybrid calls its rowwise child and then its columnwise
    child, drawing from torch's generator in the order the plain quantizer does (rowwise copy
    first), so the same seed gives the same rounding."""
    base = BUILTIN[kind]
    bias, lead = VARIANTS[variant]
    steps = 3 if kind == "delayed" else 2
    plain_lin, plain = run_steps(base, steps, bias, lead)
    x0, initial = make_data(100, lead)[0], make_linear(7, bias)
    assert not torch.equal(plain[0][0], F.linear(x0, initial.weight, initial.bias)), "no quant?"
    # an equal but distinct recipe object shares the one sub-state as well
    hybrid = mf.HybridRecipe(fprop=base, dgrad=dataclasses.replace(base), wgrad=base)
    custom = mf.CustomRecipe(functools.partial(same_recipe_hybrid, base))
    # the factory's delayed children keep scale 1: only the first step is comparable
    for recipe, n in ((hybrid, steps), (custom, 1 if kind == "delayed" else steps)):
        hybrid_lin, results = run_steps(recipe, n, bias, lead)
        forward, backward = hybrid_lin.quantizers(recipe)
        assert all(isinstance(q, mf.HybridQuantizer) for q in (*forward[:2], backward[0]))
        assert_same_results(results, plain[:n])
        if kind == "delayed" and recipe is hybrid:
            assert_same_delayed_states(plain_lin, base, hybrid_lin, hybrid)


# ---------------------------------------------------------------------------------------------
# 2. the mixed factory of seed 000


def seed000_factory(role, grad_dtype=E4M3):
    """Weights: FP8 current E4M3 rowwise, MXFP8 columnwise; inputs: FP8 current E4M3, NVFP4;
    gradients: MXFP8, NVFP4 (plain NVFP4: no RHT, no SR)."""
    if role.tensor_type == "weight":
        return mf.HybridQuantizer(mf.Float8CurrentScalingQuantizer(E4M3), mf.MXFP8Quantizer(E4M3))
    if role.tensor_type == "input":
        return mf.HybridQuantizer(mf.Float8CurrentScalingQuantizer(E4M3), mf.NVFP4Quantizer())
    return mf.HybridQuantizer(mf.MXFP8Quantizer(grad_dtype), mf.NVFP4Quantizer())


@pytest.mark.parametrize("case", ["seed000-grad-e4m3", "seed000-grad-e5m2", "hybrid-recipe"])
def test_mixed_formats_match_numerics_reference(case):
    """fprop X W^T: current-scaling E4M3 both; dgrad dY W: MXFP8 dY rowwise x MXFP8 W columnwise
    (blocks along N: W^T quantized along its reduction dim); wgrad dY^T X: NVFP4 of dY^T and X^T,
    both along M. The same formats from a HybridRecipe: its NVFP4 wgrad has RHT on both."""
    grad_dtype, rht = E5M2 if case.endswith("e5m2") else E4M3, case == "hybrid-recipe"
    recipe = mf.CustomRecipe(functools.partial(seed000_factory, grad_dtype=grad_dtype))
    if rht:
        recipe = hybrid_recipe(CUR, MX, mf.NVFP4BlockScaling(disable_stochastic_rounding=True))
    lin = make_linear(seed=11)
    x, dy = make_data(12)
    y, dx = one_step(lin, recipe, x, dy)
    w, b = lin.weight.detach(), lin.bias.detach()
    assert_bitwise_equal(y, gemm(op_current(x, E4M3), op_current(w, E4M3), bias=b), "y")
    assert_bitwise_equal(dx, gemm(op_mxfp8(dy, grad_dtype), op_mxfp8(w.t())), "dx")
    assert_bitwise_equal(lin.weight.grad,
                         gemm(op_nvfp4(dy.t(), rht=rht), op_nvfp4(x.t(), rht=rht)), "dW")
    assert_bitwise_equal(lin.bias.grad, dy.sum(0), "db")


def test_seed000_factory_trains_a_two_layer_mlp():
    recipe = mf.CustomRecipe(seed000_factory)
    torch.manual_seed(21)
    model = torch.nn.Sequential(mf.Linear(IN, OUT, name="fc1"), torch.nn.ReLU(),
                                mf.Linear(OUT, IN, name="fc2"))
    g = torch.Generator().manual_seed(22)
    x = torch.randn(BATCH, IN, generator=g)
    target = torch.tanh(x @ torch.randn(IN, IN, generator=g) / 8) * 2
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        with mf.autocast(recipe=recipe):
            loss = F.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
    assert isinstance(model[0].quantizers(recipe)[1][0], mf.HybridQuantizer)


# ---------------------------------------------------------------------------------------------
# 3. HybridRecipe: the direction table, None GEMMs, high_precision


def describe(q):
    """Class and the configuration that decides the bytes of a child quantizer."""
    name = type(q).__name__
    if isinstance(q, mf.NVFP4Quantizer):
        return (name, q.with_2d_quantization, q.with_rht, q.stochastic_rounding)
    if isinstance(q, mf.Float8BlockQuantizer):
        return (name, q.block_scaling_dim)
    if isinstance(q, mf.IdentityQuantizer):
        return (name,)
    return (name, q.fp8_dtype)


CUR4, CUR5 = ("Float8CurrentScalingQuantizer", E4M3), ("Float8CurrentScalingQuantizer", E5M2)
MX4, DEL4, DEL5 = ("MXFP8Quantizer", E4M3), ("Float8Quantizer", E4M3), ("Float8Quantizer", E5M2)
NV = "NVFP4Quantizer"  # (2D, RHT, SR): weights 2D; inputs RHT; gradients RHT + SR
NV_W2D, NV_X, NV_G = (NV, True, False, False), (NV, False, True, False), (NV, False, True, True)
MAPPINGS = {  # recipe -> {tensor type: (rowwise child, columnwise child)}
    "cur-mx-nv": (hybrid_recipe(CUR, MX, NV4),
                  {"input": (CUR4, NV_X), "weight": (CUR4, MX4), "grad_output": (MX4, NV_G)}),
    "mx-nv-delayed": (hybrid_recipe(MX, NV4, mf.DelayedScaling()),
                      {"input": (MX4, DEL4), "weight": (MX4, NV_W2D),
                       "grad_output": (NV_G, DEL5)}),
    "nv-block-cur": (hybrid_recipe(NV4, BLOCK, CUR),
                     {"input": (NV_X, CUR4), "weight": (NV_W2D, ("Float8BlockQuantizer", 2)),
                      "grad_output": (("Float8BlockQuantizer", 1), CUR5)}),
}


@pytest.mark.parametrize("name", list(MAPPINGS))
def test_direction_table(name):
    recipe, expected = MAPPINGS[name]
    lin = make_linear()
    forward, backward = lin.quantizers(recipe)
    slots = [("input", "input", forward[0]), ("weight", "weight", forward[1]),
             ("output: the next input", "input", forward[2]),
             ("grad_output", "grad_output", backward[0]),
             ("grad_input: the previous grad_output", "grad_output", backward[1])]
    for slot, tensor_type, q in slots:
        assert isinstance(q, mf.HybridQuantizer), slot
        got = (describe(q.rowwise_quantizer), describe(q.columnwise_quantizer))
        assert got == expected[tensor_type], (slot, got)
        row, col = q.rowwise_quantizer, q.columnwise_quantizer  # each pinned to its direction
        assert (row.rowwise_usage, row.columnwise_usage, col.rowwise_usage,
                col.columnwise_usage) == (True, False, False, True)
    if name == "mx-nv-delayed":  # delayed children record into their sub-state's slot
        fwd_state, bwd_state = lin.recipe_states(recipe)
        sub_fwd, sub_bwd = fwd_state.sub_states[recipe.wgrad], bwd_state.sub_states[recipe.wgrad]
        assert forward[0].columnwise_quantizer.scale.data_ptr() == sub_fwd.scale[0:1].data_ptr()
        assert backward[0].columnwise_quantizer.amax.data_ptr() == (
            sub_bwd.amax_history[0, 0:1].data_ptr())


@pytest.mark.parametrize("none_gemm", ["fprop", "dgrad", "wgrad"])
def test_none_gemm_runs_in_high_precision(none_gemm):
    recipe = mf.HybridRecipe(**{"fprop": MX, "dgrad": MX, "wgrad": MX, none_gemm: None})
    lin = make_linear(seed=5)
    forward, backward = lin.quantizers(recipe)
    children = {  # the two children that feed the None GEMM (DESIGN.md §3)
        "fprop": (forward[0].rowwise_quantizer, forward[1].rowwise_quantizer),
        "dgrad": (backward[0].rowwise_quantizer, forward[1].columnwise_quantizer),
        "wgrad": (backward[0].columnwise_quantizer, forward[0].columnwise_quantizer),
    }
    for gemm_name, pair in children.items():
        expected_cls = mf.IdentityQuantizer if gemm_name == none_gemm else mf.MXFP8Quantizer
        assert all(type(q) is expected_cls for q in pair), (gemm_name, pair)
    x, dy = make_data(6)
    y, dx = one_step(lin, recipe, x, dy)
    w, b = lin.weight.detach(), lin.bias.detach()
    expected = {  # plain fp32 for the None GEMM, MXFP8 reference for the others
        "fprop": (F.linear(x, w, b), gemm(op_mxfp8(x), op_mxfp8(w), bias=b)),
        "dgrad": (dy @ w, gemm(op_mxfp8(dy), op_mxfp8(w.t()))),
        "wgrad": (dy.t() @ x, gemm(op_mxfp8(dy.t()), op_mxfp8(x.t()))),
    }
    results = {"fprop": y, "dgrad": dx, "wgrad": lin.weight.grad}
    for gemm_name, (plain, quantized) in expected.items():
        want = plain if gemm_name == none_gemm else quantized
        assert_bitwise_equal(results[gemm_name], want, gemm_name)
    assert not torch.equal(results[none_gemm], expected[none_gemm][1])


def _capture(model):
    """Forward hooks recording (input, output) of each Linear, and the output's gradient."""
    records = {}

    def hook(module, inputs, output):
        entry = records[module.name] = {"in": inputs[0].detach(), "out": output.detach()}
        output.register_hook(lambda grad: entry.__setitem__("gout", grad))

    for module in model:
        if isinstance(module, mf.Linear):
            module.register_forward_hook(hook)
    return records


def test_high_precision_layers_by_name_are_plain_linear():
    recipe = hybrid_recipe(MX, MX, MX, high_precision=("layers.0", "*.2"))
    torch.manual_seed(8)
    model = torch.nn.Sequential(
        mf.Linear(IN, OUT, name="layers.0"), torch.nn.ReLU(),
        mf.Linear(OUT, OUT, name="layers.1"), torch.nn.ReLU(), mf.Linear(OUT, IN, name="layers.2"))
    layers = {m.name: m for m in model if isinstance(m, mf.Linear)}
    for name, layer in layers.items():
        forward, backward = layer.quantizers(recipe)
        own = [forward[0], forward[1], backward[0]]  # the slots this layer's GEMMs use
        if name == "layers.1":
            assert all(isinstance(q, mf.HybridQuantizer) for q in own)
        else:
            assert all(type(q) is mf.IdentityQuantizer for q in own), name
    records = _capture(model)
    x = torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(9), requires_grad=True)
    with mf.autocast(recipe=recipe):
        y = model(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(10)))
    for name, layer in layers.items():
        r, w, b = records[name], layer.weight.detach(), layer.bias.detach()
        if name == "layers.1":
            want_out = gemm(op_mxfp8(r["in"]), op_mxfp8(w), bias=b)
            want_dw = gemm(op_mxfp8(r["gout"].t()), op_mxfp8(r["in"].t()))
        else:  # identity slots keep the layer's input as it arrives: plain torch
            want_out, want_dw = F.linear(r["in"], w, b), r["gout"].t() @ r["in"]
        assert_bitwise_equal(r["out"], want_out, f"{name} output")
        assert_bitwise_equal(layer.weight.grad, want_dw, f"{name} dW")
    assert_bitwise_equal(x.grad, records["layers.0"]["gout"] @ layers["layers.0"].weight, "dx")


def test_high_precision_pattern_with_tensor_type():
    recipe = hybrid_recipe(MX, MX, MX, high_precision=("*:grad_output", "fc:weight"))
    fc, other = make_linear(seed=12, name="fc"), make_linear(seed=12, name="other")
    (f_in, f_w, _), (f_g, _) = fc.quantizers(recipe)
    (o_in, o_w, _), (o_g, _) = other.quantizers(recipe)
    assert type(f_w) is mf.IdentityQuantizer and type(f_g) is mf.IdentityQuantizer
    assert type(o_g) is mf.IdentityQuantizer
    assert all(isinstance(q, mf.HybridQuantizer) for q in (f_in, o_in, o_w))
    x, dy = make_data(13)
    y, dx = one_step(other, recipe, x, dy)
    w = other.weight.detach()
    assert_bitwise_equal(y, gemm(op_mxfp8(x), op_mxfp8(w), bias=other.bias), "y")
    assert_bitwise_equal(dx, gemm((dy, None), op_mxfp8(w.t())), "dx: dY high precision")
    assert_bitwise_equal(other.weight.grad, gemm((dy.t(), None), op_mxfp8(x.t())), "dW")


def test_invalid_hybrid_recipes_raise_clear_errors():
    with pytest.raises(TypeError, match="tuple of patterns"):
        hybrid_recipe(MX, MX, MX, high_precision="fc")
    with pytest.raises(ValueError, match="after ':'"):
        hybrid_recipe(MX, MX, MX, high_precision=("fc:output",))
    with pytest.raises(TypeError, match="must be strings"):
        hybrid_recipe(MX, MX, MX, high_precision=(3,))
    with pytest.raises(TypeError, match="HybridRecipe.dgrad must be a minifloat Recipe"):
        hybrid_recipe(MX, "mxfp8", MX)
    with pytest.raises(TypeError, match="cannot itself be a HybridRecipe"):
        hybrid_recipe(hybrid_recipe(MX, MX, MX), MX, MX)


def test_hybrid_recipe_pickles_and_hashes():
    recipe = hybrid_recipe(MX, mf.NVFP4BlockScaling(disable_rht=True),
                           mf.CustomRecipe(seed000_factory), high_precision=["head", "*:weight"])
    assert recipe.high_precision == ("head", "*:weight")
    restored = pickle.loads(pickle.dumps(recipe))
    assert restored == recipe and hash(restored) == hash(recipe)
    assert {recipe: 1}[restored] == 1
    assert restored != hybrid_recipe(MX, NV4, mf.CustomRecipe(seed000_factory))
    closure = hybrid_recipe(MX, None, mf.CustomRecipe(lambda role: mf.IdentityQuantizer()))
    with pytest.raises(TypeError, match="cannot be pickled.*module-level"):
        pickle.dumps(closure)


# ---------------------------------------------------------------------------------------------
# 4. delayed scaling inside a hybrid


def _delayed_update(history, new_row, fp8_maxes, old_scales):
    """NUMERICS.md §3 in Python: slot 0 holds the new amaxes; amax = max over the history;
    roll the newest row to the end and zero slot 0; scale = fp8_max / amax (fp32), kept when
    amax is 0. Returns (history, scales)."""
    full = [list(new_row)] + history[1:]
    scales = []
    for slot, (fp8_max, previous) in enumerate(zip(fp8_maxes, old_scales, strict=True)):
        amax = max(row[slot] for row in full)
        scales.append(float(np.float32(fp8_max) / np.float32(amax)) if amax > 0 else previous)
    rolled = full[1:] + [full[0]]
    rolled[0] = [0.0] * len(new_row)
    return rolled, scales


def _transposed(op):
    values, alpha = op
    return values.t(), alpha


def test_delayed_children_inside_a_hybrid_update_every_step():
    delayed = mf.DelayedScaling(amax_history_len=3)
    recipe = hybrid_recipe(delayed, CUR, delayed)
    lin = make_linear(seed=14)
    optimizer = torch.optim.SGD(lin.parameters(), lr=0.1)
    fwd_hist, bwd_hist = [[0.0] * 3 for _ in range(3)], [[0.0] * 2 for _ in range(3)]
    fwd_scale, bwd_scale = [1.0] * 3, [1.0] * 2
    for step in range(4):
        (s_in, s_w, _), s_g = fwd_scale, bwd_scale[0]  # this step's GEMMs use these
        x, dy = make_data(200 + step)
        x, dy = x * (step + 1), dy * 10.0 ** -step  # amaxes move from step to step
        xg = x.clone().requires_grad_(True)
        w = lin.weight.detach().clone()
        with mf.autocast(recipe=recipe):
            y = lin(xg)
            fwd, bwd = (state.sub_states[delayed] for state in lin.recipe_states(recipe))
            assert_bitwise_equal(fwd.scale, torch.tensor(fwd_scale), "no update inside autocast")
        amaxes = [x.abs().max().item(), w.abs().max().item(), 0.0]  # output slot: never cast
        fwd_hist, fwd_scale = _delayed_update(fwd_hist, amaxes, [448.0] * 3, fwd_scale)
        assert_bitwise_equal(fwd.amax_history, torch.tensor(fwd_hist), f"{step}: fwd history")
        assert_bitwise_equal(fwd.scale, torch.tensor(fwd_scale), f"{step}: fwd scale")
        assert_bitwise_equal(bwd.amax_history, torch.tensor(bwd_hist), f"{step}: bwd early")
        y.backward(dy)
        mf.update_delayed_backward_scales()  # backward slots update at the next entry
        bwd_hist, bwd_scale = _delayed_update(bwd_hist, [dy.abs().max().item(), 0.0],
                                              [57344.0] * 2, bwd_scale)
        assert_bitwise_equal(bwd.amax_history, torch.tensor(bwd_hist), f"{step}: bwd history")
        assert_bitwise_equal(bwd.scale, torch.tensor(bwd_scale), f"{step}: bwd scale")
        # this step's GEMMs: delayed fprop/wgrad with the scales of the previous updates,
        # current-scaling dgrad (E5M2 dY, the byte transpose of the E4M3 W)
        b = lin.bias.detach()
        ref_y = gemm(op_delayed(x, s_in, E4M3), op_delayed(w, s_w, E4M3), bias=b)
        ref_dx = gemm(op_current(dy, E5M2), _transposed(op_current(w, E4M3)))
        ref_dw = gemm(_transposed(op_delayed(dy, s_g, E5M2)),
                      _transposed(op_delayed(x, s_in, E4M3)))
        assert_bitwise_equal(y.detach(), ref_y, f"{step}: y")
        assert_bitwise_equal(xg.grad, ref_dx, f"{step}: dx")
        assert_bitwise_equal(lin.weight.grad, ref_dw, f"{step}: dW")
        optimizer.step()
        optimizer.zero_grad()
    assert len(lin.recipe_states(recipe)[0].delayed_states()) == 1  # fprop, wgrad share one


# ---------------------------------------------------------------------------------------------
# 5. quantized_model_init with a HybridRecipe


INIT_CASES = {  # recipe, expected weight children (rowwise: fprop's, columnwise: dgrad's)
    "mx-nv": (hybrid_recipe(MX, NV4, NV4),
              lambda: mf.HybridQuantizer(mf.MXFP8Quantizer(E4M3),
                                         mf.NVFP4Quantizer(with_2d_quantization=True)),
              (mf.MXFP8Storage, mf.NVFP4Storage)),
    "cur-block": (hybrid_recipe(CUR, BLOCK, MX),
                  lambda: mf.HybridQuantizer(mf.Float8CurrentScalingQuantizer(E4M3),
                                             mf.Float8BlockQuantizer(2)),
                  (mf.Float8Storage, mf.Float8BlockStorage)),
}


def build_quantized(case, keep=False, seed=30):
    torch.manual_seed(seed)
    with mf.quantized_model_init(recipe=INIT_CASES[case][0], keep_high_precision_copy=keep):
        return mf.Linear(IN, OUT, name="fc")


def buffers(tensor):
    """{direction.field: buffer} of a hybrid tensor's two sub-storages."""
    out = {}
    for direction in ("rowwise", "columnwise"):
        sub = getattr(mf.quantizers.as_storage(tensor), f"{direction}_storage")
        for name in sub.tensor_fields():
            if getattr(sub, name) is not None:
                out[f"{direction}.{name}"] = getattr(sub, name)
    return out


def assert_fresh_hybrid_quantization(tensor, values, case, what):
    expected = INIT_CASES[case][1]()
    expected.internal = True
    want, got = buffers(expected(values)), buffers(tensor)
    assert set(got) == set(want), what
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"{what}: {name}")


@pytest.mark.parametrize("case", list(INIT_CASES))
def test_quantized_init_weight_is_hybrid(case):
    lin = build_quantized(case, keep=True)
    weight = lin.weight
    assert isinstance(weight, mf.HybridQuantizedTensor) and weight.requires_grad
    row_cls, col_cls = INIT_CASES[case][2]
    row, col = weight.rowwise_storage, weight.columnwise_storage
    assert type(row) is row_cls and type(col) is col_cls
    assert (row.has_rowwise(), row.has_columnwise(), col.has_rowwise(), col.has_columnwise()) == (
        True, False, False, True)
    assert not isinstance(lin.weight_hp_init, mf.QuantizedTensor)
    assert_fresh_hybrid_quantization(weight, lin.weight_hp_init, case, "init")
    assert not hasattr(build_quantized(case), "weight_hp_init")


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
@pytest.mark.parametrize("case", list(INIT_CASES))
def test_quantized_hybrid_weight_trains_and_requantizes(case, optimizer_name):
    recipe = INIT_CASES[case][0]
    lin = build_quantized(case)
    g = torch.Generator().manual_seed(31)
    x = torch.randn(BATCH, IN, generator=g)
    target = x @ torch.randn(IN, OUT, generator=g) / 8  # a task the weight alone can learn
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=2.0),
            "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False)}[optimizer_name]
    optimizer = make([lin.weight])
    # a plain fp32 shadow, reset to the decoded weight before each step, takes the same update
    shadow = torch.nn.Parameter(lin.weight.dequantize().clone())
    shadow_optimizer = make([shadow])
    losses = []
    for step in range(8):
        optimizer.zero_grad()
        with mf.autocast(recipe=recipe):
            loss = F.mse_loss(lin(x), target)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            shadow.copy_(lin.weight.dequantize())
        shadow.grad = lin.weight.grad.clone()
        optimizer.step()
        shadow_optimizer.step()
        assert isinstance(lin.weight, mf.HybridQuantizedTensor)
        assert_fresh_hybrid_quantization(lin.weight, shadow.detach(), case, f"step {step}")
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("case", list(INIT_CASES))
def test_quantized_hybrid_state_dict_round_trip(case):
    lin = build_quantized(case, seed=32)
    blob = io.BytesIO()
    torch.save(lin.state_dict(), blob)
    blob.seek(0)
    state = torch.load(blob, weights_only=True)
    assert isinstance(state["weight"], mf.HybridQuantizedTensor)
    original = buffers(lin.weight)
    for target in (state["weight"], None):
        if target is None:  # load into a freshly built quantized module
            other = build_quantized(case, seed=33)
            assert not torch.equal(other.weight.dequantize(), lin.weight.dequantize())
            other.load_state_dict(state)
            target = other.weight
            assert isinstance(target, mf.HybridQuantizedTensor)
        restored = buffers(target)
        assert set(restored) == set(original)
        for name in original:
            assert_bitwise_equal(restored[name], original[name], name)
    assert_bitwise_equal(state["bias"], lin.bias.detach(), "bias")
