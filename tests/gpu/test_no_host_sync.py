"""The training path never waits for the GPU: no host synchronisation in a step (issue 7).

A host sync (`.item()`, a device-to-host copy, a blocking host-to-device copy of a small Python
value, `nonzero`) stalls the host until the GPU has drained its queue; in an eager step the GPU
then idles while Python issues the next kernels. torch.cuda.set_sync_debug_mode("error") turns
every synchronising CUDA call that torch makes into a RuntimeError, so a step that passes here
issued none. The first step runs outside the check (Triton compiles, caches fill, delayed-scaling
state is created); the second step, autocast exit (the delayed-scaling update) included, must
be free of syncs for every recipe and module.

Can fail: an `.item()` or `torch.tensor(python_value, device="cuda")` anywhere on the path
raises inside the checked step (test_check_catches_a_sync proves the check is live).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import minifloat as mf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

RECIPES = {
    "current": mf.Float8CurrentScaling(),
    "delayed": mf.DelayedScaling(),
    "block": mf.Float8BlockScaling(),
    "mxfp8": mf.MXFP8BlockScaling(),
    "nvfp4": mf.NVFP4BlockScaling(),
    "hybrid": mf.HybridRecipe(fprop=mf.MXFP8BlockScaling(), dgrad=mf.NVFP4BlockScaling(),
                              wgrad=mf.NVFP4BlockScaling()),
}


@contextlib.contextmanager
def syncs_are_errors():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _modules():
    bf16 = {"params_dtype": torch.bfloat16, "device": "cuda"}
    splits = [128, 0, 256, 128]
    return {
        "linear": (lambda: mf.Linear(256, 128, bias=True, **bf16), lambda m, x: m(x)),
        "layernorm_linear": (lambda: mf.LayerNormLinear(256, 128, **bf16), lambda m, x: m(x)),
        "layernorm_mlp": (lambda: mf.LayerNormMLP(256, 512, activation="swiglu", **bf16),
                          lambda m, x: m(x)),
        "grouped_linear": (lambda: mf.GroupedLinear(4, 256, 128, **bf16),
                           lambda m, x: m(x, splits)),
    }


@pytest.mark.parametrize("module_name", list(_modules()))
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_training_step_issues_no_host_sync(recipe_name, module_name):
    build, forward = _modules()[module_name]
    torch.manual_seed(0)
    module = build()
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(512, 128 if module_name != "layernorm_mlp" else 256, device="cuda",
                     dtype=torch.bfloat16)

    def step():
        with mf.autocast(recipe=RECIPES[recipe_name]):
            y = forward(module, x)
        y.backward(dy)

    step()  # compiles kernels, creates recipe state
    with syncs_are_errors():
        step()
    torch.cuda.synchronize()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None)


def test_check_catches_a_sync():
    """The check is live: a scalar read inside it raises."""
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError), syncs_are_errors():
        x.sum().item()
