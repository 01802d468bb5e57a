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
