"""Delayed scaling on the device-offsets experts: a MoE under DelayedScaling in one compiled graph.

Why: delayed scaling's experts read their token counts on the host (FusedExperts' host-count
path), so under torch.compile they ran as a graph break that `fullgraph=True` refuses. The
device-offsets layout (grouped_offsets.py) needs no counts; what delayed scaling adds is its
recipe state: each expert's operands cast with that expert's scale slot and their maxima
folded into its amax slot (history row 0), as the general path's Float8Quantizer does.

The state reaches the ops as the module binding's tensors (GemmBinding.state: aliases of the
forward and backward DelayedScalingRecipeState's `scale` and `amax_history`, as gemm_op's ops
take them), the slots as constants: GEMM g's input is forward slot len(FORWARD_SLOTS) g, its
weight the next, its grad_output backward slot len(BACKWARD_SLOTS) g; expert e of a part
whose first GEMM is f is GEMM f + e. The cast op (`grouped_delayed_cast`) records the maxima in
place without declaring the mutation, as gemm_op's ops do (gemm_op.py says why: nothing else in
a graph reads them, and functionalization would hand the op copies), through a fresh alias
(gemm_op.detached_alias), so the saved aliases' version counters stay as autograd saved them.
The forward op notes the module's states in autocast's round (the update at its exit), looked
up by the state's address as gemm_op's forward op does.

Served: DelayedScaling's own states (not a CustomRecipe's mixture), one FP8 dtype per operand,
experts' output widths N in whole 128s (the weights' cast is the grouped cast over their rows:
grouped_offsets.rows_cast_weights), the memory options too (rebuild_weight_copy_in_backward,
save_original_input: GroupedOffsetsDelayed), but not inside minifloat.checkpoint's recompute,
which the host-count path serves. The bytes are the general path's: scale_inv = 1 / scale
correctly rounded, each expert's rows and weight cast with its own scale.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..autocast import note_delayed_use
from ..recipe_state import DelayedScalingRecipeState
from .gemm_op import _DELAYED_BY_STATE, detached_alias
from .grouped_offsets import (
    expert_copies,
    grouped_reduction_gemm,
    grouped_rows_cast,
    grouped_rows_gemm,
    rows_cast,
    stored_group_maxima,
    uniform_dtypes,
    weight_rows,
)
from .lean_fp8 import LeanPlan
from .linear_function import BACKWARD_SLOTS, FORWARD_SLOTS
from .op_define import define_op


class OffsetsDelayed(NamedTuple):
    """The FP8 dtypes of the three operands under delayed scaling (constants a compiled graph
    guards on by value)."""

    input_dtype: torch.dtype
    weight_dtype: torch.dtype
    grad_dtype: torch.dtype


def offsets_delayed(plans: list[LeanPlan | None], recipe_states: tuple) -> OffsetsDelayed | None:
    """The delayed device path's dtypes when every expert GEMM has a delayed-scaling lean plan
    over DelayedScaling's own states, one FP8 dtype per operand, else None."""
    if any(type(state) is not DelayedScalingRecipeState for state in recipe_states):
        return None
    dtypes = uniform_dtypes(plans, delayed=True)
    return None if dtypes is None else OffsetsDelayed(*dtypes)


def _slots(first_slot: int, stride: int, groups: int, device: torch.device) -> torch.Tensor:
    return torch.arange(first_slot, first_slot + stride * groups, stride, device=device)


def _delayed_cast(x: torch.Tensor, scale_state: torch.Tensor, amax_state: torch.Tensor,
                  ends: torch.Tensor, first_slot: int, stride: int, fp8_dtype: torch.dtype,
                  rowwise: bool, columnwise: bool, note_use: bool) -> list[torch.Tensor]:
    """[bytes [R, D] if rowwise, their transpose if columnwise, scale_inv [E]]: group g's rows
    cast with slot first_slot + stride g's scale, their maximum folded into that slot's amax
    (history row 0; an empty group's 0 changes nothing, as the general path casts nothing for
    it). `note_use`: the forward's casts enrol the module's states in autocast's round."""
    slots = _slots(first_slot, stride, ends.shape[0], x.device)
    scale = scale_state[slots]
    copies = rows_cast(x, scale, ends, fp8_dtype, rowwise, columnwise)
    record = detached_alias(amax_state)
    record[0, slots] = torch.maximum(record[0, slots], stored_group_maxima(x, ends))
    if note_use:
        pair = _DELAYED_BY_STATE.get(scale_state.data_ptr())
        if pair is not None:
            note_delayed_use(pair)
    return [*copies, torch.reciprocal(scale)]


def _delayed_cast_fake(x, scale_state, amax_state, ends, first_slot, stride, fp8_dtype, rowwise,
                       columnwise, note_use):
    rows, depth = x.shape
    return [x.new_empty(shape, dtype=fp8_dtype) for shape, wanted in
            (((rows, depth), rowwise), ((depth, rows), columnwise)) if wanted] + [
        x.new_empty(ends.shape[0], dtype=torch.float32)]


grouped_delayed_cast = define_op("grouped_delayed_cast", _delayed_cast, _delayed_cast_fake)


def _cast_weights(weight: torch.Tensor, scale_state: torch.Tensor, amax_state: torch.Tensor,
                  gemm: int, dtype: torch.dtype, *, rowwise: bool, columnwise: bool
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The experts' weights [E, N, K] as the rows of one matrix (rows_cast_weights): bytes
    [E, N, K], each expert's transpose [E, K, N] over one [K, E * N] matrix, scale_inv [E]."""
    rows, ends = weight_rows(weight.detach())
    copies = iter(grouped_delayed_cast(rows, scale_state, amax_state, ends,
                                       len(FORWARD_SLOTS) * gemm + 1, len(FORWARD_SLOTS), dtype,
                                       rowwise, columnwise, False))
    data = next(copies) if rowwise else None
    data_t = next(copies) if columnwise else None
    return (*expert_copies(data, data_t, weight.shape), next(copies))


class GroupedOffsetsDelayed(torch.autograd.Function):
    """y = x W_g^T per group under delayed scaling (module docstring); GroupedOffsetsFP8's
    GEMMs. `state`: the binding's [forward scale, forward amax history, backward scale,
    backward amax history]; `first_gemm`: the module's GEMM of the first expert. `rebuild` and
    `save_original` (the memory options): keep the weights or x and their forward scales, and
    cast their columnwise copies in backward with those scales, recording nothing (the recipe
    state's slots are updated before backward runs), as the general path's rebuilds do."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor,
                casts: OffsetsDelayed, first_gemm: int, need_dgrad: bool, need_wgrad: bool,
                rebuild: bool, save_original: bool, forward_scale: torch.Tensor,
                forward_amax: torch.Tensor, backward_scale: torch.Tensor,
                backward_amax: torch.Tensor) -> torch.Tensor:
        experts, stride = ends.shape[0], len(FORWARD_SLOTS)
        x_columns = need_wgrad and not save_original
        x_bytes, *rest = grouped_delayed_cast(
            x.detach(), forward_scale, forward_amax, ends, stride * first_gemm, stride,
            casts.input_dtype, True, x_columns, True)
        x_t, x_scale_inv = rest if x_columns else (None, *rest)
        w_bytes, w_t, w_scale_inv = _cast_weights(
            weight, forward_scale, forward_amax, first_gemm, casts.weight_dtype, rowwise=True,
            columnwise=need_dgrad and not rebuild)
        y = grouped_rows_gemm(x_bytes, w_bytes, x_scale_inv, w_scale_inv, ends, x.dtype, False)
        x_scale = w_scale = None
        if need_wgrad and save_original:
            x_t = x.detach()
            x_scale = forward_scale[_slots(stride * first_gemm, stride, experts, x.device)]
        if need_dgrad and rebuild:
            w_t = weight.detach()
            w_scale = forward_scale[_slots(stride * first_gemm + 1, stride, experts, x.device)]
        ctx.save_for_backward(x_t, x_scale, x_scale_inv, w_t, w_scale, w_scale_inv, ends,
                              backward_scale, backward_amax)
        ctx.casts, ctx.first_gemm = casts, first_gemm
        ctx.need_dgrad, ctx.need_wgrad = need_dgrad, need_wgrad
        ctx.rebuild, ctx.save_original = rebuild, save_original
        ctx.weight_dtype = weight.dtype
        return y

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x_t, x_scale, x_scale_inv, w_t, w_scale, w_scale_inv, ends, backward_scale,
         backward_amax) = ctx.saved_tensors
        casts = ctx.casts
        copies = iter(grouped_delayed_cast(
            grad_output.contiguous(), backward_scale, backward_amax, ends,
            len(BACKWARD_SLOTS) * ctx.first_gemm, len(BACKWARD_SLOTS), casts.grad_dtype,
            ctx.need_dgrad, ctx.need_wgrad, False))
        dy_bytes = next(copies) if ctx.need_dgrad else None
        dy_t = next(copies) if ctx.need_wgrad else None
        dy_scale_inv = next(copies)
        grad_x = grad_weight = None
        if ctx.need_dgrad:
            if ctx.rebuild:  # forward's scales, nothing recorded
                rows, weight_ends = weight_rows(w_t)
                w_t = expert_copies(None, grouped_rows_cast(
                    rows, w_scale, weight_ends, casts.weight_dtype, False, True)[0],
                    w_t.shape)[1]
            grad_x = grouped_rows_gemm(dy_bytes, w_t, dy_scale_inv, w_scale_inv, ends,
                                       grad_output.dtype, True)
        if ctx.need_wgrad:
            if ctx.save_original:
                x_t = grouped_rows_cast(x_t, x_scale, ends, casts.input_dtype, False, True)[0]
            grad_weight = grouped_reduction_gemm(dy_t, x_t, dy_scale_inv, x_scale_inv, ends,
                                                 ctx.weight_dtype, True)
        return (grad_x, grad_weight, None, None, None, None, None, None, None, None, None, None,
                None)
