"""LayerNormLinear and LayerNormMLP against an independent reference: the norm and activation
from torch functions (F.layer_norm, an RMSNorm written out in the module's op order, torch
activations) around linears whose three GEMMs are emulated from training/_reference.py's numerics
operands. Forward and every gradient bit for bit under each recipe, a HybridRecipe and delayed
scaling over two steps; LayerNormMLP's per-GEMM roles (fc1_name / fc2_name, the internal boundary
labelled by fc2) reaching a CustomRecipe; the normalised input quantized once; quantized_model_init;
minifloat.checkpoint."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minifloat as mf
from minifloat import QuantizerRole
from training._reference import (
    E4M3,
    E5M2,
    assert_bitwise_equal,
    gemm,
    op_block_1d,
    op_block_2d,
    op_current,
    op_delayed,
    op_mxfp8,
    op_nvfp4,
)

HIDDEN, FFN = 64, 96
# 32 rows; fc1 input [32, 64], fc2 input [32, 96], weights [96 or 192, 64] and [64, 96]: every
# quantized tensor has its own shape
BATCH_SHAPE = (4, 8)
ROWS = BATCH_SHAPE[0] * BATCH_SHAPE[1]
TYPES = ("input", "weight", "grad_output")
E4M3_MAX, E5M2_MAX = 448.0, 57344.0

# ---------------------------------------------------------------------------------------------
# reference operand formats: {tensor type: (rowwise operand, columnwise operand)}, each taking the
# tensor as stored ([rows, K] input or gradient, [N, K] weight) and returning _reference's
# (decoded fp32 values laid out [rows, reduction], per-tensor alpha or None)


def per_tensor(dtype, scale=None):
    def row(t):
        return op_current(t, dtype) if scale is None else op_delayed(t, scale, dtype)

    def col(t):  # per-tensor FP8: the columnwise copy is the transpose of the rowwise bytes
        values, alpha = row(t)
        return values.t(), alpha

    return row, col


def transposing(row, col=None):
    """Block formats: the columnwise copy is the rowwise quantization of the transpose."""
    col = col or row
    return row, lambda t: col(t.t().contiguous())


HIGH = (lambda t: (t.float(), None), lambda t: (t.t().float(), None))


def formats(kind, scales=None):
    if kind == "current":
        return {"input": per_tensor(E4M3), "weight": per_tensor(E4M3),
                "grad_output": per_tensor(E5M2)}
    if kind == "delayed":
        return {t: per_tensor(E5M2 if t == "grad_output" else E4M3, scales[t]) for t in TYPES}
    if kind == "block":
        one_d = transposing(op_block_1d)
        return {"input": one_d, "weight": transposing(op_block_2d), "grad_output": one_d}
    if kind == "mxfp8":
        return dict.fromkeys(TYPES, transposing(op_mxfp8))
    if kind == "mxfp8-e5m2-grads":
        return {"input": transposing(op_mxfp8), "weight": transposing(op_mxfp8),
                "grad_output": transposing(functools.partial(op_mxfp8, dtype=E5M2))}
    if kind == "nvfp4":  # SR disabled; RHT on the wgrad (columnwise) copies; weights 16x16
        one_d = transposing(op_nvfp4, functools.partial(op_nvfp4, rht=True))
        return {"input": one_d, "grad_output": one_d,
                "weight": transposing(functools.partial(op_nvfp4, two_dimensional=True))}
    assert kind == "high"
    return dict.fromkeys(TYPES, HIGH)


def gemm_spec(fprop, dgrad=None, wgrad=None):
    """Operand formats of one linear's three GEMMs (one recipe, or a hybrid's three)."""
    return {"fprop": fprop, "dgrad": dgrad or fprop, "wgrad": wgrad or fprop}


RECIPES = {
    "current": mf.Float8CurrentScaling(),
    "block": mf.Float8BlockScaling(),
    "mxfp8": mf.MXFP8BlockScaling(),
    "nvfp4": mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
    "hybrid": mf.HybridRecipe(fprop=mf.MXFP8BlockScaling(), dgrad=mf.Float8CurrentScaling(),
                              wgrad=mf.NVFP4BlockScaling(disable_stochastic_rounding=True)),
}


def spec_of(kind):
    if kind == "hybrid":
        return gemm_spec(formats("mxfp8"), formats("current"), formats("nvfp4"))
    return gemm_spec(formats(kind))


class RefLinear(torch.autograd.Function):
    """y = x W^T + b with emulated GEMMs: fprop (x row, W row), dgrad (dy row, W col), wgrad
    (dy col, x col). Records the amaxes of its operands into `trace` (delayed scaling)."""

    @staticmethod
    def forward(ctx, x2d, w, b, spec, trace):
        ctx.save_for_backward(x2d, w)
        ctx.spec, ctx.trace, ctx.has_bias = spec, trace, b is not None
        trace["input"], trace["weight"] = x2d.abs().max().item(), w.abs().max().item()
        fprop = spec["fprop"]
        return gemm(fprop["input"][0](x2d), fprop["weight"][0](w), bias=b, out_dtype=x2d.dtype)

    @staticmethod
    def backward(ctx, dy):
        x2d, w = ctx.saved_tensors
        spec = ctx.spec
        ctx.trace["grad_output"] = dy.abs().max().item()
        dx = gemm(spec["dgrad"]["grad_output"][0](dy), spec["dgrad"]["weight"][1](w),
                  out_dtype=x2d.dtype)
        dw = gemm(spec["wgrad"]["grad_output"][1](dy), spec["wgrad"]["input"][1](x2d),
                  out_dtype=w.dtype)
        return dx, dw, dy.sum(dim=0) if ctx.has_bias else None, None, None


def ref_norm(module, x, p):
    weight = p["layer_norm_weight"]
    gamma = weight + 1 if module.zero_centered_gamma else weight
    if module.normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, p["layer_norm_bias"], module.eps)
    x32 = x.float()
    rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + module.eps)
    return (x32 * rms * gamma.float()).to(x.dtype)


def ref_activation(name, h):
    if name in ("swiglu", "geglu"):
        half = h.shape[-1] // 2
        a, gate = h[..., :half], h[..., half:]  # act(first half) * second half
        return (F.silu(a) if name == "swiglu" else F.gelu(a, approximate="tanh")) * gate
    return F.relu(h) if name == "relu" else F.gelu(h, approximate="tanh")


def reference(module, specs, x, dy, params=None):
    """(y, dx, {parameter: grad}, [amax trace per GEMM]) of the module's computation from torch
    functions and RefLinear; `params` overrides the module's values (quantized-init copies)."""
    values = {name: p.detach() for name, p in module.named_parameters()}
    values.update(params or {})
    p = {name: v.clone().requires_grad_(True) for name, v in values.items()}
    xr = x.clone().requires_grad_(True)
    normed = ref_norm(module, xr, p).reshape(-1, x.shape[-1])
    traces = [{}, {}]
    if isinstance(module, mf.LayerNormMLP):
        h = RefLinear.apply(normed, p["fc1_weight"], p.get("fc1_bias"), specs[0], traces[0])
        a = ref_activation(module.activation, h)
        y = RefLinear.apply(a, p["fc2_weight"], p.get("fc2_bias"), specs[1], traces[1])
    else:
        y = RefLinear.apply(normed, p["weight"], p.get("bias"), specs[0], traces[0])
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    y.backward(dy)
    return y.detach(), xr.grad, {name: t.grad for name, t in p.items()}, traces


# ---------------------------------------------------------------------------------------------
# modules, data, comparison


def randomize_norm(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = module.layer_norm_weight
        shift = -0.5 if module.zero_centered_gamma else 0.5  # gamma in [0.5, 1.5)
        weight.copy_(torch.rand(weight.shape, generator=g) + shift)
        if module.layer_norm_bias is not None:
            module.layer_norm_bias.copy_(torch.randn(HIDDEN, generator=g) * 0.1)
    return module


def make_mlp(activation="gelu", normalization="LayerNorm", seed=0, **kwargs):
    torch.manual_seed(seed)
    mlp = mf.LayerNormMLP(HIDDEN, FFN, normalization=normalization, activation=activation,
                          name="mlp", **kwargs)
    return randomize_norm(mlp, seed + 100)


def make_ln_linear(normalization="LayerNorm", seed=0, **kwargs):
    torch.manual_seed(seed)
    module = mf.LayerNormLinear(HIDDEN, FFN, normalization=normalization, name="qkv", **kwargs)
    return randomize_norm(module, seed + 100)


def make_data(seed=1, out_features=HIDDEN, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*BATCH_SHAPE, HIDDEN, generator=g) * 2 + 0.5  # a mean for LayerNorm
    return x.to(dtype), torch.randn(*BATCH_SHAPE, out_features, generator=g).to(dtype)


def run_module(module, recipe, x, dy, wrap=None):
    xg = x.clone().requires_grad_(True)
    with mf.autocast(recipe=recipe):
        y = (wrap or (lambda f, t: f(t)))(module, xg)
    y.backward(dy)
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad()
    return y.detach(), xg.grad, grads


def assert_same(actual, expected, what=""):
    (y, dx, grads), (ref_y, ref_dx, ref_grads) = actual[:3], expected[:3]
    assert_bitwise_equal(y, ref_y, f"{what} y")
    assert_bitwise_equal(dx, ref_dx, f"{what} dx")
    assert set(grads) == set(ref_grads)
    for name in grads:
        assert_bitwise_equal(grads[name], ref_grads[name], f"{what} d{name}")


# ---------------------------------------------------------------------------------------------
# bit-exact forward and backward


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("activation", ["gelu", "relu", "swiglu", "geglu"])
@pytest.mark.parametrize("kind", list(RECIPES))
def test_layernorm_mlp_bit_exact(kind, activation, normalization):
    mlp = make_mlp(activation, normalization)
    x, dy = make_data()
    actual = run_module(mlp, RECIPES[kind], x, dy)
    assert_same(actual, reference(mlp, [spec_of(kind)] * 2, x, dy), kind)
    assert set(actual[2]) == {"layer_norm_weight", "fc1_weight", "fc1_bias", "fc2_weight",
                              "fc2_bias"} | ({"layer_norm_bias"} if normalization == "LayerNorm"
                                             else set())


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero-centered"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("kind", list(RECIPES))
def test_layernorm_linear_bit_exact(kind, normalization, zero_centered):
    module = make_ln_linear(normalization, zero_centered_gamma=zero_centered)
    x, dy = make_data(out_features=FFN)
    assert_same(run_module(module, RECIPES[kind], x, dy),
                reference(module, [spec_of(kind)], x, dy), kind)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_bf16_and_no_bias(normalization):
    mlp = make_mlp("swiglu", normalization, bias=False, zero_centered_gamma=True,
                   params_dtype=torch.bfloat16)
    assert mlp.fc1_bias is None and mlp.fc2_bias is None
    x, dy = make_data(dtype=torch.bfloat16)
    actual = run_module(mlp, RECIPES["mxfp8"], x, dy)
    assert actual[0].dtype == torch.bfloat16 and actual[2]["fc1_weight"].dtype == torch.bfloat16
    assert_same(actual, reference(mlp, [spec_of("mxfp8")] * 2, x, dy))


def test_return_layernorm_output():
    module = make_ln_linear(return_layernorm_output=True)
    x, _ = make_data()
    with mf.autocast(recipe=RECIPES["current"]):
        y, normed = module(x)
    p = {name: t.detach() for name, t in module.named_parameters()}
    assert_bitwise_equal(normed, ref_norm(module, x, p), "norm output")
    assert y.shape == (*BATCH_SHAPE, FFN)


@pytest.mark.parametrize("module_kind", ["ln_linear", "mlp"])
def test_delayed_scaling_two_steps(module_kind):
    """Step 1 casts with scale 1; step 2 with 448/amax (E5M2: 57344/amax) of step 1's operands,
    recomputed here from the reference's own tensors, after an SGD step on the weights."""
    recipe = mf.DelayedScaling()
    module = make_mlp("geglu", seed=3) if module_kind == "mlp" else make_ln_linear(seed=3)
    out_features = HIDDEN if module_kind == "mlp" else FFN
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    gemms = module.num_gemms
    scales = [dict.fromkeys(TYPES, 1.0)] * gemms
    for step in range(2):
        x, dy = make_data(10 + step, out_features)
        x = x * (1 + 3 * step)  # the amax moves between steps
        actual = run_module(module, recipe, x, dy)
        specs = [gemm_spec(formats("delayed", s)) for s in scales]
        expected = reference(module, specs, x, dy)
        assert_same(actual, expected, f"step {step}")
        for name, p in module.named_parameters():
            p.grad = actual[2][name]
        optimizer.step()
        module.zero_grad()
        maxes = {"input": E4M3_MAX, "weight": E4M3_MAX, "grad_output": E5M2_MAX}
        scales = [{t: float(np.float32(maxes[t]) / np.float32(trace[t])) for t in TYPES}
                  for trace in expected[3][:gemms]]
    assert all(s != 1.0 for gemm_scales in scales for s in gemm_scales.values())



@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_outside_autocast_is_plain_torch(activation):
    mlp = make_mlp(activation, "RMSNorm")
    x, _ = make_data()
    p = {name: t.detach() for name, t in mlp.named_parameters()}
    h = F.linear(ref_norm(mlp, x, p), p["fc1_weight"], p["fc1_bias"])
    expected = F.linear(ref_activation(activation, h), p["fc2_weight"], p["fc2_bias"])
    assert_bitwise_equal(mlp(x), expected, "mlp")
    module = make_ln_linear()
    p = {name: t.detach() for name, t in module.named_parameters()}
    expected = F.linear(F.layer_norm(x, (HIDDEN,), p["layer_norm_weight"],
                                     p["layer_norm_bias"], 1e-5), p["weight"], p["bias"])
    assert_bitwise_equal(module(x), expected, "ln_linear")


# ---------------------------------------------------------------------------------------------
# roles (seed 001)


def test_mlp_roles_name_each_gemm_and_label_the_boundary_by_fc2():
    R = QuantizerRole
    mlp = mf.LayerNormMLP(HIDDEN, FFN, name="layers.0.mlp")
    fc1, fc2 = "layers.0.mlp.fc1", "layers.0.mlp.fc2"
    assert (mlp.fc1_name, mlp.fc2_name) == (fc1, fc2)
    assert mlp.get_quantizer_roles(True) == [
        R("linear", "input", fc1), R("linear", "weight", fc1),
        R("linear", "input", fc2),  # fc1's output: fc2's input
        R("linear", "input", fc2), R("linear", "weight", fc2), R("linear", "input", fc2)]
    assert mlp.get_quantizer_roles(False) == [
        R("linear", "grad_output", fc1), R("linear", "grad_output", fc1),
        R("linear", "grad_output", fc2),
        R("linear", "grad_output", fc1)]  # fc2's grad_input: fc1's grad_output
    # set_consumer_roles moves only the module's outer edges, never the fc1 -> fc2 boundary
    after, before = R("dpa", "input", "attn"), R("linear", "grad_output", "proj")
    mlp.set_consumer_roles(output=after, grad_input=before)
    forward, backward = mlp.get_quantizer_roles(True), mlp.get_quantizer_roles(False)
    assert forward[2] == R("linear", "input", fc2) and forward[5] == after
    assert backward[3] == R("linear", "grad_output", fc1) and backward[1] == before
    assert (mf.LayerNormMLP(HIDDEN, FFN).fc1_name, mf.LayerNormMLP(HIDDEN, FFN).fc2_name) == (
        "fc1", "fc2")
    named = mf.LayerNormMLP(HIDDEN, FFN, name="m", fc1_name="up", fc2_name="down")
    assert [r.name for r in named.get_quantizer_roles(True)] == ["up", "up"] + ["down"] * 4
    # LayerNormLinear's roles are Linear's
    assert (mf.LayerNormLinear(HIDDEN, FFN, name="qkv").get_quantizer_roles(True)
            == mf.Linear(HIDDEN, FFN, name="qkv").get_quantizer_roles(True))


class KeepNameInHighPrecision:
    """CustomRecipe factory: slots of layer `name` stay high precision, the rest MXFP8 (E5M2
    gradients); records every role it is asked for."""

    def __init__(self, name):
        self.name, self.roles = name, []

    def __call__(self, role):
        self.roles.append(role)
        if role.name == self.name:
            return mf.IdentityQuantizer()
        return mf.MXFP8Quantizer(E5M2 if role.tensor_type == "grad_output" else E4M3)


@pytest.mark.parametrize("keep", ["fc1", "fc2"])
def test_custom_recipe_gives_fc1_and_fc2_their_own_quantizers(keep):
    factory = KeepNameInHighPrecision(f"mlp.{keep}")
    recipe = mf.CustomRecipe(factory)
    mlp = make_mlp("swiglu", seed=7)
    x, dy = make_data(8)
    actual = run_module(mlp, recipe, x, dy)
    assert factory.roles == mlp.get_quantizer_roles(True) + mlp.get_quantizer_roles(False)
    forward, backward = mlp.quantizers(recipe)
    kept = 0 if keep == "fc1" else 1
    for g in (0, 1):
        expected = mf.IdentityQuantizer if g == kept else mf.MXFP8Quantizer
        assert isinstance(forward[3 * g], expected) and isinstance(forward[3 * g + 1], expected)
        assert isinstance(backward[2 * g], expected)
    quantized = formats("mxfp8-e5m2-grads")
    specs = [gemm_spec(formats("high") if g == kept else quantized) for g in (0, 1)]
    assert_same(actual, reference(mlp, specs, x, dy))


# ---------------------------------------------------------------------------------------------
# what is quantized


class QuantizeSpy:
    def __init__(self, monkeypatch):
        self.calls = []
        original = mf.Quantizer.__call__

        def recording_call(quantizer, x):
            out = original(quantizer, x)
            storage = mf.quantizers.as_storage(out)
            self.calls.append((tuple(x.shape), storage.has_rowwise(), storage.has_columnwise()))
            return out

        monkeypatch.setattr(mf.Quantizer, "__call__", recording_call)


@pytest.mark.parametrize("kind", ["current", "mxfp8", "nvfp4"])
def test_each_gemm_input_is_quantized_once_with_both_copies(kind, monkeypatch):
    spy = QuantizeSpy(monkeypatch)
    mlp = make_mlp()
    x, dy = make_data()
    with mf.autocast(recipe=RECIPES[kind]):
        y = mlp(x.requires_grad_(True))
    assert sorted(spy.calls) == sorted([
        ((ROWS, HIDDEN), True, True), ((FFN, HIDDEN), True, True),  # norm(x), fc1 weight
        ((ROWS, FFN), True, True), ((HIDDEN, FFN), True, True)])    # act(h), fc2 weight
    spy.calls.clear()
    y.backward(dy)
    assert sorted(spy.calls) == [((ROWS, HIDDEN), True, True), ((ROWS, FFN), True, True)]
    spy.calls.clear()
    module = make_ln_linear()
    with mf.autocast(recipe=RECIPES[kind]):
        module(x)
    assert sorted(spy.calls) == [((ROWS, HIDDEN), True, True), ((FFN, HIDDEN), True, True)]


# ---------------------------------------------------------------------------------------------
# quantized_model_init, checkpoint, errors


@pytest.mark.parametrize("kind", ["current", "mxfp8", "nvfp4", "hybrid"])
def test_quantized_model_init_weights_compute_and_train(kind):
    recipe = RECIPES[kind]
    torch.manual_seed(11)
    with mf.quantized_model_init(recipe=recipe, keep_high_precision_copy=True):
        mlp = mf.LayerNormMLP(HIDDEN, FFN, activation="swiglu", name="mlp")
        ln_linear = mf.LayerNormLinear(HIDDEN, FFN, normalization="RMSNorm")
    for weight in (mlp.fc1_weight, mlp.fc2_weight, ln_linear.weight):
        assert isinstance(weight, mf.QuantizedTensor) and weight.requires_grad
    for p in (mlp.layer_norm_weight, mlp.fc1_bias, ln_linear.layer_norm_weight):
        assert not isinstance(p, mf.QuantizedTensor)
    assert mlp.fc1_weight.shape == (2 * FFN, HIDDEN) and mlp.fc2_weight.shape == (HIDDEN, FFN)
    hp = {"fc1_weight": mlp.fc1_weight_hp_init, "fc2_weight": mlp.fc2_weight_hp_init}
    assert not any(isinstance(t, mf.QuantizedTensor) for t in hp.values())
    # the first step equals the reference built from the high-precision initial values
    x, dy = make_data(12)
    assert_same(run_module(mlp, recipe, x, dy),
                reference(mlp, [spec_of(kind)] * 2, x, dy, params=hp), "quantized init")
    # a few SGD steps: weights stay quantized and change, the loss falls
    target = torch.randn(*BATCH_SHAPE, HIDDEN, generator=torch.Generator().manual_seed(13))
    initial = mlp.fc2_weight.dequantize().clone()
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.05)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        with mf.autocast(recipe=recipe):  # summed per row: updates that survive requantization
            loss = F.mse_loss(mlp(x), target, reduction="sum") / ROWS
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert isinstance(mlp.fc1_weight, mf.QuantizedTensor)
    assert isinstance(mlp.fc2_weight, mf.QuantizedTensor)
    assert not torch.equal(mlp.fc2_weight.dequantize(), initial)
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("kind", ["delayed", "mxfp8", "nvfp4-sr"])
def test_checkpoint_gives_identical_gradients(kind):
    recipe = {"delayed": mf.DelayedScaling(), "mxfp8": RECIPES["mxfp8"],
              "nvfp4-sr": mf.NVFP4BlockScaling()}[kind]  # SR: the recompute must replay RNG

    def session(use_checkpoint):
        mlp = make_mlp("geglu", seed=21)
        wrap = (lambda f, t: mf.checkpoint(f, t)) if use_checkpoint else None
        results = []
        for step in range(2):  # delayed scaling: the second step uses updated scales
            x, dy = make_data(22 + step)
            torch.manual_seed(99 + step)
            results.append(run_module(mlp, recipe, x * (1 + step), dy, wrap))
        return results

    for step, (plain, checkpointed) in enumerate(zip(session(False), session(True),
                                                     strict=True)):
        assert_same(checkpointed, plain, f"step {step}")


def test_errors_and_repr():
    with pytest.raises(ValueError, match="normalization"):
        mf.LayerNormLinear(HIDDEN, FFN, normalization="BatchNorm")
    with pytest.raises(ValueError, match="activation"):
        mf.LayerNormMLP(HIDDEN, FFN, activation="tanh")
    with pytest.raises(ValueError, match="last dim 64"):
        make_mlp()(torch.randn(4, HIDDEN + 1))
    with pytest.raises(ValueError, match="last dim 64"):
        make_ln_linear()(torch.randn(4, HIDDEN + 1))
    mlp = mf.LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm", activation="swiglu", name="m")
    assert mlp.layer_norm_bias is None and mlp.fc1_weight.shape == (2 * FFN, HIDDEN)
    text = repr(mlp)
    assert "activation=swiglu" in text and "fc2_name='m.fc2'" in text and "RMSNorm" in text
    assert "normalization=LayerNorm" in repr(mf.LayerNormLinear(HIDDEN, FFN))
