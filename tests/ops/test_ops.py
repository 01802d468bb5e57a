"""minifloat.ops: a Sequential of fusible ops equals the equivalent module stack bit for bit
(forward and every gradient) under every recipe and outside autocast; delayed-scaling amax
histories match; SwiGLU / RMSNorm / ReLU equal torch; the GroupedLinear op equals
minifloat.GroupedLinear with uneven and empty splits; roles and the consumer labelling done by
Sequential; quantized tensors handed along between neighbours (spies); minifloat.checkpoint;
main_grad; quantized_model_init weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import minifloat as mf
from minifloat import QuantizerRole, ops
from minifloat.quantizers import Quantizer
from training._reference import assert_bitwise_equal

NVFP4 = mf.NVFP4BlockScaling(disable_stochastic_rounding=True)
RECIPES = {
    "none": None,
    "current": mf.Float8CurrentScaling(),
    "delayed": mf.DelayedScaling(amax_history_len=4),
    "block": mf.Float8BlockScaling(),
    "mxfp8": mf.MXFP8BlockScaling(),
    "nvfp4": NVFP4,
    "hybrid": mf.HybridRecipe(fprop=mf.MXFP8BlockScaling(), dgrad=NVFP4, wgrad=NVFP4),
}
HID, FFN = 64, 128
LEAD = (2, 16)  # 32 rows; a 3D input exercises the [..., K] -> [M, K] views


class ModuleStack(nn.Module):
    """torch LayerNorm + minifloat.Linear + GELU + minifloat.Linear."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(HID, dtype=dtype)
        self.fc1 = mf.Linear(HID, FFN, params_dtype=dtype, name="fc1")
        self.fc2 = mf.Linear(FFN, HID, params_dtype=dtype, name="fc2")

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.ln(x))))


def build_pair(dtype=torch.float32, seed=0):
    """(Sequential, ModuleStack, [(op param, module param)]) with equal parameters."""
    torch.manual_seed(seed)
    stack = ModuleStack(dtype)
    with torch.no_grad():
        stack.ln.weight.normal_()
        stack.ln.bias.normal_()
    seq = ops.Sequential(
        ops.LayerNorm(HID, params_dtype=dtype), ops.BasicLinear(HID, FFN, dtype, name="fc1"),
        ops.Bias(FFN, dtype), ops.GELU(), ops.BasicLinear(FFN, HID, dtype, name="fc2"),
        ops.Bias(HID, dtype),
    )
    pairs = [(seq[0].weight, stack.ln.weight), (seq[0].bias, stack.ln.bias),
             (seq[1].weight, stack.fc1.weight), (seq[2].bias, stack.fc1.bias),
             (seq[4].weight, stack.fc2.weight), (seq[5].bias, stack.fc2.bias)]
    with torch.no_grad():
        for mine, theirs in pairs:
            mine.copy_(theirs)
    return seq, stack, pairs


def data(seed, dtype=torch.float32, features=HID, out=HID, lead=LEAD):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*lead, features, generator=g).to(dtype),
            torch.randn(*lead, out, generator=g).to(dtype))


def step(model, recipe, x, dy, **kwargs):
    x = x.clone().requires_grad_(True)
    with mf.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x, **kwargs)
    y.backward(dy)
    mf.update_delayed_backward_scales()  # backward slots update at the next entry
    return y.detach(), x.grad


def assert_same_step(seq, stack, pairs, recipe, seed, what):
    dtype = pairs[0][0].dtype
    x, dy = data(seed, dtype)
    y_a, dx_a = step(seq, recipe, x, dy)
    y_b, dx_b = step(stack, recipe, x, dy)
    assert_bitwise_equal(y_a, y_b, f"{what}: y")
    assert_bitwise_equal(dx_a, dx_b, f"{what}: dx")
    for index, (mine, theirs) in enumerate(pairs):
        assert_bitwise_equal(mine.grad, theirs.grad, f"{what}: grad of parameter {index}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(RECIPES))
def test_sequential_equals_module_stack(kind, dtype):
    """Two steps with an SGD step between them (the weight caches must follow the update)."""
    recipe = RECIPES[kind]
    seq, stack, pairs = build_pair(dtype)
    opt_a = torch.optim.SGD(seq.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(stack.parameters(), lr=0.1)
    for index in range(2):
        assert_same_step(seq, stack, pairs, recipe, 10 + index, f"{kind} step {index}")
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()


def test_delayed_scaling_three_steps_and_amax_histories():
    recipe = RECIPES["delayed"]
    seq, stack, pairs = build_pair()
    for index in range(3):
        assert_same_step(seq, stack, pairs, recipe, 20 + index, f"delayed step {index}")
        for op, module in ((seq[1], stack.fc1), (seq[4], stack.fc2)):
            for mine, theirs in zip(op.recipe_states(recipe), module.recipe_states(recipe),
                                    strict=True):
                assert_bitwise_equal(mine.amax_history, theirs.amax_history, "amax history")
                assert_bitwise_equal(mine.scale, theirs.scale, "scale")
                assert mine.amax_history.abs().sum() > 0
        for mine, theirs in pairs:
            mine.grad = theirs.grad = None


@pytest.mark.parametrize("kind", ["none", "mxfp8", "nvfp4"])
def test_swiglu_rmsnorm_relu_equal_torch(kind):
    recipe = RECIPES[kind]
    torch.manual_seed(1)
    norm = nn.RMSNorm(HID, eps=1e-5)
    fc1, fc2 = mf.Linear(HID, 2 * FFN, bias=False), mf.Linear(FFN, HID, bias=False)
    fc3 = mf.Linear(HID, HID, bias=False)
    with torch.no_grad():
        norm.weight.normal_()

    def stack(x):
        gate, linear = fc1(norm(x)).chunk(2, dim=-1)
        return fc3(F.relu(fc2(F.silu(gate) * linear)))

    seq = ops.Sequential(ops.RMSNorm(HID, eps=1e-5), ops.BasicLinear(HID, 2 * FFN),
                         ops.SwiGLU(), ops.BasicLinear(FFN, HID), ops.ReLU(),
                         ops.BasicLinear(HID, HID))
    pairs = [(seq[0].weight, norm.weight), (seq[1].weight, fc1.weight),
             (seq[3].weight, fc2.weight), (seq[5].weight, fc3.weight)]
    with torch.no_grad():
        for mine, theirs in pairs:
            mine.copy_(theirs)
    x, dy = data(30)
    y_a, dx_a = step(seq, recipe, x, dy)
    y_b, dx_b = step(stack, recipe, x, dy)
    assert_bitwise_equal(y_a, y_b, "y")
    assert_bitwise_equal(dx_a, dx_b, "dx")
    for mine, theirs in pairs:
        assert_bitwise_equal(mine.grad, theirs.grad, "param grad")


def test_swiglu_alone_is_the_torch_expression():
    x = torch.randn(8, 2 * 24, requires_grad=True)
    y = ops.Sequential(ops.SwiGLU())(x)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = F.silu(x_ref[..., :24]) * x_ref[..., 24:]
    assert_bitwise_equal(y, y_ref, "y")
    dy = torch.randn_like(y)
    y.backward(dy)
    mf.update_delayed_backward_scales()  # backward slots update at the next entry
    y_ref.backward(dy)
    mf.update_delayed_backward_scales()  # backward slots update at the next entry
    assert_bitwise_equal(x.grad, x_ref.grad, "dx")
    with pytest.raises(ValueError, match="odd"):
        ops.Sequential(ops.SwiGLU())(torch.randn(4, 5))


# ---- GroupedLinear op ----

SPLITS = [64, 0, 32, 96]  # uneven, one expert without tokens; multiples of 32 (MXFP8 blocks)


@pytest.mark.parametrize("kind", ["none", "current", "delayed", "block", "mxfp8", "nvfp4",
                                  "hybrid"])
def test_grouped_op_equals_grouped_module(kind):
    recipe = RECIPES[kind]
    torch.manual_seed(2)
    module = mf.GroupedLinear(len(SPLITS), HID, FFN, name="experts")
    op = ops.GroupedLinear(len(SPLITS), HID, FFN, name="experts")
    op.load_state_dict(module.state_dict())
    seq = ops.Sequential(op)
    for index in range(2):
        x, dy = data(40 + index, out=FFN, lead=(sum(SPLITS),))
        y_a, dx_a = step(seq, recipe, x, dy, m_splits=SPLITS)
        y_b, dx_b = step(module, recipe, x, dy, m_splits=SPLITS)
        assert_bitwise_equal(y_a, y_b, "y")
        assert_bitwise_equal(dx_a, dx_b, "dx")
        assert torch.count_nonzero(op.weight1.grad) == 0  # the expert without tokens
        for (name, mine), theirs in zip(op.named_parameters(), module.parameters(),
                                        strict=True):
            assert_bitwise_equal(mine.grad, theirs.grad, name)
            mine.grad = theirs.grad = None
    if kind == "delayed":
        for mine, theirs in zip(op.recipe_states(recipe), module.recipe_states(recipe),
                                strict=True):
            assert_bitwise_equal(mine.amax_history, theirs.amax_history, "amax history")


@pytest.mark.parametrize("kind", ["current", "mxfp8", "hybrid"])
def test_grouped_op_between_gemm_ops(kind):
    """BasicLinear -> GroupedLinear -> BasicLinear: the grouped op's output and grad_input
    leave quantized for its single-GEMM neighbours; equal to the modules."""
    recipe = RECIPES[kind]
    torch.manual_seed(3)
    fc1 = mf.Linear(HID, HID, bias=False, name="fc1")
    experts = mf.GroupedLinear(len(SPLITS), HID, FFN, name="experts")
    fc2 = mf.Linear(FFN, HID, bias=False, name="fc2")
    seq = ops.Sequential(ops.BasicLinear(HID, HID, name="fc1"),
                         ops.GroupedLinear(len(SPLITS), HID, FFN, name="experts"),
                         ops.BasicLinear(FFN, HID, name="fc2"))
    with torch.no_grad():
        seq[0].weight.copy_(fc1.weight)
        seq[2].weight.copy_(fc2.weight)
    seq[1].load_state_dict(experts.state_dict())
    x, dy = data(50, lead=(sum(SPLITS),))
    y_a, dx_a = step(seq, recipe, x, dy, m_splits=SPLITS)
    x_b = x.clone().requires_grad_(True)
    with mf.autocast(recipe=recipe):
        y_b = fc2(experts(fc1(x_b), SPLITS))
    y_b.backward(dy)
    mf.update_delayed_backward_scales()  # backward slots update at the next entry
    assert_bitwise_equal(y_a, y_b.detach(), "y")
    assert_bitwise_equal(dx_a, x_b.grad, "dx")
    module_params = [*fc1.parameters(), *experts.parameters(), *fc2.parameters()]
    for mine, theirs in zip(seq.parameters(), module_params, strict=True):
        assert_bitwise_equal(mine.grad, theirs.grad, "param grad")


def test_m_splits_errors():
    seq = ops.Sequential(ops.GroupedLinear(2, HID, HID))
    with pytest.raises(ValueError, match="m_splits"):
        seq(torch.randn(4, HID))
    with pytest.raises(ValueError, match="sum"):
        seq(torch.randn(4, HID), m_splits=[1, 2])
    with pytest.raises(ValueError, match="no op"):
        ops.Sequential(ops.GELU())(torch.randn(4, HID), m_splits=[4])


# ---- roles ----


def test_each_op_declares_its_roles():
    linear = ops.BasicLinear(HID, HID, name="proj")
    assert linear.get_quantizer_roles(True) == [
        QuantizerRole("linear", "input", "proj"), QuantizerRole("linear", "weight", "proj"),
        QuantizerRole("linear", "input", "proj")]
    assert linear.get_quantizer_roles(False) == [
        QuantizerRole("linear", "grad_output", "proj"),
        QuantizerRole("linear", "grad_output", "proj")]
    grouped = ops.GroupedLinear(3, HID, HID, name="experts")
    forward = grouped.get_quantizer_roles(True)
    assert len(forward) == 9 and len(grouped.get_quantizer_roles(False)) == 6
    assert forward[1] == QuantizerRole("grouped_linear", "weight", "experts")
    for op in (ops.GELU(), ops.ReLU(), ops.SwiGLU(), ops.Bias(HID), ops.LayerNorm(HID),
               ops.RMSNorm(HID)):
        assert op.get_quantizer_roles(True) == [] and op.get_quantizer_roles(False) == []


def test_sequential_labels_consumer_roles():
    seq = ops.Sequential(ops.LayerNorm(HID), ops.BasicLinear(HID, HID, name="a"),
                         ops.BasicLinear(HID, HID, name="b"),
                         ops.GroupedLinear(2, HID, HID, name="experts"), ops.GELU(),
                         ops.BasicLinear(HID, HID, name="c"))
    a, b, experts, c = seq[1], seq[2], seq[3], seq[5]
    # output slot: the next op's input role; grad_input slot: the previous op's grad_output
    assert a.get_quantizer_roles(True)[2] == QuantizerRole("linear", "input", "b")
    assert b.get_quantizer_roles(True)[2] == QuantizerRole("grouped_linear", "input", "experts")
    assert b.get_quantizer_roles(False)[1] == QuantizerRole("linear", "grad_output", "a")
    assert experts.get_quantizer_roles(False)[1] == QuantizerRole("linear", "grad_output", "b")
    assert experts.get_quantizer_roles(False)[3] == QuantizerRole("linear", "grad_output", "b")
    # next to a high-precision op (or at an end) the default stays
    assert a.get_quantizer_roles(False)[1] == QuantizerRole("linear", "grad_output", "a")
    assert experts.get_quantizer_roles(True)[2] == QuantizerRole("linear", "input", "experts")
    assert c.get_quantizer_roles(True)[2] == QuantizerRole("linear", "input", "c")
    assert c.get_quantizer_roles(False)[1] == QuantizerRole("linear", "grad_output", "c")


def _current_scaling_factory(role):
    dtype = torch.float8_e5m2 if role.tensor_type == "grad_output" else torch.float8_e4m3fn
    return mf.Float8CurrentScalingQuantizer(dtype)


def test_consumer_roles_reach_a_custom_factory():
    seen = []

    def factory(role):
        seen.append(role)
        return _current_scaling_factory(role)

    seq = ops.Sequential(ops.BasicLinear(HID, HID, name="a"), ops.BasicLinear(HID, HID, name="b"))
    step(seq, mf.CustomRecipe(factory), *data(60))
    # b's input, a's output slot (b consumes it) and b's output slot (last op: the default)
    assert seen.count(QuantizerRole("linear", "input", "b")) == 3
    assert seen.count(QuantizerRole("linear", "input", "a")) == 1
    # a's grad_output, b's grad_input slot (a consumes it) and a's grad_input (the default)
    assert seen.count(QuantizerRole("linear", "grad_output", "a")) == 3
    assert seen.count(QuantizerRole("linear", "grad_output", "b")) == 1


# ---- hand-off of quantized tensors ----


class QuantizeSpy:
    """Records the shape of every top-level Quantizer.quantize call."""

    def __init__(self, monkeypatch):
        self.shapes: list[tuple[int, ...]] = []
        original = Quantizer.quantize

        def spy(quantizer, x):
            self.shapes.append(tuple(x.shape))
            return original(quantizer, x)

        monkeypatch.setattr(Quantizer, "quantize", spy)
        monkeypatch.setattr(Quantizer, "__call__", spy)


class ReceivedSpy:
    """Records what each GEMM op's fuser_forward / fuser_backward receives."""

    def __init__(self, monkeypatch):
        self.forward, self.backward = {}, {}
        forward, backward = ops.GemmOperation.fuser_forward, ops.GemmOperation.fuser_backward

        def spy_forward(op, ctx, x, **kwargs):
            self.forward[op.name] = x
            return forward(op, ctx, x, **kwargs)

        def spy_backward(op, ctx, dy):
            self.backward[op.name] = dy
            return backward(op, ctx, dy)

        monkeypatch.setattr(ops.GemmOperation, "fuser_forward", spy_forward)
        monkeypatch.setattr(ops.GemmOperation, "fuser_backward", spy_backward)


@pytest.mark.parametrize("kind", ["current", "mxfp8"])
def test_quantized_tensors_are_handed_along(kind, monkeypatch):
    recipe = RECIPES[kind]
    seq, stack, _ = build_pair()
    x, dy = data(70)
    quantize_spy = QuantizeSpy(monkeypatch)
    step(stack, recipe, x, dy)
    module_calls = sorted(quantize_spy.shapes)
    quantize_spy.shapes.clear()
    received = ReceivedSpy(monkeypatch)
    step(seq, recipe, x, dy)
    # as many quantize calls as the modules make: nobody quantizes twice
    assert sorted(quantize_spy.shapes) == module_calls
    rows = LEAD[0] * LEAD[1]
    assert quantize_spy.shapes.count((rows, FFN)) == 2  # fc2's input (by GELU), fc1's dy
    # fc2 got GELU's output quantized, fc1 got its input from LayerNorm quantized
    for name in ("fc1", "fc2"):
        assert isinstance(received.forward[name], ops.QuantizedActivation)
        assert isinstance(received.backward[name], ops.QuantizedActivation)  # by the Bias
    storage = received.forward["fc2"].storage
    assert storage.has_rowwise() or storage.has_columnwise()
    assert received.forward["fc2"].shape == (*LEAD, FFN)


def test_gemm_op_hands_its_dgrad_to_the_previous_gemm_op(monkeypatch):
    recipe = RECIPES["mxfp8"]
    seq = ops.Sequential(ops.BasicLinear(HID, HID, name="a"), ops.BasicLinear(HID, HID, name="b"))
    received = ReceivedSpy(monkeypatch)
    x, dy = data(71)
    step(seq, recipe, x, dy)
    assert isinstance(received.forward["b"], ops.QuantizedActivation)
    handed = received.backward["a"]
    assert isinstance(handed, ops.QuantizedActivation)
    assert handed.storage.has_rowwise() and handed.storage.has_columnwise()  # dgrad + wgrad
    # an input without a gradient: a runs no dgrad, so b hands only the columnwise copy
    with mf.autocast(recipe=recipe):
        y = seq(x)
    y.backward(dy)
    mf.update_delayed_backward_scales()  # backward slots update at the next entry
    handed = received.backward["a"]
    assert not handed.storage.has_rowwise() and handed.storage.has_columnwise()
    assert received.forward["b"].storage.has_columnwise()  # b's wgrad copy, saved and used
    # without autocast nothing is quantized
    step(seq, None, x, dy)
    assert isinstance(received.forward["b"], torch.Tensor)
    assert isinstance(received.backward["a"], torch.Tensor)


def test_no_grad_forward_matches_and_quantizes_no_columnwise_copy(monkeypatch):
    recipe = RECIPES["mxfp8"]
    seq, stack, _ = build_pair()
    x, _ = data(72)
    received = ReceivedSpy(monkeypatch)
    with torch.no_grad(), mf.autocast(recipe=recipe):
        y_a, y_b = seq(x), stack(x)
    assert_bitwise_equal(y_a, y_b, "y")
    assert not received.forward["fc2"].storage.has_columnwise()


# ---- checkpoint, main_grad, quantized_model_init ----


@pytest.mark.parametrize("kind", ["current", "delayed", "nvfp4"])
def test_checkpoint_gives_identical_gradients(kind):
    recipe = RECIPES[kind]
    seq_a, _, _ = build_pair(seed=4)
    seq_b, _, _ = build_pair(seed=4)
    for index in range(3):
        x, dy = data(80 + index)
        y_a, dx_a = step(seq_a, recipe, x, dy)
        x_b = x.clone().requires_grad_(True)
        with mf.autocast(recipe=recipe):
            y_b = mf.checkpoint(seq_b, x_b)
        y_b.backward(dy)
        mf.update_delayed_backward_scales()  # backward slots update at the next entry
        assert_bitwise_equal(y_a, y_b.detach(), "y")
        assert_bitwise_equal(dx_a, x_b.grad, "dx")
        for mine, theirs in zip(seq_a.parameters(), seq_b.parameters(), strict=True):
            assert_bitwise_equal(mine.grad, theirs.grad, "param grad")
            mine.grad = theirs.grad = None
    if kind == "delayed":
        for index in (1, 4):
            for mine, theirs in zip(seq_a[index].recipe_states(recipe),
                                    seq_b[index].recipe_states(recipe), strict=True):
                assert_bitwise_equal(mine.amax_history, theirs.amax_history, "amax history")
                assert_bitwise_equal(mine.scale, theirs.scale, "scale")


@pytest.mark.parametrize("kind", ["mxfp8", "current"])
def test_main_grad_accumulates(kind):
    recipe = RECIPES[kind]
    seq, stack, _ = build_pair()
    for op, module in ((seq[1], stack.fc1), (seq[4], stack.fc2)):
        op.weight.main_grad = torch.zeros_like(op.weight)
        module.weight.main_grad = torch.zeros_like(module.weight)
    for index in range(2):
        x, dy = data(90 + index)
        step(seq, recipe, x, dy)
        step(stack, recipe, x, dy)
    for op, module in ((seq[1], stack.fc1), (seq[4], stack.fc2)):
        assert op.weight.grad is None
        assert_bitwise_equal(op.weight.main_grad, module.weight.main_grad, "main_grad")
        assert op.weight.main_grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["mxfp8", "nvfp4", "hybrid", "delayed"])
def test_quantized_model_init_weights(kind):
    recipe = RECIPES[kind]
    with mf.quantized_model_init(recipe=recipe):
        torch.manual_seed(5)
        fc = mf.Linear(HID, HID, bias=False)
        torch.manual_seed(5)
        seq = ops.Sequential(ops.GELU(), ops.BasicLinear(HID, HID))
    assert isinstance(seq[1].weight, mf.QuantizedTensor)
    assert_bitwise_equal(seq[1].weight.dequantize(), fc.weight.dequantize(), "initial weight")
    x, dy = data(95)
    y_a, dx_a = step(seq, recipe, x, dy)
    x_b = x.clone().requires_grad_(True)
    with mf.autocast(recipe=recipe):
        y_b = fc(F.gelu(x_b))
    y_b.backward(dy)
    mf.update_delayed_backward_scales()  # backward slots update at the next entry
    assert_bitwise_equal(y_a, y_b.detach(), "y")
    assert_bitwise_equal(dx_a, x_b.grad, "dx")
    assert_bitwise_equal(seq[1].weight.grad, fc.weight.grad, "dw")


def test_sequential_rejects_repeated_and_foreign_ops():
    gelu = ops.GELU()
    with pytest.raises(ValueError, match="twice"):
        ops.Sequential(gelu, gelu)
    with pytest.raises(TypeError, match="fusible"):
        ops.Sequential(nn.GELU())
    inner = ops.Sequential(ops.GELU(), ops.ReLU())
    assert len(ops.Sequential(inner, ops.Bias(4))) == 3


@pytest.mark.parametrize("kind", ["current", "mxfp8"])
def test_backward_frees_the_saved_copies_while_the_graph_lives(kind):
    """As for the modules: the graph object outlives backward in a training loop (the last loss
    is kept), so the quantized copies the ops saved must go when backward is done."""
    import gc
    import weakref

    seq, _, pairs = build_pair()
    x, dy = data(3)
    x.requires_grad_(True)
    params = {id(p) for p, _ in pairs}
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t,
                                                  lambda t: t), \
            mf.autocast(recipe=RECIPES[kind]):
        y = seq(x)
    copies = [weakref.ref(t) for t in packed
              if t is not x and id(t) not in params and t.element_size() == 1]
    packed.clear()
    assert copies
    y.backward(dy)
    gc.collect()
    assert y.grad_fn is not None
    assert all(ref() is None for ref in copies)
