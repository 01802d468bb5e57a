"""Modules on CUDA against the same modules on the CPU (the numerics reference path).

The CUDA path quantizes with the Triton kernels (one multi-tensor launch for GroupedLinear's
splits, the one-launch delayed-scaling update) and multiplies through scaled matmul or bf16
cuBLAS; the CPU path runs minifloat.numerics. Quantized bytes are bit-exact across the two, so
outputs and gradients differ only by GEMM summation order (one bf16 rounding), while
delayed-scaling state (scales and amax histories, updated over several steps) must be equal bit
for bit.
"""

from __future__ import annotations

import pytest
import torch

import minifloat as mf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

RECIPES = {
    "current": mf.Float8CurrentScaling(),
    "delayed": mf.DelayedScaling(),
    "block": mf.Float8BlockScaling(),
    "mxfp8": mf.MXFP8BlockScaling(),
    "nvfp4": mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def run_both(build, forward, inputs, recipe, steps=1):
    """Build the module on each device from one state dict, run `steps` steps of forward and
    backward; returns per device (outputs, input grads, parameter grads, module)."""
    torch.manual_seed(3)
    cpu = build("cpu")
    gpu = build("cuda")
    gpu.load_state_dict(cpu.state_dict())
    results = []
    for module, device in ((cpu, "cpu"), (gpu, "cuda")):
        for _ in range(steps):
            module.zero_grad(set_to_none=True)
            xs = [t.to(device).detach().requires_grad_() for t in inputs]
            with mf.autocast(recipe=recipe):
                y = forward(module, *xs)
            y.backward(torch.ones_like(y) / y.numel() ** 0.5)
        # delayed scaling applies backward amaxes at the next autocast entry: apply them now,
        # so the other device's first entry does not (and this module's last step counts)
        mf.update_delayed_backward_scales()
        grads = [p.grad.float().cpu() for p in module.parameters() if p.grad is not None]
        results.append((y.detach().float().cpu(), [x.grad.float().cpu() for x in xs], grads,
                        module))
    return results


def assert_close(cpu_result, gpu_result, tolerance=5e-3):
    (y_c, dx_c, dw_c, _), (y_g, dx_g, dw_g, _) = cpu_result, gpu_result
    assert relative_error(y_g, y_c) < tolerance, "y"
    for a, b in zip(dx_g, dx_c, strict=True):
        assert relative_error(a, b) < tolerance, "dx"
    assert len(dw_g) == len(dw_c)
    for a, b in zip(dw_g, dw_c, strict=True):
        assert relative_error(a, b) < tolerance, "parameter grad"


@pytest.mark.parametrize("kind", list(RECIPES))
def test_grouped_linear_uneven_and_empty_splits(kind):
    splits = [128, 0, 256, 128]  # the multi-tensor launch serves the three busy experts

    def build(device):
        return mf.GroupedLinear(4, 256, 128, params_dtype=torch.bfloat16, device=device)

    x = torch.randn(sum(splits), 256, dtype=torch.bfloat16)
    cpu, gpu = run_both(build, lambda m, x: m(x, splits), [x], RECIPES[kind])
    assert_close(cpu, gpu)


@pytest.mark.parametrize("kind", list(RECIPES))
def test_layernorm_mlp_swiglu(kind):
    def build(device):
        return mf.LayerNormMLP(256, 512, activation="swiglu", normalization="RMSNorm",
                               params_dtype=torch.bfloat16, device=device)

    x = torch.randn(2, 128, 256, dtype=torch.bfloat16)
    cpu, gpu = run_both(build, lambda m, x: m(x), [x], RECIPES[kind])
    # Two quantized GEMMs in a chain: fc1's output differs across devices by GEMM summation
    # order (one bf16 ulp), and requantizing it for fc2 (3 mantissa bits in E4M3) turns some of
    # those ulps into whole FP8 steps; measured on an H200 5.1e-3 to 6.1e-3 for the FP8 recipes
    # (the one-GEMM modules stay under 5e-3), so the chain gets twice the one-GEMM bound.
    assert_close(cpu, gpu, tolerance=1e-2)


def test_delayed_scaling_state_is_bit_exact_across_devices_over_steps():
    """The GPU's one-launch history roll and rescale equals numerics' update, step after step
    (a 4-row history, so the roll wraps)."""
    recipe = mf.DelayedScaling(amax_history_len=4)

    def build(device):
        return mf.Linear(256, 128, params_dtype=torch.bfloat16, device=device)

    x = torch.randn(256, 256, dtype=torch.bfloat16)
    cpu, gpu = run_both(build, lambda m, x: m(x), [x], recipe, steps=6)
    assert_close(cpu, gpu)
    for state_cpu, state_gpu in zip(cpu[3].recipe_states(recipe), gpu[3].recipe_states(recipe),
                                    strict=True):
        for name in ("scale", "amax_history"):
            a = getattr(state_cpu, name).view(torch.int32)
            b = getattr(state_gpu, name).cpu().view(torch.int32)
            assert torch.equal(a, b), f"{name} differs between devices"


@pytest.mark.parametrize("rebuild", [False, True], ids=["keep", "rebuild"])
@pytest.mark.parametrize("recipe_kind", ["current", "delayed"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("module_kind", ["linear", "layernorm_linear", "layernorm_mlp"])
def test_lean_fp8_path_equals_general_path_bitwise(module_kind, bias, recipe_kind, rebuild,
                                                   monkeypatch):
    """modules/lean_fp8.py makes the kernel and scaled_mm calls of the general path (LinearGemms)
    with the same arguments: outputs, gradients and updated weights equal bit for bit, over
    three SGD steps (the weights change, so each forward quantizes new ones)."""
    import copy

    from minifloat.modules import lean_fp8

    builders = {
        "linear": lambda: mf.Linear(256, 384, bias=bias, params_dtype=torch.bfloat16,
                                    device="cuda"),
        "layernorm_linear": lambda: mf.LayerNormLinear(256, 384, bias=bias,
                                                       normalization="RMSNorm",
                                                       params_dtype=torch.bfloat16,
                                                       device="cuda"),
        "layernorm_mlp": lambda: mf.LayerNormMLP(256, 512, bias=bias, params_dtype=torch.bfloat16,
                                                 device="cuda"),
    }
    torch.manual_seed(0)
    lean = builders[module_kind]()
    general = copy.deepcopy(lean)
    lean.rebuild_weight_copy_in_backward = rebuild  # FSDP2's setting: cast again in backward
    calls = []
    original = lean_fp8.LeanFP8Gemm.forward
    monkeypatch.setattr(lean_fp8.LeanFP8Gemm, "forward",
                        staticmethod(lambda ctx, *a: calls.append(1) or original(ctx, *a)))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (lean, general)]
    for step in range(3):
        x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(2, 128, 384 if module_kind != "layernorm_mlp" else 256,
                         device="cuda", dtype=torch.bfloat16)
        results = []
        for module, optimizer, enabled in ((lean, optimizers[0], True),
                                           (general, optimizers[1], False)):
            monkeypatch.setattr(lean_fp8, "ENABLED", enabled)
            xi = x.clone().requires_grad_(True)
            with mf.autocast(recipe=RECIPES[recipe_kind]):
                y = module(xi)
            y.backward(dy)
            mf.update_delayed_backward_scales()
            results.append([y.detach(), xi.grad] + [p.grad.clone() for p in module.parameters()])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b), f"step {step}"
    assert len(calls) == 3 * (2 if module_kind == "layernorm_mlp" else 1)
    recipe = RECIPES[recipe_kind]
    for mine, theirs in zip(lean.recipe_states(recipe), general.recipe_states(recipe),
                            strict=True):  # delayed scaling: scales and amax histories
        for a, b in zip(mine.state_tensors(), theirs.state_tensors(), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("rebuild", [False, True], ids=["keep", "rebuild"])
def test_lean_fp8_path_on_quantized_weights_equals_general_path_bitwise(rebuild, monkeypatch):
    """A QuantizedTensor FP8 weight (quantized_model_init here; FSDP2's FP8 all-gather hands
    the module the same kind each step): the lean path reads its bytes and derives the transpose
    as the general path does, so outputs and gradients equal bit for bit."""
    import copy

    from minifloat.modules import lean_fp8

    recipe = RECIPES["current"]
    torch.manual_seed(0)
    with mf.quantized_model_init(recipe=recipe):
        lean = mf.Linear(256, 384, params_dtype=torch.bfloat16, device="cuda")
    general = copy.deepcopy(lean)
    lean.rebuild_weight_copy_in_backward = general.rebuild_weight_copy_in_backward = rebuild
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2, 128, 384, device="cuda", dtype=torch.bfloat16)
    results = []
    for module, enabled in ((lean, True), (general, False)):
        monkeypatch.setattr(lean_fp8, "ENABLED", enabled)
        xi = x.clone().requires_grad_(True)
        with mf.autocast(recipe=recipe):
            y = module(xi)
        results.append(type(y.grad_fn).__name__)
        y.backward(dy)
        results.append([y.detach(), xi.grad] + [p.grad.clone() for p in module.parameters()])
    assert "Lean" in results[0] and "Lean" not in results[2]
    for a, b in zip(results[1], results[3], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["current", "delayed", "block"])
def test_ragged_rows_run_the_fast_gemms_not_emulation(kind, monkeypatch):
    """A token count that is no multiple of 16 (128 for block FP8): the rows are padded on CUDA
    so forward, dgrad and wgrad all run on scaled_mm; nothing is decoded and emulated (an
    unpadded Mixtral expert GEMM was, 2.5x slower than bf16); results agree with the CPU."""
    from minifloat import gemm_paths

    if kind == "block" and not gemm_paths._HAS_BLOCKWISE_SCALED_MM:
        pytest.skip("this torch has no blockwise scaled_mm")
    emulated = []
    original = gemm_paths.bf16_gemm

    def counting(a, *args, **kwargs):
        if a.is_cuda:
            emulated.append(1)
        return original(a, *args, **kwargs)

    monkeypatch.setattr(gemm_paths, "bf16_gemm", counting)
    inputs = [torch.randn(2, 1001, 256)]
    cpu, gpu = run_both(lambda device: mf.Linear(256, 512, device=device),
                        lambda module, x: module(x), inputs, RECIPES[kind])
    assert emulated == []
    assert_close(cpu, gpu)


def test_fused_experts_run_every_expert_gemm_on_scaled_mm(monkeypatch):
    from minifloat import gemm_paths
    from modules.test_any_token_count import fused_experts

    experts = fused_experts(8, 256, 256, device="cuda")
    emulated, scaled = [], []
    original_bf16, original_scaled = gemm_paths.bf16_gemm, torch._scaled_mm
    monkeypatch.setattr(gemm_paths, "bf16_gemm",
                        lambda *a, **k: (emulated.append(1), original_bf16(*a, **k))[1])
    monkeypatch.setattr(torch, "_scaled_mm",
                        lambda *a, **k: (scaled.append(1), original_scaled(*a, **k))[1])
    hidden = torch.randn(999, 256, device="cuda", requires_grad=True)
    index = torch.randint(0, 8, (999, 2), device="cuda")
    weights = torch.rand(999, 2, device="cuda")
    # delayed scaling takes the general path: one _scaled_mm per expert GEMM and direction
    # (current scaling's grouped path: tests/gpu/test_lean_grouped_cuda.py)
    with mf.autocast(recipe=RECIPES["delayed"]):
        out = experts(hidden, index, weights)
    out.float().pow(2).sum().backward()
    assert emulated == [] and len(scaled) == 2 * 8 * 3  # two GEMMs per expert: fprop, dgrad, wgrad
    assert torch.isfinite(hidden.grad).all()
