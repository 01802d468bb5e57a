"""The lean grouped FP8 path of FusedExperts (modules/lean_grouped_fp8.py) against the general
path and an independent reference.

Without a GPU the path is widened to the CPU (lean_fp8.DEVICES) and FusedExperts is told it is on
a fast-GEMM device (rows padded per expert to 16, as on CUDA); its grouped GEMM is then the
per-expert loop of torch._scaled_mm (torch._scaled_grouped_mm is CUDA-only: the GPU tests compare
the two). Checked here: what it decides and keeps, that the quantized bytes it saves equal the
general path's, and that outputs and gradients equal the reference's within summation order.
"""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from minifloat.modules import gemm_op, lean_fp8, lean_grouped_fp8
from minifloat.modules.lean_grouped_fp8 import LeanGroupedFP8
from minifloat.numerics.per_tensor import dequantize_per_tensor, quantize_current_scaling
from modules.test_any_token_count import fused_experts
from training._reference import rel_err

CURRENT = mf.Float8CurrentScaling()


@pytest.fixture
def on_cpu(monkeypatch):
    """Let the lean paths serve CPU tensors with CUDA's row padding; count grouped calls."""
    monkeypatch.setattr(lean_fp8, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(gemm_op, "on_fast_gemm_device", lambda _x: True)
    calls = []
    original = LeanGroupedFP8.forward

    def counting(ctx, x, counts, *args):
        calls.append(counts)
        return original(ctx, x, counts, *args)

    monkeypatch.setattr(LeanGroupedFP8, "forward", staticmethod(counting))
    return calls


def routed(tokens=40, hidden=32, experts=4, seed=0, empty_expert=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    if empty_expert is not None:  # route nothing to it
        index[index == empty_expert] = (empty_expert + 1) % experts
        index[:, 1] = torch.where(index[:, 1] == index[:, 0], (index[:, 0] + 2) % experts,
                                  index[:, 1])
    weights = torch.rand(tokens, 2, generator=g)
    dy = torch.randn(tokens, hidden, generator=g)
    return x, index, weights, dy


def run(experts, x, index, weights, dy, recipe=CURRENT):
    x = x.clone().requires_grad_(True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t,
                                                  lambda t: t), mf.autocast(recipe=recipe):
        y = experts(x, index, weights)
    y.backward(dy)
    fp8 = [t for t in packed if t.element_size() == 1]
    grads = [p.grad.clone() for p in experts.parameters()]
    experts.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads, fp8


@pytest.mark.parametrize("empty_expert", [None, 2])
def test_grouped_path_equals_the_general_path(on_cpu, monkeypatch, empty_expert):
    torch.manual_seed(0)
    experts = fused_experts(4, 32, 48)
    inputs = routed(empty_expert=empty_expert)
    y, dx, grads, saved = run(experts, *inputs)
    assert len(on_cpu) == 2, "both grouped GEMMs (gate_up, down) take the lean grouped path"
    assert all(count % 16 == 0 for counts in on_cpu for count in counts)
    if empty_expert is not None:
        assert on_cpu[0][empty_expert] == 0
    monkeypatch.setattr(lean_fp8, "ENABLED", False)
    y_g, dx_g, grads_g, saved_g = run(experts, *inputs)
    assert len(on_cpu) == 2
    # the general path keeps each expert's input columnwise copy; the grouped path the same
    # bytes, stacked: one buffer per grouped GEMM
    general = torch.cat([t.reshape(-1).view(torch.uint8) for t in saved_g])
    grouped = torch.cat([t.reshape(-1).view(torch.uint8) for t in saved])
    assert torch.equal(grouped, general)
    for got, want in ((y, y_g), (dx, dx_g), *zip(grads, grads_g, strict=True)):
        assert rel_err(got, want) < 1e-6


def test_forward_matches_dequantized_reference(on_cpu):
    """y of each expert's rows = dequant(q(x_e)) dequant(q(W_e))^T in float64, from numerics."""
    torch.manual_seed(1)
    experts = fused_experts(3, 32, 32)
    x = torch.randn(48, 32)
    counts = [16, 0, 32]
    weight = experts.gate_up_proj.detach()
    with mf.autocast(recipe=CURRENT):
        plan = lean_grouped_fp8.module_plan(experts, 0, 3)
        y = LeanGroupedFP8.apply(x, tuple(counts), plan, False, False, weight)
    e4m3 = torch.float8_e4m3fn
    start = 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        start += count
        if not count:
            continue
        xq, xs = quantize_current_scaling(x[rows], e4m3)
        wq, ws = quantize_current_scaling(weight[e], e4m3)
        want = (dequantize_per_tensor(xq, xs).double()
                @ dequantize_per_tensor(wq, ws).double().t())
        assert rel_err(y[rows], want) < 1e-6


def test_cases_left_to_the_general_path(on_cpu):
    torch.manual_seed(0)
    experts = fused_experts(4, 32, 48)
    inputs = routed()
    run(experts, *inputs, recipe=mf.Float8BlockScaling())  # another format
    assert on_cpu == []
    with torch.no_grad(), mf.autocast(recipe=CURRENT), mf.quantize_weights_once():
        experts(*inputs[:3])
    assert on_cpu == []
    x = torch.randn(40, 32)
    w3d = experts.gate_up_proj
    assert lean_grouped_fp8.applies(x[:32], (w3d,), [16, 16, 0, 0])
    assert not lean_grouped_fp8.applies(x[:32], (w3d,), [16, 16])  # 2 counts for 4 experts
    assert not lean_grouped_fp8.applies(x[:24], (w3d,), [16, 8, 0, 0])  # a block of 8 rows
    assert not lean_grouped_fp8.applies(x[:32].t().contiguous().t(), (w3d,), [16, 16, 0, 0])
    assert not lean_grouped_fp8.applies(x[:32], (w3d[:, :, :16],), [16, 16, 0, 0])
    separate = tuple(w3d.detach()[e].clone() for e in range(4))
    assert lean_grouped_fp8.applies(x[:32], separate, [16, 16, 0, 0])
    assert not lean_grouped_fp8.applies(x[:32], separate[:3] + (separate[3][:16],),
                                        [16, 16, 0, 0])  # weights of unequal shapes


def test_grouped_path_is_cuda_only_by_default():
    assert lean_fp8.DEVICES == ("cuda",)


def test_backward_keeps_no_rowwise_copy(on_cpu):
    """What forward leaves for backward: the inputs' and weights' columnwise bytes and the
    scales, not the rowwise weight bytes that only forward's GEMM reads."""
    torch.manual_seed(0)
    experts = fused_experts(4, 32, 48)
    x = torch.randn(64, 32, requires_grad=True)
    weight = experts.gate_up_proj
    with mf.autocast(recipe=CURRENT):
        plan = lean_grouped_fp8.module_plan(experts, 0, 4)
        y = LeanGroupedFP8.apply(x, (16, 16, 0, 32), plan, True, True, weight)
    w_t, scales = y.grad_fn.weight_copy
    assert scales.data is None and scales.data_t is None
    assert w_t.numel() == weight.numel() and w_t.element_size() == 1
    y.sum().backward()
    assert x.grad is not None and weight.grad is not None


def test_grouped_linear_takes_the_grouped_path_and_equals_the_general_path(on_cpu,
                                                                           monkeypatch):
    """TransformerEngine's GroupedLinear (one weight per expert, no bias), splits of whole
    16-row groups, one of them empty: the grouped path, with the general path's kept bytes and
    results, and one gradient per weight (zero for the empty split)."""
    torch.manual_seed(0)
    layer = mf.GroupedLinear(3, 32, 48, bias=False)
    x = torch.randn(2, 32, 32)  # 64 rows over the splits
    dy = torch.randn(2, 32, 48)
    splits = [32, 0, 32]

    def run_layer():
        xi = x.clone().requires_grad_(True)
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t,
                                                      lambda t: t), mf.autocast(recipe=CURRENT):
            y = layer(xi, splits)
        y.backward(dy)
        grads = [w.grad.clone() for w in layer.weights]
        layer.zero_grad(set_to_none=True)
        return y.detach(), xi.grad, grads, [t for t in packed if t.element_size() == 1]

    y, dx, grads, saved = run_layer()
    assert on_cpu == [(32, 0, 32)] and y.shape == (2, 32, 48)
    assert torch.count_nonzero(grads[1]) == 0
    monkeypatch.setattr(lean_fp8, "ENABLED", False)
    y_g, dx_g, grads_g, saved_g = run_layer()
    assert len(on_cpu) == 1
    assert torch.equal(torch.cat([t.reshape(-1).view(torch.uint8) for t in saved]),
                       torch.cat([t.reshape(-1).view(torch.uint8) for t in saved_g]))
    for got, want in ((y, y_g), (dx, dx_g), *zip(grads, grads_g, strict=True)):
        assert rel_err(got, want) < 1e-6 or (got.abs().max() == want.abs().max() == 0)
    # a split of 8 rows, or biases, keep the general path
    monkeypatch.setattr(lean_fp8, "ENABLED", True)
    with mf.autocast(recipe=CURRENT):
        layer(torch.randn(40, 32), [32, 8, 0])
        mf.GroupedLinear(3, 32, 48)(torch.randn(48, 32), [16, 16, 16])
    assert len(on_cpu) == 1


def test_delayed_scaling_takes_the_grouped_path_and_records_the_general_amaxes(on_cpu,
                                                                               monkeypatch):
    """DelayedScaling: each expert's operands cast with its own recipe-state slots. Over three
    steps (scales updated from the recorded amaxes at each autocast entry) the amax histories
    of the operands no GEMM result feeds (gate_up's inputs, every weight, down_proj's incoming
    gradients) equal the general path's bit for bit; the others (down_proj's inputs, gate_up's
    gradients: GEMM outputs, whose summation order differs between the two paths' GEMMs) and
    the scales agree to fp32 rounding, and so do the results."""
    recipe = mf.DelayedScaling()
    torch.manual_seed(0)
    grouped = fused_experts(4, 32, 48)
    general = fused_experts(4, 32, 48)
    general.load_state_dict(grouped.state_dict())
    results = {}
    for name, module, enabled in (("grouped", grouped, True), ("general", general, False)):
        monkeypatch.setattr(lean_fp8, "ENABLED", enabled)
        outputs = []
        for step in range(3):
            outputs.append(run(module, *routed(seed=step), recipe=recipe)[:3])
        mf.update_delayed_backward_scales()
        forward, backward = module.recipe_states(recipe)
        results[name] = (outputs, [t.clone() for t in forward.state_tensors()
                                   + backward.state_tensors()])
    assert len(on_cpu) == 6  # 3 steps x (gate_up, down), all on the grouped path
    (outputs, states), (outputs_g, states_g) = results["grouped"], results["general"]
    assert states and len(states) == len(states_g)
    for got, want in zip(states, states_g, strict=True):
        assert rel_err(got, want) < 1e-6
    experts = 4  # forward slots: 3 per GEMM (input, weight, output), backward 2 (grad_output,
    #              grad_input); GEMMs 0-3 gate_up, 4-7 down_proj
    exact_forward = [3 * g for g in range(experts)] + [3 * g + 1 for g in range(2 * experts)]
    exact_backward = [2 * g for g in range(experts, 2 * experts)]
    histories = [(got, want) for got, want in zip(states, states_g, strict=True)
                 if got.dim() == 2]
    (forward, forward_g), (backward, backward_g) = histories
    assert torch.equal(forward[:, exact_forward], forward_g[:, exact_forward])
    assert torch.equal(backward[:, exact_backward], backward_g[:, exact_backward])
    assert torch.count_nonzero(forward[:, exact_forward]) > 0  # amaxes were recorded
    for (y, dx, grads), (y_g, dx_g, grads_g) in zip(outputs, outputs_g, strict=True):
        for got, want in ((y, y_g), (dx, dx_g), *zip(grads, grads_g, strict=True)):
            assert rel_err(got, want) < 1e-6
