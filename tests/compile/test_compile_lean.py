"""The lean path inside the compiled GEMM ops (modules/lean_ops.py): one FP8 current-scaling
GEMM as kernel calls, the buffers kept for backward in the general path's layout.

Without a GPU the lean path is widened to the CPU (lean_fp8.DEVICES; torch._scaled_mm runs
there too). Eagerly the modules then take LeanFP8Gemm, compiled they take the lean ops; both
make the same calls, so with the aot_eager backend outputs and gradients must be equal bit for
bit, and the spies must see the lean ops serve every GEMM, forward and backward. On the GPU the
lean and general paths give the same bytes (tests/gpu/test_modules_cuda.py).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn

import minifloat as mf
from minifloat.modules import lean_fp8, lean_ops
from training._reference import rel_err

RECIPE = mf.Float8CurrentScaling()
HIDDEN, FFN, ROWS = 64, 128, 48


@pytest.fixture
def lean_on_cpu(monkeypatch):
    """Let the lean path serve CPU tensors; count the lean ops' forward and backward calls."""
    monkeypatch.setattr(lean_fp8, "DEVICES", ("cuda", "cpu"))
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        original = getattr(lean_ops, f"lean_{name}")

        def counting(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(lean_ops, f"lean_{name}", counting)
    return calls


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "linear":
        return mf.Linear(HIDDEN, FFN, name="fc")
    if kind == "mlp":
        return mf.LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm", name="mlp")
    if kind == "rebuild":  # backward casts the weight again instead of keeping its copy
        return mf.rebuild_weight_copies_in_backward(nn.Sequential(mf.Linear(HIDDEN, FFN)))
    with mf.quantized_model_init(recipe=RECIPE):  # FP8 bytes as the weight
        return mf.Linear(HIDDEN, FFN, bias=False, name="fc")


def _step(model, x, dy):
    x = x.clone().requires_grad_(True)
    with mf.autocast(recipe=RECIPE):
        y = model(x)
    y.backward(dy)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, *grads]


@pytest.mark.parametrize("kind", ["linear", "mlp", "rebuild", "quantized_weight"])
def test_lean_ops_serve_the_compiled_gemms_and_match_eager(lean_on_cpu, monkeypatch, kind):
    """Bitwise against eager LeanFP8Gemm (the same calls), and within the summation order of
    another GEMM against the eager general path (LinearGemms, which on the CPU emulates the
    GEMMs: tests/modules/test_lean_fp8.py), an implementation that shares no code with it."""
    eager, model, general = _model(kind), _model(kind), _model(kind)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    gemms = 2 if kind == "mlp" else 1
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(ROWS, HIDDEN, generator=generator)
        dy = torch.randn(ROWS, HIDDEN if kind == "mlp" else FFN, generator=generator)
        want = _step(eager, x, dy)
        before = dict(lean_on_cpu)
        got = _step(compiled, x, dy)
        assert lean_on_cpu["forward"] - before["forward"] == gemms, kind
        assert lean_on_cpu["backward"] - before["backward"] == gemms, kind
        assert len(got) == len(want) >= 3
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), (kind, step, index)
        monkeypatch.setattr(lean_fp8, "ENABLED", False)
        reference = _step(general, x, dy)
        monkeypatch.setattr(lean_fp8, "ENABLED", True)
        for index, (a, b) in enumerate(zip(got, reference, strict=True)):
            assert rel_err(a, b) < 1e-5, (kind, step, index)


def test_shapes_off_the_rule_take_the_general_ops(lean_on_cpu):
    """M not a multiple of 16: the general ops run, and still equal the eager general path."""
    eager, model = _model("linear"), _model("linear")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x, dy = torch.randn(ROWS + 8, HIDDEN), torch.randn(ROWS + 8, FFN)
    want, got = _step(eager, x, dy), _step(compiled, x, dy)
    assert lean_on_cpu == {"forward": 0, "backward": 0}
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
