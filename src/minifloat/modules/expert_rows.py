"""A mixture of experts' tokens to its expert-sorted rows and back, by gathers in both directions.

Why: the experts' padded layout (grouped_offsets.routing_layout, FusedExperts' host-count
path) copies each routed (token, slot) pair's hidden state into one row, and the combine adds
each token's top-k output rows back, weighted by the router. Written as torch indexing, the
combine is an `index_add_` (atomic adds: on an H200 the bf16 `indexFuncLargeIndex` kernel took
0.28 ms a layer of a Mixtral step, 2.2 ms a step) and the dispatch's backward is an
`index_put_` with accumulation; a compiled graph cannot fuse either. Every token has exactly
top_k pairs, so both directions are gathers: the combine's forward reads each token's k rows
(`pair_row`) and sums them; its backward reads each row's token gradient (`pair_of_row`, the
pair a row holds; padding rows read a zero row). The dispatch is the combine's transpose.

Values are those of the indexing form: products in the promoted dtype of rows and weights,
then the output dtype, then the sum over the k slots accumulated in fp32 and rounded once
(index_add_'s sequential adds from zero give the same value for top_k 2: Mixtral's).
"""

from __future__ import annotations

import torch


def _with_zero_row(t: torch.Tensor) -> torch.Tensor:
    """t [N, ...] and one zero row after it: the row that padding rows read."""
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])])


class DispatchRows(torch.autograd.Function):
    """rows [R, H] = hidden [T, H]'s row of each layout row's token (zero for padding rows);
    backward: each token's gradient is the sum of its k rows' gradients."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, pair_of_row: torch.Tensor, pair_row: torch.Tensor,
                top_k: int) -> torch.Tensor:
        ctx.save_for_backward(pair_row)
        ctx.top_k = top_k
        # padding rows hold pair index T * top_k, so their token is T: the zero row
        return _with_zero_row(hidden)[pair_of_row // top_k]

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        (pair_row,) = ctx.saved_tensors
        tokens = pair_row.shape[0] // ctx.top_k
        grad = grad_rows[pair_row].view(tokens, ctx.top_k, -1).sum(1)
        return grad, None, None, None


class CombineRows(torch.autograd.Function):
    """out [T, H] = sum over slots s of rows[pair_row[t, s]] * weights[t, s], in `dtype`;
    backward: each row's gradient is its token's gradient times its weight (padding rows: 0),
    each weight's the dot product of its row with its token's gradient."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weights: torch.Tensor, pair_row: torch.Tensor,
                pair_of_row: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        tokens, top_k = weights.shape
        ctx.save_for_backward(rows, weights, pair_row, pair_of_row)
        ctx.dtype = dtype
        picked = rows[pair_row].view(tokens, top_k, -1)
        return (picked * weights[..., None]).to(dtype).sum(1)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        rows, weights, pair_row, pair_of_row = ctx.saved_tensors
        tokens, top_k = weights.shape
        product = torch.promote_types(rows.dtype, weights.dtype)
        grad_out = grad_out.to(product)
        grad_rows = grad_weights = None
        if ctx.needs_input_grad[0]:
            row_weight = _with_zero_row(weights.reshape(-1))[pair_of_row]
            grad_rows = (_with_zero_row(grad_out)[pair_of_row // top_k]
                         * row_weight[:, None]).to(rows.dtype)
        if ctx.needs_input_grad[1]:
            picked = rows[pair_row].view(tokens, top_k, -1)
            grad_weights = (picked * grad_out[:, None, :]).sum(-1).to(weights.dtype)
        return grad_rows, grad_weights, None, None, None


def pair_positions(order: torch.Tensor, real: torch.Tensor, rows: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_row [pairs], pair_of_row [rows]) of the expert-sorted layout: sorted pair i is pair
    order[i] (token-major index token * top_k + slot) at row real[i]; rows that hold no pair
    (padding) hold index `pairs`."""
    pairs = order.shape[0]
    pair_row = torch.empty_like(order).scatter_(0, order, real)
    pair_of_row = torch.full((rows,), pairs, dtype=order.dtype, device=order.device)
    return pair_row, pair_of_row.index_put((real,), order)
