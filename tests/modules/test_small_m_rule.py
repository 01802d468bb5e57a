"""The small-M rule of quantize_weights_once (issue 21, item 4): a call of at most
`small_m_rows` rows without autograd runs its high-precision input against the weight quantized
and dequantized once per block (modules/weights.py says what was measured on the GPU).

References are independent of the route: the module's weight quantizer applied by hand (and,
for FP8 current and MXFP8, numerics' own quantize/dequantize), then F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import minifloat as mf
from minifloat import numerics
from minifloat.modules.base import FORWARD_SLOTS
from minifloat.modules.weights import ONCE_KEY

from .test_any_token_count import fused_experts

RECIPES = {
    "current": lambda: mf.Float8CurrentScaling(),
    "delayed": lambda: mf.DelayedScaling(),
    "block": lambda: mf.Float8BlockScaling(),
    "mxfp8": lambda: mf.MXFP8BlockScaling(),
    "nvfp4": lambda: mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
}


def _layer() -> mf.Linear:
    torch.manual_seed(0)
    return mf.Linear(128, 256)


def _dequantized_by_hand(layer: mf.Linear, recipe) -> torch.Tensor:
    quantizer = layer.quantizers(recipe)[0][1].copy()  # the weight slot of GEMM 0
    quantizer.set_usage(rowwise=True, columnwise=False)
    return quantizer(layer.weight.detach()).dequantize(dtype=torch.float32)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_small_calls_run_against_the_dequantized_weight(name, rows):
    recipe, layer = RECIPES[name](), _layer()
    x = torch.randn(rows, 128)
    with torch.no_grad(), mf.autocast(recipe=recipe), mf.quantize_weights_once():
        reference = F.linear(x, _dequantized_by_hand(layer, recipe), layer.bias)  # (delayed
        y = layer(x)  # scaling: the scale of this round; the exit updates it)
    assert torch.equal(y, reference)


@pytest.mark.parametrize("name", ["current", "mxfp8"])
def test_dequantized_weight_equals_numerics(name):
    recipe, layer = RECIPES[name](), _layer()
    weight = layer.weight.detach()
    if name == "current":
        data, scale_inv = numerics.quantize_current_scaling(weight, torch.float8_e4m3fn)
        reference = numerics.dequantize_per_tensor(data, scale_inv)
    else:
        out = numerics.quantize_mxfp8(weight)
        reference = numerics.dequantize_mxfp8(out["rowwise_data"], out["rowwise_scale"])
    x = torch.randn(3, 128)
    with torch.no_grad(), mf.autocast(recipe=recipe), mf.quantize_weights_once():
        y = layer(x)
    assert torch.equal(y, F.linear(x, reference, layer.bias))


def _quantized_path(layer: mf.Linear, recipe, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), mf.autocast(recipe=recipe), mf.quantize_weights_once(small_m_rows=0):
        return layer(x)


@pytest.mark.parametrize("name", ["current", "mxfp8"])
def test_larger_calls_autograd_and_a_zero_limit_keep_the_quantized_path(name):
    recipe, layer = RECIPES[name](), _layer()
    x = torch.randn(64, 128)
    quantized = _quantized_path(layer, recipe, x)
    assert not torch.equal(quantized, F.linear(x, _dequantized_by_hand(layer, recipe),
                                               layer.bias))  # the input's cast shows
    with torch.no_grad(), mf.autocast(recipe=recipe), mf.quantize_weights_once(small_m_rows=32):
        assert torch.equal(layer(x), quantized)  # 64 rows > 32
    with mf.autocast(recipe=recipe), mf.quantize_weights_once():
        assert torch.equal(layer(x).detach(), quantized)  # autograd on: training numerics
    with torch.no_grad(), mf.autocast(recipe=recipe):
        assert torch.equal(layer(x), quantized)  # outside the block


def test_weight_dequantized_once_per_block_and_again_in_the_next():
    recipe, layer = RECIPES["current"](), _layer()
    x = torch.randn(2, 128)

    def kept() -> torch.Tensor:
        block = layer._weight_cache[ONCE_KEY]
        return block[("dequantized", id(layer.weight))]["tensor"]

    with torch.no_grad(), mf.autocast(recipe=recipe):
        with mf.quantize_weights_once():
            layer(x)
            first = kept()
            layer(x)
            assert kept() is first
        with torch.no_grad():
            layer.weight.mul_(0.5)  # between blocks: the next block must see it
        with mf.quantize_weights_once():
            y = layer(x)
            assert kept() is not first
            with mf.quantize_weights_once():  # nested: the outer block's copies stay
                layer(x)
            assert kept() is not first
    assert torch.equal(y, F.linear(x, _dequantized_by_hand(layer, recipe), layer.bias))
    assert layer._weight_cache == {}  # the block's copies are not kept alive after it


def test_microbatch_copies_outlive_a_generation_block():
    """is_first_microbatch=True keeps its copy for later micro-batches; a quantize_weights_once
    block in between drops only its own copies."""
    recipe, layer = RECIPES["current"](), _layer()
    x = torch.randn(32, 128)
    with mf.autocast(recipe=recipe):
        layer(x, is_first_microbatch=True)
    kept = dict(layer._weight_cache)
    with torch.no_grad(), mf.autocast(recipe=recipe), mf.quantize_weights_once():
        layer(x[:2])
    assert layer._weight_cache == kept


def test_mxfp8_single_row_needs_no_padding(monkeypatch):
    layer = _layer()

    def refuse(*args, **kwargs):
        raise AssertionError("padded a call the small-M rule runs")

    monkeypatch.setattr(type(layer), "_run_rows_padded", refuse)
    with torch.no_grad(), mf.autocast(recipe=RECIPES["mxfp8"]()), mf.quantize_weights_once():
        assert layer(torch.randn(1, 128)).shape == (1, 256)


def test_grouped_linear_splits_take_the_rule():
    recipe = RECIPES["current"]()
    torch.manual_seed(0)
    layer = mf.GroupedLinear(2, 128, 64)
    x, splits = torch.randn(5, 128), [2, 3]
    with torch.no_grad(), mf.autocast(recipe=recipe), mf.quantize_weights_once():
        y = layer(x, splits)
    pieces = []
    for gemm, piece in enumerate(torch.split(x, splits)):
        weight = getattr(layer, f"weight{gemm}")
        quantizer = layer.quantizers(recipe)[0][len(FORWARD_SLOTS) * gemm + 1].copy()
        quantizer.set_usage(rowwise=True, columnwise=False)
        pieces.append(F.linear(piece, quantizer(weight.detach()).dequantize(
            dtype=torch.float32), getattr(layer, f"bias{gemm}")))
    assert torch.equal(y, torch.cat(pieces))


def test_negative_limit_is_refused():
    with pytest.raises(ValueError, match="small_m_rows must be >= 0"), \
            mf.quantize_weights_once(small_m_rows=-1):
        pass


def test_fused_experts_decode_step_pads_nothing_and_uses_dequantized_weights():
    torch.manual_seed(0)
    recipe = RECIPES["mxfp8"]()
    experts = fused_experts(4, 64, 64)
    hidden, index = torch.randn(3, 64), torch.tensor([[0, 2], [2, 3], [1, 0]])
    weights = torch.rand(3, 2)
    splits = []
    original = experts.run_gemms
    experts.run_gemms = lambda x, m_splits, *a, **k: (splits.append(list(m_splits)),
                                                      original(x, m_splits, *a, **k))[1]
    with torch.no_grad(), mf.autocast(recipe=recipe), mf.quantize_weights_once():
        out = experts(hidden, index, weights)
    assert splits[0] == [2, 1, 2, 1]  # the tokens per expert, no 32-row padding

    def dequantized(weight: torch.Tensor, gemm: int) -> torch.Tensor:
        quantizer = experts.quantizers(recipe)[0][len(FORWARD_SLOTS) * gemm + 1].copy()
        quantizer.set_usage(rowwise=True, columnwise=False)
        return quantizer(weight.detach()).dequantize(dtype=torch.float32)

    reference = torch.zeros_like(hidden)
    for token in range(3):
        for slot in range(2):
            e = int(index[token, slot])
            gate, up = F.linear(hidden[token:token + 1],
                                dequantized(experts.gate_up_proj[e], e)).chunk(2, dim=-1)
            h = F.linear(experts.act_fn(gate) * up, dequantized(experts.down_proj[e], 4 + e))
            reference[token] += (h * weights[token, slot])[0]
    assert torch.allclose(out, reference, rtol=1e-6, atol=1e-6)
