"""quantized_model_init: modules built inside hold QuantizedTensor weights stored only in low
precision; keep_high_precision_copy keeps weight_hp_init; checkpoints round-trip through
torch.save / torch.load(weights_only=True); the quantized weights train."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

import minifloat as mf
from minifloat import numerics

from ._reference import E4M3, assert_bitwise_equal, linear_reference, rel_err

RECIPES = {
    "delayed": mf.DelayedScaling(),
    "current": mf.Float8CurrentScaling(),
    "block": mf.Float8BlockScaling(),
    "mxfp8": mf.MXFP8BlockScaling(),
    "nvfp4": mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
}
KINDS = list(RECIPES)
IN_FEATURES, OUT_FEATURES = 96, 64
# |dequantized - initial| relative Frobenius bound per weight format: E4M3 ~3% (scale 1 for a
# fresh delayed-scaling state puts small weights near E4M3's subnormals, so allow more), NVFP4 ~10%
INIT_ERROR = {"delayed": 0.15, "current": 0.05, "block": 0.05, "mxfp8": 0.05, "nvfp4": 0.15}


def build(kind, keep=False, seed=0):
    torch.manual_seed(seed)
    with mf.quantized_model_init(recipe=RECIPES[kind], keep_high_precision_copy=keep):
        return mf.Linear(IN_FEATURES, OUT_FEATURES, name="fc")


def reference_weight_buffers(kind, w):
    """{field name: tensor} of the weight quantized (rowwise + columnwise) from numerics."""
    if kind in ("delayed", "current"):
        if kind == "delayed":
            data, scale_inv = numerics.quantize_with_scale(w, torch.ones(()), E4M3)
        else:
            data, scale_inv = numerics.quantize_current_scaling(w, E4M3)
        return {"data": data, "data_transpose": data.t().contiguous(),
                "scale_inv": scale_inv.reshape(1)}
    if kind == "block":
        data, scale_inv = numerics.quantize_block_2d(w)
        data_t, scale_inv_t = numerics.quantize_block_2d(w.t().contiguous())
        return {"rowwise_data": data, "rowwise_scale_inv": scale_inv,
                "columnwise_data": data_t, "columnwise_scale_inv": scale_inv_t}
    if kind == "mxfp8":
        return numerics.quantize_mxfp8(w, rowwise=True, columnwise=True)
    row = numerics.quantize_nvfp4(w, rowwise=True, two_dimensional=True)
    col = numerics.quantize_nvfp4(w.t().contiguous(), rowwise=True, two_dimensional=True)
    return {**row, "columnwise_data": col["rowwise_data"],
            "columnwise_scale": col["rowwise_scale"], "amax_columnwise": col["amax_rowwise"]}


def storage_buffers(tensor):
    storage = tensor.quantized_storage
    return {name: getattr(storage, name) for name in storage.tensor_fields()
            if getattr(storage, name) is not None}


@pytest.mark.parametrize("kind", KINDS)
def test_weights_are_quantized_tensors_in_low_precision_only(kind):
    lin = build(kind)
    weight = lin.weight
    assert isinstance(weight, mf.QuantizedTensor)
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad
    assert weight.shape == (OUT_FEATURES, IN_FEATURES) and weight.dtype == torch.float32
    assert any(p is weight for p in lin.parameters())
    assert not hasattr(lin, "weight_hp_init")
    assert not isinstance(lin.bias, mf.QuantizedTensor)
    numel = weight.numel()
    buffers = storage_buffers(weight)
    assert buffers, "no buffers"
    for name, buffer in buffers.items():
        # element data is one byte per element or less; anything wider is a small scale grid
        assert buffer.element_size() == 1 or buffer.numel() <= numel // 16, (name, buffer.dtype)
    assert sum(b.numel() * b.element_size() for b in buffers.values()) < numel * 4 * 0.6
    # no high-precision copy hiding on the module either
    for value in vars(lin).values():
        if isinstance(value, torch.Tensor) and not isinstance(value, mf.QuantizedTensor):
            assert value.numel() < numel, "a full-size high-precision tensor is kept"


@pytest.mark.parametrize("kind", KINDS)
def test_keep_high_precision_copy(kind):
    lin = build(kind, keep=True, seed=3)
    hp = lin.weight_hp_init
    assert not isinstance(hp, mf.QuantizedTensor) and not hp.requires_grad
    assert hp.shape == (OUT_FEATURES, IN_FEATURES) and hp.dtype == torch.float32
    assert all(p is not hp for p in lin.parameters())
    # the same generator state without quantized init draws the same initial values
    torch.manual_seed(3)
    plain = mf.Linear(IN_FEATURES, OUT_FEATURES)
    assert_bitwise_equal(hp, plain.weight.detach(), "weight_hp_init vs a plain init")
    # the stored bytes are the quantization of weight_hp_init
    expected = reference_weight_buffers(kind, hp)
    actual = storage_buffers(lin.weight)
    assert set(actual) == set(expected)
    for name in expected:
        assert_bitwise_equal(actual[name], expected[name], name)
    assert rel_err(lin.weight.dequantize(), hp) < INIT_ERROR[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip_weights_only(kind):
    lin = build(kind, seed=4)
    buffer = io.BytesIO()
    torch.save(lin.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    loaded = state["weight"]
    assert isinstance(loaded, mf.QuantizedTensor)
    assert_bitwise_equal(loaded.dequantize(), lin.weight.dequantize(), "values")
    original, restored = storage_buffers(lin.weight), storage_buffers(loaded)
    assert set(original) == set(restored)
    for name in original:
        assert_bitwise_equal(restored[name], original[name], name)
    assert_bitwise_equal(state["bias"], lin.bias.detach(), "bias")

    # into a freshly built quantized module: same bytes
    other = build(kind, seed=5)
    assert not torch.equal(other.weight.dequantize(), lin.weight.dequantize())
    other.load_state_dict(state)
    assert isinstance(other.weight, mf.QuantizedTensor)
    for name, value in storage_buffers(other.weight).items():
        assert_bitwise_equal(value, original[name], f"loaded into a quantized module: {name}")
    # into a plain module: the dequantized values
    plain = mf.Linear(IN_FEATURES, OUT_FEATURES)
    plain.load_state_dict(state)
    assert not isinstance(plain.weight, mf.QuantizedTensor)
    assert_bitwise_equal(plain.weight.detach(), lin.weight.dequantize(), "into a plain module")


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_weights_compute_and_train(kind):
    lin = build(kind, keep=True, seed=6)
    recipe = RECIPES[kind]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, IN_FEATURES, generator=g)
    dy = torch.randn(64, OUT_FEATURES, generator=g)
    # outside autocast: plain linear with the dequantized weight
    assert_bitwise_equal(lin(x), F.linear(x, lin.weight.dequantize(), lin.bias), "no autocast")
    # first step under autocast: bit-exact against the reference built from weight_hp_init
    xg = x.clone().requires_grad_(True)
    with mf.autocast(recipe=recipe):
        y = lin(xg)
    y.backward(dy)
    ref_y, ref_dx, ref_dw, ref_db = linear_reference(kind, x, lin.weight_hp_init,
                                                     lin.bias.detach(), dy)
    assert_bitwise_equal(y.detach(), ref_y, "y")
    assert_bitwise_equal(xg.grad, ref_dx, "dx")
    assert lin.weight.grad is not None and not isinstance(lin.weight.grad, mf.QuantizedTensor)
    assert_bitwise_equal(lin.weight.grad, ref_dw, "dw")

    # a few optimizer steps: the weight stays quantized and the loss goes down
    target = torch.randn(64, OUT_FEATURES, generator=g)
    initial = lin.weight.dequantize().clone()
    optimizer = torch.optim.Adam(lin.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        with mf.autocast(recipe=recipe):
            loss = F.mse_loss(lin(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        assert isinstance(lin.weight, mf.QuantizedTensor)
    assert losses[-1] < 0.9 * losses[0], losses
    assert not torch.equal(lin.weight.dequantize(), initial)


@pytest.mark.parametrize("kind", ["current", "block", "mxfp8", "nvfp4"])
def test_sgd_step_requantizes_the_updated_values(kind):
    lin = build(kind, seed=8)
    g = torch.Generator().manual_seed(9)
    lin.weight.grad = torch.randn(OUT_FEATURES, IN_FEATURES, generator=g)
    old = lin.weight.dequantize().clone()
    torch.optim.SGD([lin.weight], lr=0.05).step()
    assert isinstance(lin.weight, mf.QuantizedTensor)
    updated = old.add(lin.weight.grad, alpha=-0.05)
    expected = reference_weight_buffers(kind, updated)
    for name, value in storage_buffers(lin.weight).items():
        assert_bitwise_equal(value, expected[name], f"after the step: {name}")


def test_quantized_init_context_restores():
    with mf.quantized_model_init(recipe=mf.MXFP8BlockScaling()):
        inside = mf.Linear(64, 64)
        with mf.quantized_model_init(enabled=False):
            disabled = mf.Linear(64, 64)
        again = mf.Linear(64, 64)
    after = mf.Linear(64, 64)
    assert isinstance(inside.weight, mf.QuantizedTensor)
    assert isinstance(again.weight, mf.QuantizedTensor)
    assert not isinstance(disabled.weight, mf.QuantizedTensor)
    assert not isinstance(after.weight, mf.QuantizedTensor)


@pytest.mark.parametrize("kind", ["delayed", "current", "block", "nvfp4"])
def test_checkpoint_holds_the_bytes_once(kind):
    """Formats whose transposed copy is a rearrangement of the rowwise bytes save only the
    rowwise copy (rebuilt on load: the round-trip test above checks every field bitwise), so a
    quantized weight checkpoint costs 1 byte per element (FP8) or half of one (NVFP4)."""
    torch.manual_seed(0)
    with mf.quantized_model_init(recipe=RECIPES[kind]):
        lin = mf.Linear(512, 512, bias=False)
    assert lin.weight.quantized_storage.has_columnwise()
    buffer = io.BytesIO()
    torch.save(lin.state_dict(), buffer)
    rowwise_bytes = 512 * 512 // (2 if kind == "nvfp4" else 1)
    assert len(buffer.getvalue()) < 1.25 * rowwise_bytes  # both copies: over 2x
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["weight"]
    assert loaded.quantized_storage.has_columnwise()
    for name, value in storage_buffers(lin.weight).items():
        assert_bitwise_equal(storage_buffers(loaded)[name], value, name)
