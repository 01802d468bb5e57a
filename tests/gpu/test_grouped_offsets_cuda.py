"""FusedExperts on device-side group offsets on CUDA (modules/grouped_offsets.py,
kernels/grouped_gemm.py) against the general path, without a host synchronisation, and
compiled by inductor with fullgraph=True.

The device path quantizes the bytes the general path quantizes (the CPU tests check them bit
for bit); here its GEMMs are the Triton grouped kernels (E5M2 gradients included) against one
_scaled_mm per expert, so outputs agree to summation order and gradients to E5M2's resolution.
"""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from gpu.test_lean_grouped_cuda import relative_error
from gpu.test_lean_grouped_cuda import routed as routed_tokens
from minifloat.modules import fused_experts as fused_experts_module
from modules.test_any_token_count import fused_experts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HYBRID = mf.Float8CurrentScaling()
E4M3 = mf.Float8CurrentScaling(fp8_format=mf.Format.E4M3)
MXFP8 = mf.MXFP8BlockScaling()
BLOCK = mf.Float8BlockScaling()
# stochastic rounding off: its draws differ between the two paths (the CPU tests compare
# errors with it on)
NVFP4 = mf.NVFP4BlockScaling(disable_stochastic_rounding=True)


def routed(tokens, experts, hidden, empty_expert=None, seed=0):
    """(x, index, weights, dy): test_lean_grouped_cuda's routing and an upstream gradient."""
    x, index, weights = routed_tokens(tokens, experts, hidden, empty_expert, seed)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 100))
    return x, index, weights, dy.cuda()


def step(experts, x, index, weights, dy, recipe, mode):
    x = x.clone().to(torch.bfloat16).requires_grad_(True)
    with fused_experts_module.offsets_mode(mode), mf.autocast(recipe=recipe):
        y = experts(x, index, weights.to(torch.bfloat16))
    y.backward(dy.to(torch.bfloat16))
    grads = [p.grad.clone() for p in experts.parameters()]
    experts.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, *grads]


@pytest.mark.parametrize("recipe", [HYBRID, E4M3, MXFP8, BLOCK, NVFP4],
                         ids=["hybrid", "e4m3", "mxfp8", "block", "nvfp4"])
@pytest.mark.parametrize("empty_expert", [None, 3])
def test_device_offsets_equal_the_general_path(recipe, empty_expert):
    torch.manual_seed(0)
    experts = fused_experts(8, 256, 512, device="cuda").to(torch.bfloat16)
    inputs = routed(999, 8, 256, empty_expert)
    got = step(experts, *inputs, recipe, "always")
    want = step(experts, *inputs, recipe, "never")
    errors = [relative_error(a, b) for a, b in zip(got, want, strict=True)]
    # forward E4M3 x E4M3; the output and the gradients pass through the intermediate's FP8
    # cast, whose roundings flip where the two GEMMs' summation orders differ (block scaling's
    # general path sums each 128-deep block apart: 5.1e-3 measured on an H200; a wrong scale
    # or group gives errors of order 1)
    assert errors[0] < 1e-2, errors
    # (E5M2 gradients and NVFP4's 4-bit elements flip by more)
    assert max(errors[1:]) < (5e-2 if recipe in (HYBRID, NVFP4) else 1e-2), errors


@pytest.mark.parametrize("recipe", [HYBRID, MXFP8, NVFP4], ids=["hybrid", "mxfp8", "nvfp4"])
def test_no_host_synchronisation(recipe):
    torch.manual_seed(0)
    experts = fused_experts(8, 256, 512, device="cuda").to(torch.bfloat16)
    inputs = routed(640, 8, 256)
    step(experts, *inputs, recipe, "always")  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(experts, *inputs, recipe, "always")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(RuntimeError):  # the check is live: the host-counts path reads counts
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(experts, *inputs, recipe, "never")
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_inductor_fullgraph_equals_eager():
    """One grouped GEMM compiled by inductor computes eager's bytes and values bitwise (the
    casts are numerics' torch ops, the GEMMs opaque ops); the whole experts module within the
    flips of FP8 roundings, because inductor keeps act_fn(gate) * up in fp32 where eager
    rounds it to bf16 between the two ops. A second routing runs the same graph."""
    from minifloat.autocast import active_token
    from minifloat.modules.fused_experts import offsets_casts
    from minifloat.modules.grouped_offsets import GroupedOffsetsFP8, routing_layout

    torch.manual_seed(0)
    experts = fused_experts(8, 256, 512, device="cuda").to(torch.bfloat16)
    x, index, weights, dy = routed(999, 8, 256)
    layout = routing_layout(index, 8)
    with mf.autocast(recipe=HYBRID):
        casts = offsets_casts(experts.binding(active_token()).lean_plans)
    source = layout.pair_of_row // index.shape[1]  # the token of each row (999: padding)
    rows = torch.cat([x, x.new_zeros(1, 256)]).to(torch.bfloat16)[source]

    def one_gemm(inputs, weight):
        return GroupedOffsetsFP8.apply(inputs, weight, layout.ends, casts, True, True, False,
                                       False)

    results = []
    for fn in (one_gemm, torch.compile(one_gemm, fullgraph=True)):
        inputs = rows.clone().requires_grad_(True)
        weight = experts.gate_up_proj.detach().clone().requires_grad_(True)
        y = fn(inputs, weight)
        y.backward(torch.ones_like(y))
        results.append((y, inputs.grad, weight.grad))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)

    want = step(experts, x, index, weights, dy, HYBRID, "always")
    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True)
    got = step(compiled, x, index, weights, dy, HYBRID, "compiled")
    again = step(compiled, *routed(999, 8, 256, seed=1)[:3], dy, HYBRID, "compiled")
    assert all(torch.isfinite(t).all() for t in again)
    errors = [relative_error(a, b) for a, b in zip(got, want, strict=True)]
    assert max(errors) < 5e-2, errors


@pytest.mark.parametrize("recipe", [MXFP8, BLOCK, NVFP4], ids=["mxfp8", "block", "nvfp4"])
def test_block_formats_compile_with_fullgraph(recipe):
    """The block formats' device path (grouped_offsets_blocks.py) under inductor: one graph,
    values within FP8 rounding flips of eager (inductor keeps act_fn(gate) * up in fp32)."""
    torch.manual_seed(0)
    experts = fused_experts(8, 256, 512, device="cuda").to(torch.bfloat16)
    inputs = routed(999, 8, 256)
    want = step(experts, *inputs, recipe, "always")
    torch._dynamo.reset()
    got = step(torch.compile(experts, fullgraph=True), *inputs, recipe, "compiled")
    errors = [relative_error(a, b) for a, b in zip(got, want, strict=True)]
    assert max(errors) < 5e-2, errors


@pytest.mark.parametrize("fp8_format", [mf.Format.HYBRID, mf.Format.E4M3])
def test_delayed_device_offsets_against_the_general_path(fp8_format):
    """grouped_offsets_delayed.py on CUDA (the grouped cast kernel with the slots' scales, the
    Triton GEMMs) against the host-count path's general GEMMs, each on its own copy of the
    module for two steps: the forward recipe state bitwise (the same inputs and weights), the
    outputs, gradients and backward state within the GEMMs' summation order."""
    import copy

    recipe = mf.DelayedScaling(amax_history_len=4, fp8_format=fp8_format)
    torch.manual_seed(0)
    device_path = fused_experts(8, 256, 512, device="cuda").to(torch.bfloat16)
    general = copy.deepcopy(device_path)
    results = {}
    for module, mode in ((device_path, "always"), (general, "never")):
        outputs = []
        for seed in range(2):
            outputs += step(module, *routed(999, 8, 256, seed=seed), recipe, mode)
        forward, backward = module._recipe_states[recipe]
        results[mode] = (outputs, [forward.scale.clone(), forward.amax_history.clone(),
                                   backward.scale.clone(), backward.amax_history.clone()])
    (got, got_state), (want, want_state) = results["always"], results["never"]
    errors = [relative_error(a, b) for a, b in zip(got, want, strict=True)]
    assert max(errors) < (5e-2 if fp8_format == mf.Format.HYBRID else 1e-2), errors
    assert torch.equal(got_state[0], want_state[0])
    assert torch.equal(got_state[1], want_state[1])
    assert relative_error(got_state[3], want_state[3]) < 1e-2
