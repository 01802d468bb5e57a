"""Any token count under formats whose blocks run along the rows (MXFP8: 32, NVFP4: 16):
modules pad the rows with zeros inside (QuantizedModule._run_rows_padded), so ragged batches,
a smaller last batch and single-token decode steps run (issue 21, item 3).

Independent check of the forward: rowwise blocks run along K, so a row's output depends on
that row only (and, for NVFP4, on the global amax): the rows of a ragged input equal the same
rows inside an aligned batch whose other rows are smaller (no amax changes)."""

from __future__ import annotations

import pytest
import torch

import minifloat as mf

RECIPES = {
    "mxfp8": lambda: mf.MXFP8BlockScaling(),
    "nvfp4": lambda: mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
}


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_ragged_rows_equal_the_same_rows_in_an_aligned_batch(name, rows):
    recipe = RECIPES[name]()
    torch.manual_seed(0)
    layer = mf.Linear(64, 96)
    x = torch.randn(rows, 64, requires_grad=True)
    aligned = 64  # a multiple of both formats' blocks
    others = torch.randn(aligned - rows, 64) * 0.01  # smaller: no block or global amax moves
    with mf.autocast(recipe=recipe):
        y = layer(x)
        reference = layer(torch.cat([x.detach(), others]))[:rows]
    assert y.shape == (rows, 96)
    assert torch.equal(y, reference)
    y.float().pow(2).sum().backward()  # backward runs too; gradients keep the real rows' shape
    assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()
    assert torch.isfinite(layer.weight.grad).all()


def test_modules_of_every_kind_take_ragged_rows():
    recipe = mf.MXFP8BlockScaling()
    x = torch.randn(3, 5, 64, requires_grad=True)  # 15 rows
    modules = [mf.LayerNormLinear(64, 64, normalization="RMSNorm"),
               mf.LayerNormMLP(64, 128, normalization="RMSNorm")]
    for module in modules:
        with mf.autocast(recipe=recipe):
            y = module(x)
        assert y.shape == (3, 5, 64)
        y.sum().backward()
    assert x.grad.shape == x.shape


FAST_GEMM_ROWS = {
    "current": (lambda: mf.Float8CurrentScaling(), 16),
    "delayed": (lambda: mf.DelayedScaling(), 16),
    "block": (lambda: mf.Float8BlockScaling(), 128),
}


@pytest.mark.parametrize("name", FAST_GEMM_ROWS)
def test_rows_padded_for_the_cuda_fast_gemm(monkeypatch, name):
    """On CUDA the FP8 GEMMs (scaled_mm, blockwise scaled_mm) need whole row groups, and a call
    that misses them is decoded and emulated: modules pad the rows there (here the CPU is made
    to answer as CUDA). Padding is exact: the output equals the unpadded call's, gradients
    agree to the reduction's rounding (wgrad sums more, zero, rows)."""
    from minifloat.modules import gemm_op

    make_recipe, multiple = FAST_GEMM_ROWS[name]
    x = torch.randn(multiple + 3, 128, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    results, original = {}, mf.Linear._run_rows_padded
    for on_cuda in (False, True):
        monkeypatch.setattr(gemm_op, "on_fast_gemm_device", lambda _x, answer=on_cuda: answer)
        padded_rows = []

        def spy(self, x_, multiple_, *args, padded_rows=padded_rows, **kwargs):
            padded_rows.append(multiple_)
            return original(self, x_, multiple_, *args, **kwargs)

        monkeypatch.setattr(mf.Linear, "_run_rows_padded", spy)
        torch.manual_seed(0)
        layer = mf.Linear(128, 256)  # afresh: delayed scaling's first scale each time
        x.grad = None
        with mf.autocast(recipe=make_recipe()):
            y = layer(x)
        y.float().pow(2).sum().backward()
        results[on_cuda] = (y.detach(), x.grad.clone(), layer.weight.grad.clone(), padded_rows)
    assert results[False][3] == [] and results[True][3] == [multiple]
    assert torch.equal(results[True][0], results[False][0])
    for got, want in zip(results[True][1:3], results[False][1:3], strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def fused_experts(count: int, hidden: int, ffn: int, device: str = "cpu"):
    """FusedExperts over transformers' fused layout (gate_up_proj [E, 2F, D], down_proj
    [E, D, F]) with random weights."""
    from minifloat.modules.fused_experts import FusedExperts

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(
                torch.randn(count, 2 * ffn, hidden, device=device) / hidden ** 0.5)
            self.down_proj = torch.nn.Parameter(
                torch.randn(count, hidden, ffn, device=device) / ffn ** 0.5)
            self.act_fn = torch.nn.SiLU()

    return FusedExperts(Experts())


def test_experts_rows_padded_per_expert_for_the_cuda_fast_gemm(monkeypatch):
    from minifloat.modules import gemm_op

    torch.manual_seed(0)
    experts = fused_experts(4, 32, 32)
    hidden = torch.randn(21, 32)
    index = torch.randint(0, 4, (21, 2))
    weights = torch.rand(21, 2)
    outputs, splits = {}, {}
    original = experts.run_gemms
    for on_cuda in (False, True):
        monkeypatch.setattr(gemm_op, "on_fast_gemm_device", lambda _x, answer=on_cuda: answer)
        seen = []
        experts.run_gemms = lambda x, m_splits, *a, seen=seen, **k: (
            seen.append(list(m_splits)), original(x, m_splits, *a, **k))[1]
        with torch.no_grad(), mf.autocast(recipe=mf.Float8CurrentScaling()):
            outputs[on_cuda] = experts(hidden, index, weights)
        splits[on_cuda] = seen[0]
    assert all(rows % 16 == 0 for rows in splits[True])
    assert sum(splits[False]) == 42 and any(rows % 16 for rows in splits[False])
    assert torch.equal(outputs[True], outputs[False])
