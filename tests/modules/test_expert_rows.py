"""modules/expert_rows.py: the gather-only dispatch and combine against the indexing form they
replace (gather by row, weight, index_add_ into the tokens; autograd's scatters backward)."""

import pytest
import torch

from minifloat.modules.expert_rows import CombineRows, DispatchRows
from minifloat.modules.grouped_offsets import routing_layout


def routing(tokens, experts, top_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return index, g


def indexing_form(hidden, rows_fn, weights, layout, top_k):
    """The expert path as torch indexing: rows = hidden's tokens (zero row for padding), the
    per-row function, each pair's row weighted, index_add_ into its token."""
    tokens = hidden.shape[0]
    rows = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])[layout.pair_of_row // top_k]
    out = rows_fn(rows)
    pairs = torch.arange(tokens * top_k)
    token, slot = pairs // top_k, pairs % top_k
    picked = out[layout.pair_row] * weights[token, slot, None]
    return torch.zeros_like(hidden).index_add_(0, token, picked.to(hidden.dtype))


def gather_form(hidden, rows_fn, weights, layout, top_k):
    rows = DispatchRows.apply(hidden, layout.pair_of_row, layout.pair_row, top_k)
    return CombineRows.apply(rows_fn(rows), weights, layout.pair_row, layout.pair_of_row,
                             hidden.dtype)


def run(form, hidden, weights, layout, top_k, mix, grad_out):
    hidden = hidden.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    out = form(hidden, lambda rows: rows @ mix, weights, layout, top_k)
    out.backward(grad_out)
    return out.detach(), hidden.grad, weights.grad


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])
def test_top2_equals_the_indexing_form_bitwise(weights_dtype):
    """top_k 2 (Mixtral): index_add_'s two adds from zero and the fp32 sum rounded once give
    the same bf16 values; every gradient likewise (each is one product or one dot product)."""
    tokens, experts, hidden_size, top_k = 37, 5, 24, 2
    index, g = routing(tokens, experts, top_k)
    layout = routing_layout(index, experts)
    hidden = torch.randn(tokens, hidden_size, generator=g).to(torch.bfloat16)
    weights = torch.rand(tokens, top_k, generator=g).to(weights_dtype)
    mix = torch.randn(hidden_size, hidden_size, generator=g).to(torch.bfloat16)
    grad_out = torch.randn(tokens, hidden_size, generator=g).to(torch.bfloat16)
    want = run(indexing_form, hidden, weights, layout, top_k, mix, grad_out)
    got = run(gather_form, hidden, weights, layout, top_k, mix, grad_out)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_top4_within_one_rounding_of_the_indexing_form():
    """top_k 4: the sum is rounded once instead of after each add (closer to the exact sum)."""
    tokens, experts, hidden_size, top_k = 29, 8, 16, 4
    index, g = routing(tokens, experts, top_k, seed=1)
    layout = routing_layout(index, experts)
    hidden = torch.randn(tokens, hidden_size, generator=g, dtype=torch.float64)
    weights = torch.rand(tokens, top_k, generator=g, dtype=torch.float64)
    mix = torch.randn(hidden_size, hidden_size, generator=g, dtype=torch.float64)
    grad_out = torch.randn(tokens, hidden_size, generator=g, dtype=torch.float64)
    want = run(indexing_form, hidden, weights, layout, top_k, mix, grad_out)
    low = [t.to(torch.bfloat16) for t in (hidden, weights, mix, grad_out)]
    got = run(gather_form, *low[:2], layout, top_k, low[2], low[3])
    for a, b in zip(got, want, strict=True):
        error = ((a.double() - b).norm() / b.norm()).item()
        assert error < 2e-2, error  # bf16 operands and products against float64


def test_padding_rows_get_no_gradient_and_a_nan_stays():
    tokens, experts, hidden_size, top_k = 9, 3, 8, 2
    index, g = routing(tokens, experts, top_k, seed=2)
    layout = routing_layout(index, experts)
    rows = torch.randn(layout.pair_of_row.shape[0], hidden_size, generator=g, requires_grad=True)
    weights = torch.rand(tokens, top_k, generator=g)
    weights[4, 1] = float("nan")
    out = CombineRows.apply(rows, weights, layout.pair_row, layout.pair_of_row, torch.float32)
    out.sum().backward()
    padding = layout.pair_of_row == tokens * top_k
    assert padding.any() and (rows.grad[padding] == 0).all()
    assert out[4].isnan().all() and not out[torch.arange(tokens) != 4].isnan().any()


def test_compiles_in_one_graph_and_matches_eager():
    tokens, experts, hidden_size, top_k = 21, 4, 16, 2
    index, g = routing(tokens, experts, top_k, seed=3)
    layout = routing_layout(index, experts)
    hidden = torch.randn(tokens, hidden_size, generator=g)
    weights = torch.rand(tokens, top_k, generator=g)
    mix = torch.randn(hidden_size, hidden_size, generator=g)
    grad_out = torch.randn(tokens, hidden_size, generator=g)
    compiled = torch.compile(gather_form, fullgraph=True)
    want = run(gather_form, hidden, weights, layout, top_k, mix, grad_out)
    got = run(compiled, hidden, weights, layout, top_k, mix, grad_out)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
