"""Delayed scaling on the device-offsets experts (modules/grouped_offsets_delayed.py), CPU.

Against the host-count path's general GEMMs (one Float8Quantizer per expert slot): the
outputs, the gradients and the recipe state (scales and amax histories, forward and backward)
after three steps (the forward state bitwise); the memory options against the default
path's steps; the cases the path leaves to the host-count path. (A compiled Mixtral under
DelayedScaling in one graph: test_grouped_offsets.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch

import minifloat as mf
from minifloat.modules import fused_experts as fused_experts_module
from minifloat.modules.grouped_offsets_delayed import GroupedOffsetsDelayed
from modules.test_any_token_count import fused_experts
from modules.test_grouped_offsets import counting_calls
from modules.test_lean_grouped_fp8 import routed
from training._reference import rel_err

RECIPE = mf.DelayedScaling(amax_history_len=4)


@pytest.fixture
def delayed_calls(monkeypatch):
    return counting_calls(monkeypatch, GroupedOffsetsDelayed)


def three_steps(experts, mode, recipe=RECIPE, hidden=128):
    """Outputs and gradients of three steps, then the module's recipe-state tensors. (Each
    module's steps run back to back: autocast's round at the next exit updates the backward
    states noted in the previous one.)"""
    results = []
    for seed in range(3):
        x, index, weights, dy = routed(tokens=40, hidden=hidden, experts=4, seed=seed)
        x.requires_grad_(True)
        with fused_experts_module.offsets_mode(mode), mf.autocast(recipe=recipe):
            y = experts(x, index, weights)
        y.backward(dy)
        results += [y.detach(), x.grad, *(p.grad.clone() for p in experts.parameters())]
        experts.zero_grad(set_to_none=True)
    forward, backward = experts._recipe_states[recipe]
    state = [forward.scale, forward.amax_history, backward.scale, backward.amax_history]
    return results, [t.clone() for t in state]


@pytest.mark.parametrize("fp8_format", [mf.Format.HYBRID, mf.Format.E4M3])
def test_delayed_device_offsets_equal_the_general_path_and_its_state(delayed_calls,
                                                                     fp8_format):
    recipe = mf.DelayedScaling(amax_history_len=4, fp8_format=fp8_format)
    torch.manual_seed(0)
    experts = fused_experts(4, 128, 64)  # N: gate_up 128, down 128 (whole 128s)
    general = copy.deepcopy(experts)
    got, got_state = three_steps(experts, "always", recipe)
    assert len(delayed_calls) == 6, "both grouped GEMMs of every step on device offsets"
    want, want_state = three_steps(general, "never", recipe)
    assert len(delayed_calls) == 6
    # the GEMMs sum in their own orders (bitwise alike on the CPU's reference, within fp32
    # roundings under the Triton interpreter's kernels); the forward state's maxima are of
    # the same inputs and weights, so exact
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-5
    assert torch.equal(got_state[0], want_state[0]) and torch.equal(got_state[1], want_state[1])
    for a, b in zip(got_state[2:], want_state[2:], strict=True):
        assert rel_err(a, b) < 1e-5
    assert got_state[3][0].gt(0).any(), "backward amaxes recorded"


@pytest.mark.parametrize("option", ["rebuild", "save_original", "both"])
def test_memory_options_give_the_same_steps_and_state(delayed_calls, option):
    """rebuild_weight_copies_in_backward / save_original_inputs on the delayed device path:
    backward casts the weights' (x's) columnwise copies again with forward's scales, recording
    nothing, so three steps give the default's outputs, gradients and recipe state bit for bit
    (the state's scales change between forward and backward: a rebuild with the updated scale
    would differ), while fewer FP8 bytes are kept from forward to backward."""
    torch.manual_seed(0)
    experts = fused_experts(4, 128, 64)
    optioned = copy.deepcopy(experts)
    if option in ("rebuild", "both"):
        mf.rebuild_weight_copies_in_backward(optioned)
    if option in ("save_original", "both"):
        mf.save_original_inputs(optioned)
    kept = {}
    for name, module in (("default", experts), ("optioned", optioned)):
        sizes: list[int] = []

        def pack(t: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            kept[name] = three_steps(module, "always")
        kept[name] = (*kept[name], sum(sizes))
    assert len(delayed_calls) == 12
    (want, want_state, want_bytes), (got, got_state, got_bytes) = kept.values()
    for a, b in zip(got + got_state, want + want_state, strict=True):
        assert torch.equal(a, b)
    weights = sum(p.numel() for p in experts.parameters())
    if option == "both":
        assert got_bytes == 0, "no FP8 copy kept from forward to backward"
    else:  # a byte per weight element, or per element of x's rows (more than the weights here)
        assert want_bytes - got_bytes >= weights


def test_shapes_and_recompute_it_does_not_serve_keep_the_host_counts_path(delayed_calls):
    torch.manual_seed(0)
    three_steps(fused_experts(4, 32, 48), "always", hidden=32)  # N 96 and 32: not whole 128s
    experts = fused_experts(4, 128, 64)
    x, index, weights, dy = routed(tokens=40, hidden=128, experts=4)
    with fused_experts_module.offsets_mode("always"), mf.autocast(recipe=RECIPE):
        y = mf.checkpoint(experts, x.requires_grad_(True), index, weights)
    y.backward(dy)
    assert delayed_calls == [], "inside checkpoint's recompute: the host-count path"
