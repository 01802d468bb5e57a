"""minifloat.Linear under each recipe: forward and backward bit for bit against an independent
composition of numerics functions (_reference.linear_reference), closeness to bf16 autograd,
stochastic rounding, what is saved for backward, the weight cache (micro-batches, optimizer
steps, no-grad validation steps: seed 002), main_grad accumulation and autocast nesting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import minifloat as mf
import minifloat.modules.linear_function as linear_function_module
from minifloat import numerics
from minifloat.autocast import get_autocast_state
from minifloat.modules.weights import quantized_weight

from ._reference import assert_bitwise_equal, linear_reference, rel_err

RECIPES = {
    "current": mf.Float8CurrentScaling(),
    "delayed": mf.DelayedScaling(),  # first step of a fresh module: every scale is 1
    "block": mf.Float8BlockScaling(),
    "mxfp8": mf.MXFP8BlockScaling(),
    "nvfp4": mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
}
KINDS = list(RECIPES)

# Relative Frobenius error against bf16 autograd, (y, dx, dw). Measured on these shapes:
# E4M3 GEMMs ~0.037, GEMMs with an E5M2 gradient ~0.06, NVFP4 ~0.15. Why: a random value's
# relative rounding error is at most half an ulp, 2^-(m+1) for m mantissa bits (E4M3 2^-4,
# E5M2 2^-3), with an RMS of roughly a third of that bound per operand, and errors of independent
# products add in quadrature, so the relative error of a GEMM is ~1.4x that of one operand.
# NVFP4's E2M1 has one mantissa bit (half-ulp up to 1/3 relative at 1.5) and its UE4M3 block scale
# adds a little. The bounds below leave ~1.6x headroom and still catch a wrong format (E5M2 for a
# forward tensor gives ~0.07), a lost scale (error ~1) or a transposed operand (error ~1.4).
THRESHOLDS = {
    "current": (0.06, 0.1, 0.1),
    "delayed": (0.06, 0.1, 0.1),
    "block": (0.06, 0.06, 0.06),
    "mxfp8": (0.06, 0.06, 0.06),
    "nvfp4": (0.25, 0.25, 0.25),
}

IN_FEATURES, OUT_FEATURES = 96, 32
BATCH_SHAPE = (4, 16)  # M = 64 rows; a 3D input exercises the [..., K] -> [M, K] view


def make_linear(seed=0, dtype=torch.float32, bias=True, name="fc"):
    torch.manual_seed(seed)
    return mf.Linear(IN_FEATURES, OUT_FEATURES, bias=bias, params_dtype=dtype, name=name)


def make_data(seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*BATCH_SHAPE, IN_FEATURES, generator=g).to(dtype)
    dy = torch.randn(*BATCH_SHAPE, OUT_FEATURES, generator=g).to(dtype)
    return x, dy


def run_step(lin, recipe, x, dy, **forward_kwargs):
    x = x.clone().requires_grad_(True)
    with mf.autocast(recipe=recipe):
        y = lin(x, **forward_kwargs)
    y.backward(dy)
    return y.detach(), x.grad


def bf16_autograd(lin, x, dy):
    xb = x.detach().bfloat16().requires_grad_(True)
    wb = lin.weight.detach().bfloat16().requires_grad_(True)
    bb = lin.bias.detach().bfloat16().requires_grad_(True)
    yb = F.linear(xb, wb, bb)
    yb.backward(dy.bfloat16())
    return yb, xb.grad, wb.grad


# ---------------------------------------------------------------------------------------------
# bit-exact forward and backward


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_linear_bit_exact(kind, dtype, bias):
    lin = make_linear(dtype=dtype, bias=bias)
    x, dy = make_data(dtype=dtype)
    y, dx = run_step(lin, RECIPES[kind], x, dy)
    ref_y, ref_dx, ref_dw, ref_db = linear_reference(
        kind, x, lin.weight.detach(), None if lin.bias is None else lin.bias.detach(), dy)
    assert y.dtype == dtype and dx.dtype == dtype and lin.weight.grad.dtype == dtype
    assert_bitwise_equal(y, ref_y, "y")
    assert_bitwise_equal(dx, ref_dx, "dx")
    assert_bitwise_equal(lin.weight.grad, ref_dw, "dw")
    if bias:
        assert_bitwise_equal(lin.bias.grad, ref_db, "db")


@pytest.mark.parametrize("kind", KINDS)
def test_linear_close_to_bf16_autograd(kind):
    lin = make_linear(seed=3)
    x, dy = make_data(seed=4)
    y, dx = run_step(lin, RECIPES[kind], x, dy)
    yb, dxb, dwb = bf16_autograd(lin, x, dy)
    errors = (rel_err(y, yb), rel_err(dx, dxb), rel_err(lin.weight.grad, dwb))
    for label, error, bound in zip(("y", "dx", "dw"), errors, THRESHOLDS[kind], strict=True):
        assert error < bound, f"{kind} {label}: relative error {error:.4f} >= {bound}"
    # and not suspiciously exact: quantization must actually have happened
    assert min(errors) > 1e-3


def test_shape_the_format_cannot_hold_is_a_clear_error():
    lin = make_linear()
    with mf.autocast(recipe=RECIPES["mxfp8"]):  # any token count: rows are padded inside
        assert lin(torch.randn(48, IN_FEATURES)).shape == (48, lin.out_features)
    with pytest.raises(ValueError, match="32"), mf.autocast(recipe=RECIPES["mxfp8"]):
        mf.Linear(40, 64)(torch.randn(64, 40))  # 40 features: not a multiple of MXFP8's 32
    with pytest.raises(ValueError, match="in_features|last dim|96"), \
            mf.autocast(recipe=RECIPES["current"]):
        lin(torch.randn(64, IN_FEATURES + 1))


def test_outside_autocast_linear_is_plain_linear():
    lin = make_linear()
    x, _ = make_data()
    assert_bitwise_equal(lin(x), F.linear(x, lin.weight, lin.bias))


# ---------------------------------------------------------------------------------------------
# stochastic rounding (NVFP4 gradients)


def test_nvfp4_stochastic_rounding_deterministic_under_seed_and_close():
    recipe = mf.NVFP4BlockScaling()  # SR on gradients
    x, dy = make_data(seed=5)

    def step(seed):
        lin = make_linear(seed=6)
        torch.manual_seed(seed)
        y, dx = run_step(lin, recipe, x, dy)
        return lin, y, dx, lin.weight.grad

    lin, y1, dx1, dw1 = step(100)
    _, y2, dx2, dw2 = step(100)
    _, y3, dx3, dw3 = step(101)
    assert_bitwise_equal(dx1, dx2, "dx, same seed")
    assert_bitwise_equal(dw1, dw2, "dw, same seed")
    assert not torch.equal(dx1, dx3) and not torch.equal(dw1, dw3), "SR must use the seed"
    # the forward pass has no SR: identical across seeds and equal to the RNE reference
    assert_bitwise_equal(y1, y3, "y across seeds")
    ref_y, ref_dx, ref_dw, _ = linear_reference(
        "nvfp4", x, lin.weight.detach(), lin.bias.detach(), dy)
    assert_bitwise_equal(y1, ref_y, "y vs reference")
    assert not torch.equal(dx1, ref_dx), "SR gradients should differ from the RNE reference"
    # closeness: SR's error is at most the gap between two neighbours (twice RNE's bound), and
    # unbiased; measured ~0.2 here, bound 0.35.
    _, dxb, dwb = bf16_autograd(lin, x, dy)
    assert rel_err(dx1, dxb) < 0.35 and rel_err(dw1, dwb) < 0.35
    # unbiased: the mean of independent SR draws approaches the high-precision gradient
    draws = [step(200 + i)[3] for i in range(8)]
    mean_error = rel_err(torch.stack(draws).mean(0), dwb)
    assert mean_error < 0.75 * rel_err(draws[0], dwb)


# ---------------------------------------------------------------------------------------------
# what is saved for backward, and what is quantized


def _input_copies(kind, x2d):
    """Reference (rowwise data, columnwise data) of the input for each recipe."""
    if kind == "current":
        data, _ = numerics.quantize_current_scaling(x2d, torch.float8_e4m3fn)
        return data, data.t().contiguous()
    if kind == "delayed":
        data, _ = numerics.quantize_with_scale(x2d, torch.ones(()), torch.float8_e4m3fn)
        return data, data.t().contiguous()
    if kind == "block":
        return numerics.quantize_block_1d(x2d)[0], numerics.quantize_block_1d_columnwise(x2d)[0]
    if kind == "mxfp8":
        out = numerics.quantize_mxfp8(x2d, rowwise=True, columnwise=True)
        return out["rowwise_data"], out["columnwise_data"]
    out = numerics.quantize_nvfp4(x2d, rowwise=True, columnwise=True, with_rht=True)
    return out["rowwise_data"], out["columnwise_data"]


def _same_bytes(a, b):
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


@pytest.mark.parametrize("kind", KINDS)
def test_only_the_columnwise_input_copy_is_saved(kind):
    lin = make_linear()
    x, dy = make_data()
    x = x.requires_grad_(True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            mf.autocast(recipe=RECIPES[kind]):
        y = lin(x)
    x2d = x.detach().reshape(-1, IN_FEATURES)
    rowwise, columnwise = _input_copies(kind, x2d)
    assert not any(_same_bytes(t, rowwise) for t in saved), "rowwise input copy was saved"
    assert any(_same_bytes(t, columnwise) for t in saved), "columnwise input copy not saved"
    assert not any(t.is_floating_point() and t.numel() == x.numel()
                   and t.element_size() >= 2 for t in saved), "high-precision input saved"
    assert sum(t.numel() * t.element_size() for t in saved) < x.numel() * x.element_size() / 2
    y.backward(dy)  # and backward still works from what was saved
    assert x.grad is not None and lin.weight.grad is not None


@pytest.mark.parametrize("kind", KINDS)
def test_saved_buffers_travel_through_saved_tensor_hooks(kind):
    """Hooks that move saved tensors (CPU offload, say) hand back copies: backward must use
    what unpack returns, and give the reference gradients."""
    lin = make_linear()
    x, dy = make_data()
    x = x.requires_grad_(True)
    packed = []

    def pack(tensor):
        packed.append(tensor)
        return tensor.clone()  # a different tensor object with the same bytes

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.clone()), \
            mf.autocast(recipe=RECIPES[kind]):
        y = lin(x)
    for tensor in packed:  # the originals are no longer needed: poison them
        if tensor.dtype == torch.uint8 or tensor.element_size() == 1:
            tensor.view(torch.uint8).fill_(0x7F)
        else:
            tensor.fill_(float("nan"))
    y.backward(dy)
    _, ref_dx, ref_dw, _ = linear_reference(kind, x.detach(), lin.weight.detach(),
                                            lin.bias.detach(), dy)
    assert_bitwise_equal(x.grad, ref_dx, "dx")
    assert_bitwise_equal(lin.weight.grad, ref_dw, "dw")


def _gemm_node(output):
    """The LinearGemms node behind a module output (behind as_output's view, if any)."""
    node = output.grad_fn
    while not hasattr(node, "w_tensors"):
        node = node.next_functions[0][0]
    return node


@pytest.mark.parametrize("kind", KINDS)
def test_backward_frees_the_saved_copies_while_the_graph_lives(kind):
    """A training loop keeps the last loss, and so its graph, alive into the next step's
    forward: the quantized copies backward read must go when backward is done, not with the
    graph (they once lived on: 2.2 GiB of input copies and 1 GiB of weight copies at the 1b
    preset). With retain_graph they stay, and a second backward gives the same gradients."""
    import gc
    import weakref

    lin = make_linear()
    x, dy = make_data()
    x = x.requires_grad_(True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t,
                                                  lambda t: t), \
            mf.autocast(recipe=RECIPES[kind]):
        y = lin(x)
    node = _gemm_node(y)
    copies = [weakref.ref(t) for t in [*packed, *node.w_tensors]
              if t is not None and t is not x and t is not lin.weight]
    packed.clear()
    assert copies and all(ref() is not None for ref in copies)
    y.backward(dy, retain_graph=True)
    first = (x.grad.clone(), lin.weight.grad.clone())
    gc.collect()
    assert all(ref() is not None for ref in copies), "retain_graph: the copies must stay"
    x.grad, lin.weight.grad, lin.bias.grad = None, None, None
    y.backward(dy)
    assert torch.equal(x.grad, first[0]) and torch.equal(lin.weight.grad, first[1])
    gc.collect()
    assert y.grad_fn is not None  # the graph object is still alive ...
    assert all(ref() is None for ref in copies), "... but its quantized copies are gone"


class QuantizeSpy:
    """Records each quantization: (quantizer, input shape, rowwise?, columnwise?, storage)."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = mf.Quantizer.__call__
        spy = self

        def recording_call(quantizer, x):
            out = original(quantizer, x)
            storage = mf.quantizers.as_storage(out)
            spy.calls.append((quantizer, tuple(x.shape), storage.has_rowwise(),
                              storage.has_columnwise(), storage))
            return out

        monkeypatch.setattr(mf.Quantizer, "__call__", recording_call)

    def of_shape(self, shape):
        return [c for c in self.calls if c[1] == tuple(shape)]


@pytest.mark.parametrize("kind", KINDS)
def test_no_grad_forward_quantizes_no_columnwise_copy(kind, monkeypatch):
    spy = QuantizeSpy(monkeypatch)
    lin = make_linear()
    x, _ = make_data()
    with torch.no_grad(), mf.autocast(recipe=RECIPES[kind]):
        y = lin(x.requires_grad_(True))
    ref_y = linear_reference(kind, x.detach(), lin.weight.detach(), lin.bias.detach(),
                             torch.zeros(*BATCH_SHAPE, OUT_FEATURES))[0]
    assert_bitwise_equal(y, ref_y, "no-grad forward")
    assert len(spy.calls) == 2  # the input and the weight
    assert all(row and not col for _, _, row, col, _ in spy.calls), spy.calls
    forward_quantizers, _ = lin.quantizers(RECIPES[kind])
    assert forward_quantizers[0].columnwise_usage is False


@pytest.mark.parametrize("kind", ["mxfp8", "nvfp4", "block"])
def test_usages_follow_which_gradients_are_needed(kind, monkeypatch):
    recipe = RECIPES[kind]
    x, dy = make_data()
    weight_shape = (OUT_FEATURES, IN_FEATURES)
    input_shape = (BATCH_SHAPE[0] * BATCH_SHAPE[1], IN_FEATURES)

    # frozen weight, input needs grad: input rowwise only, weight rowwise + columnwise
    spy = QuantizeSpy(monkeypatch)
    lin = make_linear()
    lin.weight.requires_grad_(False)
    xg = x.clone().requires_grad_(True)
    with mf.autocast(recipe=recipe):
        y = lin(xg)
    y.backward(dy)
    (_, _, row, col, _), = spy.of_shape(input_shape)
    assert (row, col) == (True, False)
    (_, _, row, col, _), = spy.of_shape(weight_shape)
    assert (row, col) == (True, True)
    assert lin.weight.grad is None and xg.grad is not None

    # trainable weight, input without grad: input both copies, weight rowwise only
    spy.calls.clear()
    lin = make_linear()
    with mf.autocast(recipe=recipe):
        y = lin(x)
    y.backward(dy)
    (_, _, row, col, _), = spy.of_shape(input_shape)
    assert (row, col) == (True, True)
    (_, _, row, col, _), = spy.of_shape(weight_shape)
    assert (row, col) == (True, False)
    ref = linear_reference(kind, x, lin.weight.detach(), lin.bias.detach(), dy)
    assert_bitwise_equal(lin.weight.grad, ref[2], "dw with an input that needs no grad")


# ---------------------------------------------------------------------------------------------
# the quantized weight cache


class GemmSpy:
    """Records the operands of every general_gemm call made by Linear."""

    def __init__(self, monkeypatch):
        self.fprop_weights = []
        self.dgrad_weights = []
        original = linear_function_module.general_gemm

        def recording_gemm(a, b, **kwargs):
            if not kwargs.get("a_columnwise") and not kwargs.get("b_columnwise"):
                self.fprop_weights.append(b)
            elif kwargs.get("b_columnwise") and not kwargs.get("a_columnwise"):
                self.dgrad_weights.append(b)
            return original(a, b, **kwargs)

        monkeypatch.setattr(linear_function_module, "general_gemm", recording_gemm)


@pytest.mark.parametrize("kind", ["current", "block", "mxfp8", "nvfp4"])
def test_weight_copies_kept_across_microbatches_with_is_first_microbatch(kind, monkeypatch):
    """TransformerEngine's flag: True quantizes and keeps, False reuses the kept copy."""
    recipe = RECIPES[kind]
    quantize_spy = QuantizeSpy(monkeypatch)
    gemm_spy = GemmSpy(monkeypatch)
    lin = make_linear()
    weight_shape = (OUT_FEATURES, IN_FEATURES)
    for seed, first in ((1, True), (2, False), (3, False)):  # one step of three micro-batches
        x, dy = make_data(seed)
        run_step(lin, recipe, x, dy, is_first_microbatch=first)
    assert len(quantize_spy.of_shape(weight_shape)) == 1, "weight quantized more than once"
    first_copy = gemm_spy.fprop_weights[0]
    assert all(w is first_copy for w in gemm_spy.fprop_weights)
    # backward keeps a detached view of the kept copy with only its columnwise buffers
    kept = first_copy.direction_storage(True)
    field = type(kept).columnwise_fields[0]
    assert all(getattr(w, field).data_ptr() == getattr(kept, field).data_ptr()
               for w in gemm_spy.dgrad_weights)
    assert all(not w.has_rowwise() for w in gemm_spy.dgrad_weights)

    torch.optim.SGD(lin.parameters(), lr=0.1).step()
    x, dy = make_data(4)
    lin.zero_grad()
    _, dx = run_step(lin, recipe, x, dy, is_first_microbatch=True)
    assert len(quantize_spy.of_shape(weight_shape)) == 2, "weight not requantized after a step"
    assert gemm_spy.fprop_weights[-1] is not first_copy
    ref_y, ref_dx, ref_dw, _ = linear_reference(kind, x, lin.weight.detach(), lin.bias.detach(),
                                                dy)
    assert_bitwise_equal(dx, ref_dx, "dx after the optimizer step uses the new weight")
    assert_bitwise_equal(lin.weight.grad, ref_dw, "dw after the optimizer step")

    # a change the version counter sees still requantizes, even when asked to reuse
    with torch.no_grad():
        lin.weight.mul_(0.5)
    x, dy = make_data(5)
    y, _ = run_step(lin, recipe, x, dy, is_first_microbatch=False)
    assert len(quantize_spy.of_shape(weight_shape)) == 3
    ref_y = linear_reference(kind, x, lin.weight.detach(), lin.bias.detach(), dy)[0]
    assert_bitwise_equal(y, ref_y, "y after an in-place weight edit")


@pytest.mark.parametrize("kind", ["current", "mxfp8"])
def test_default_requantizes_after_a_fused_optimizer_step(kind, monkeypatch):
    """The default (is_first_microbatch=None) quantizes the weight on every forward. A fused
    AdamW updates parameters without bumping their version counter, so a cache trusting the
    counter would keep training on the first step's quantized weight (this happened)."""
    recipe = RECIPES[kind]
    quantize_spy = QuantizeSpy(monkeypatch)
    lin = make_linear(seed=7)
    optimizer = torch.optim.AdamW(lin.parameters(), lr=0.05, fused=True)
    for seed in (1, 2, 3):
        x, dy = make_data(seed)
        version = lin.weight._version
        y, _ = run_step(lin, recipe, x, dy)
        ref_y = linear_reference(kind, x, lin.weight.detach(), lin.bias.detach(), dy)[0]
        assert_bitwise_equal(y, ref_y, f"y at step {seed} uses the current weight")
        optimizer.step()
        optimizer.zero_grad()
    assert lin.weight._version == version, "fused AdamW now bumps the version (fine, but note)"
    assert len(quantize_spy.of_shape((OUT_FEATURES, IN_FEATURES))) == 3


@pytest.mark.parametrize("optimizer_step", [False, True], ids=["same-weight", "after-step"])
@pytest.mark.parametrize("kind", ["current", "block", "mxfp8", "nvfp4"])
def test_no_grad_validation_step_keeps_columnwise_weight(kind, optimizer_step):
    """Seed 002: train, (optimizer step), validate under no_grad, train again: the second
    training step must give the same dx/dw as without the validation step."""
    recipe = RECIPES[kind]
    x1, dy1 = make_data(11)
    x2, dy2 = make_data(12)
    xv, _ = make_data(13)

    def session(validate):
        lin = make_linear(seed=21)
        optimizer = torch.optim.SGD(lin.parameters(), lr=0.5)
        run_step(lin, recipe, x1, dy1)
        if optimizer_step:
            optimizer.step()
        optimizer.zero_grad()
        if validate:
            with torch.no_grad(), mf.autocast(recipe=recipe):
                lin(xv)
        _, dx = run_step(lin, recipe, x2, dy2)
        return lin, dx, lin.weight.grad.clone()

    lin_a, dx_a, dw_a = session(validate=True)
    _, dx_b, dw_b = session(validate=False)
    assert_bitwise_equal(dx_a, dx_b, "dx after a validation step")
    assert_bitwise_equal(dw_a, dw_b, "dw after a validation step")
    _, ref_dx, ref_dw, _ = linear_reference(kind, x2, lin_a.weight.detach(),
                                            lin_a.bias.detach(), dy2)
    assert_bitwise_equal(dx_a, ref_dx, "dx vs reference")


@pytest.mark.parametrize("kind", ["block", "mxfp8", "nvfp4"])
def test_rowwise_only_weight_request_keeps_cached_columnwise_copy(kind):
    """Seed 002 at the cache: a rowwise-only request (what a no-grad step asks for) after an
    optimizer step quantizes rowwise only; the next training step must add the columnwise copy
    from the current weight, not reuse stale or missing data."""
    recipe = RECIPES[kind]
    lin = make_linear(seed=51)
    x1, dy1 = make_data(52)
    x2, dy2 = make_data(53)
    run_step(lin, recipe, x1, dy1)
    torch.optim.SGD(lin.parameters(), lr=0.5).step()
    lin.zero_grad()
    weight_quantizer = lin.quantizers(recipe)[0][1]
    storage = quantized_weight(lin._weight_cache, lin.weight, weight_quantizer, columnwise=False)
    assert storage.has_rowwise()
    # reuse the kept copy: it lacks the columnwise copy, so the weight is quantized again
    _, dx = run_step(lin, recipe, x2, dy2, is_first_microbatch=False)
    _, ref_dx, ref_dw, _ = linear_reference(kind, x2, lin.weight.detach(), lin.bias.detach(),
                                            dy2)
    assert_bitwise_equal(dx, ref_dx, "dx")
    assert_bitwise_equal(lin.weight.grad, ref_dw, "dw")
    # and a later rowwise-only request keeps (OR-merges) the columnwise copy
    again = quantized_weight(lin._weight_cache, lin.weight, weight_quantizer, columnwise=False)
    assert again.has_rowwise() and again.has_columnwise()
    # after a weight change: a columnwise request, then a rowwise-only one, ends with both
    with torch.no_grad():
        lin.weight.mul_(0.5)
    quantized_weight(lin._weight_cache, lin.weight, weight_quantizer, columnwise=True)
    merged = quantized_weight(lin._weight_cache, lin.weight, weight_quantizer, columnwise=False)
    assert merged.has_rowwise() and merged.has_columnwise()


@pytest.mark.parametrize("kind", ["mxfp8", "nvfp4"])
def test_validation_before_any_training(kind):
    recipe = RECIPES[kind]
    x, dy = make_data(31)
    lin = make_linear(seed=32)
    with torch.no_grad(), mf.autocast(recipe=recipe):
        lin(x)
    _, dx = run_step(lin, recipe, x, dy)
    ref = linear_reference(kind, x, lin.weight.detach(), lin.bias.detach(), dy)
    assert_bitwise_equal(dx, ref[1], "dx")
    assert_bitwise_equal(lin.weight.grad, ref[2], "dw")


# ---------------------------------------------------------------------------------------------
# main_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["mxfp8", "nvfp4", "current"])
def test_main_grad_accumulates_over_microbatches(kind, dtype):
    recipe = RECIPES[kind]
    lin = make_linear(seed=41, dtype=dtype)
    lin.weight.main_grad = torch.zeros(OUT_FEATURES, IN_FEATURES, dtype=torch.float32)
    expected = torch.zeros(OUT_FEATURES, IN_FEATURES, dtype=torch.float32)
    expected_db = None
    for seed in (42, 43):
        x, dy = make_data(seed, dtype=dtype)
        run_step(lin, recipe, x, dy)
        assert lin.weight.grad is None
        # the wgrad product in fp32, added in fp32 (never rounded to the parameter dtype)
        _, _, product, db = linear_reference(kind, x, lin.weight.detach(), lin.bias.detach(),
                                             dy, wgrad_dtype=torch.float32)
        expected = expected + product
        expected_db = db if expected_db is None else expected_db + db
    assert lin.weight.main_grad.dtype == torch.float32
    assert_bitwise_equal(lin.weight.main_grad, expected, "main_grad")
    assert_bitwise_equal(lin.bias.grad, expected_db, "bias grad still accumulates in .grad")


def test_non_fp32_main_grad_is_a_type_error():
    lin = make_linear()
    lin.weight.main_grad = torch.zeros(OUT_FEATURES, IN_FEATURES, dtype=torch.bfloat16)
    x, dy = make_data()
    with mf.autocast(recipe=RECIPES["mxfp8"]):
        y = lin(x)
    with pytest.raises(TypeError, match="float32"):
        y.backward(dy)


# ---------------------------------------------------------------------------------------------
# autocast nesting


def test_autocast_nests_and_restores():
    lin = make_linear()
    x, dy = make_data()
    zeros = torch.zeros_like(dy)
    outer, inner = RECIPES["current"], RECIPES["mxfp8"]
    plain = F.linear(x, lin.weight, lin.bias)

    def expect(kind):
        return linear_reference(kind, x, lin.weight.detach(), lin.bias.detach(), zeros)[0]

    assert not get_autocast_state().enabled
    with mf.autocast(recipe=outer):
        assert get_autocast_state().recipe == outer
        assert_bitwise_equal(lin(x), expect("current"), "outer")
        with mf.autocast(recipe=inner):
            assert get_autocast_state().recipe == inner
            assert_bitwise_equal(lin(x), expect("mxfp8"), "inner")
            with mf.autocast(enabled=False):
                assert not get_autocast_state().enabled
                assert_bitwise_equal(lin(x), plain, "disabled inside enabled")
            assert get_autocast_state().recipe == inner
            assert_bitwise_equal(lin(x), expect("mxfp8"), "inner after disabled")
        assert get_autocast_state().enabled and get_autocast_state().recipe == outer
        assert_bitwise_equal(lin(x), expect("current"), "outer restored")
        with pytest.raises(RuntimeError, match="boom"), mf.autocast(recipe=inner):
            raise RuntimeError("boom")
        assert get_autocast_state().recipe == outer, "restored after an exception"
    assert not get_autocast_state().enabled
    assert_bitwise_equal(lin(x), plain, "after all contexts")


def test_autocast_rejects_non_recipes():
    with pytest.raises(TypeError, match="Recipe"), mf.autocast(recipe="mxfp8"):
        pass
    assert not get_autocast_state().enabled
