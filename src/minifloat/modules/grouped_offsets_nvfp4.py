"""The device-offsets experts under NVFP4 (NUMERICS.md §6; grouped_offsets.py has the layout).

Why: a converted MoE model under NVFP4 read its token counts on the host and ran its experts as
a torch.compile graph break (fullgraph=True refused it). NVFP4's 16-element blocks fit the
device-offsets layout as the block formats' do (grouped_offsets_blocks.py): rowwise blocks run
along K inside one row; columnwise blocks (16 rows, and the RHT's runs of 16 along the rows)
start at multiples of 16 and every expert's rows start at a multiple of 128; the stacked
weights [E, N, K] cut at whole 16x16 tiles since N is a multiple of 16. What the block formats
lack is NVFP4's per-tensor global scale: each expert's operand has its own global amax (the
general path quantizes each expert's rows as one tensor), so each group's amax is taken over
its rows (after the RHT for the columnwise copies), broadcast over its blocks, and each
group's S_dec product is applied to its rows of the fp32 product, the emulated GEMM's alpha.

The GEMMs are emulated as on Hopper: each operand's block values (E2M1 x UE4M3) through a
grouped GEMM with fp32 accumulation, times S_dec(a) * S_dec(b) of the group in fp32, one
rounding to the output dtype: grouped_offsets.py's grouped GEMM ops, so on CUDA minifloat's
grouped kernels (kernels/grouped_gemm.py) on fp16 operands (the block values are exact there
too: at most 6 significant bits, magnitudes 2^-10 to 2688; fp16 rather than bf16 because
Triton's interpreter, which the kernel tests run on the CPU, multiplied bf16 operands wrongly),
elsewhere torch._grouped_mm in fp32.
Stochastic rounding draws from torch's generator over the whole buffer at once, so its bits
differ from the general path's per-expert draws (NUMERICS.md §7 tests it statistically).
Served: every expert GEMM's three quantizers NVFP4 with one setting per operand, no RHT on the
weight, and the RHT on both wgrad operands or on neither (so that it cancels); else the
host-counts path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..numerics import nvfp4 as nvfp4_numerics
from ..numerics.hadamard import random_hadamard_transform
from ..quantizers import NVFP4Quantizer, Quantizer
from .grouped_offsets import (
    grouped_reduction_gemm,
    grouped_rows_gemm,
    stored_group_maxima,
    tile_groups,
    weight_rows,
)
from .grouped_offsets_blocks import one_cast_per_operand
from .op_define import define_op

BLOCK = nvfp4_numerics.BLOCK


class NVFP4Cast(NamedTuple):
    """One operand's NVFP4 settings as constants (NVFP4Quantizer's)."""

    two_dimensional: bool = False
    with_rht: bool = False
    stochastic: bool = False

    @staticmethod
    def of(quantizer: Quantizer) -> NVFP4Cast | None:
        if type(quantizer) is not NVFP4Quantizer:
            return None
        return NVFP4Cast(quantizer.with_2d_quantization, quantizer.with_rht,
                         quantizer.stochastic_rounding)


class OffsetsNVFP4(NamedTuple):
    """The NVFP4 settings of the experts' input, weight and grad_output (every expert alike)."""

    input: NVFP4Cast
    weight: NVFP4Cast
    grad_output: NVFP4Cast


def offsets_nvfp4(input_quantizers: list[Quantizer], weight_quantizers: list[Quantizer],
                  grad_quantizers: list[Quantizer]) -> OffsetsNVFP4 | None:
    """The settings when every expert GEMM's three quantizers are NVFP4 with one setting per
    operand, the weight without the RHT (its columnwise partner in dgrad, dy's rowwise copy,
    has none) and the RHT on both wgrad operands or on neither."""
    slots = one_cast_per_operand(NVFP4Cast.of, input_quantizers, weight_quantizers,
                                 grad_quantizers)
    if slots is None:
        return None
    plan = OffsetsNVFP4(*slots)
    if plan.weight.with_rht or plan.input.with_rht != plan.grad_output.with_rht:
        return None
    return plan


def values_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the block values the GEMMs take: fp16 on CUDA (exact: the grouped kernels'
    operands), fp32 elsewhere (torch._grouped_mm's CPU operands)."""
    return torch.float16 if device.type == "cuda" else torch.float32


class Quantized(NamedTuple):
    """One NVFP4 copy of a grouped operand: packed E2M1 data, UE4M3 block scales (numerics'
    compact layout, the rows the blocks run along) and each group's S_dec [E]. Backward keeps
    these (half a byte an element), not the block values."""

    data: torch.Tensor
    scale: torch.Tensor
    s_dec: torch.Tensor


def block_values(copy: Quantized) -> torch.Tensor:
    """q * s_b of every element (values_dtype): exact products, so torch ops anywhere."""
    values = nvfp4_numerics.dequantize_nvfp4_blocks(copy.data, copy.scale)
    return values.to(values_dtype(copy.data.device))


def _rows_quantized(x: torch.Tensor, ends: torch.Tensor, two_dimensional: bool,
                    stochastic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    amax = stored_group_maxima(x, ends, BLOCK)
    tile_rows = BLOCK if two_dimensional else 1
    per_tile = amax[tile_groups(ends, x.shape[0], tile_rows)][:, None]
    data, scale = nvfp4_numerics.quantize_blocks(x, per_tile, tile_rows=tile_rows,
                                                 stochastic=stochastic)
    return data, scale, nvfp4_numerics.global_decode_scale(amax)


def _columns_quantized(x: torch.Tensor, ends: torch.Tensor, with_rht: bool,
                       stochastic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x_t = x.t()
    if with_rht:
        x_t = random_hadamard_transform(x_t)
    amax = stored_group_maxima(x_t.t(), ends, BLOCK)
    per_block = amax[tile_groups(ends, x_t.shape[1], BLOCK)][None, :]
    data, scale = nvfp4_numerics.quantize_blocks(x_t, per_block, tile_rows=1,
                                                 stochastic=stochastic)
    return data, scale, nvfp4_numerics.global_decode_scale(amax)


def _quantized_fake(rows: int, cols: int, ends: torch.Tensor, like: torch.Tensor):
    return (like.new_empty(rows, cols // 2, dtype=torch.uint8),
            like.new_empty(rows, cols // BLOCK, dtype=torch.float8_e4m3fn),
            like.new_empty(ends.shape, dtype=torch.float32))


# ops: a compiled graph runs numerics' quantization as written (eagerly, bit for bit), where
# inductor's fused fp32 divisions and reciprocals are not correctly rounded
_rows_op = define_op("nvfp4_group_rows", _rows_quantized,
                     lambda x, ends, two_dimensional, stochastic: _quantized_fake(
                         x.shape[0], x.shape[1], ends, x))
_columns_op = define_op("nvfp4_group_columns", _columns_quantized,
                        lambda x, ends, with_rht, stochastic: _quantized_fake(
                            x.shape[1], x.shape[0], ends, x))


def rows_quantized(x: torch.Tensor, ends: torch.Tensor, cast: NVFP4Cast) -> Quantized:
    """x [R, C]'s rowwise copy, each group (rows by `ends`) quantized as one tensor. 2D tiles
    (16 rows) need groups of whole 16s."""
    return Quantized(*_rows_op(x.detach(), ends, cast.two_dimensional, cast.stochastic))


def columns_quantized(x: torch.Tensor, ends: torch.Tensor, cast: NVFP4Cast) -> Quantized:
    """x [R, C]'s columnwise copy: x^T [C, R] quantized along R (after the RHT where it
    applies), each group as one tensor."""
    return Quantized(*_columns_op(x.detach(), ends, cast.with_rht, cast.stochastic))


def rows_values(x: torch.Tensor, ends: torch.Tensor, cast: NVFP4Cast
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(block values [R, C], S_dec [E]) of rows_quantized."""
    copy = rows_quantized(x, ends, cast)
    return block_values(copy), copy.s_dec


def columns_values(x: torch.Tensor, ends: torch.Tensor, cast: NVFP4Cast
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(block values [C, R], S_dec [E]) of columns_quantized."""
    copy = columns_quantized(x, ends, cast)
    return block_values(copy), copy.s_dec


def weight_copy(weight: torch.Tensor, cast: NVFP4Cast, *, columnwise: bool) -> Quantized:
    """The experts' weights [E, N, K], each expert one tensor: the rowwise copy's rows
    [E * N, K], or for the columnwise copy under 1-D blocks W_e^T's [E * K, N] quantized along
    N (2-D tiles: the rowwise copy, whose transpose the columnwise copy is, NUMERICS.md §6)."""
    if columnwise and not cast.two_dimensional:
        return rows_quantized(*weight_rows(weight.detach().transpose(1, 2).contiguous()), cast)
    return rows_quantized(*weight_rows(weight.detach()), cast)


def weight_values(copy: Quantized, shape: torch.Size, cast: NVFP4Cast, *, columnwise: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight_copy's block values as each expert's rowwise [E, N, K] or columnwise [E, K, N]
    copy, and S_dec [E]."""
    experts, n, k = shape
    values = block_values(copy)
    if columnwise and not cast.two_dimensional:
        return values.view(experts, k, n), copy.s_dec
    values = values.view(experts, n, k)
    return (values.transpose(1, 2) if columnwise else values), copy.s_dec


def grouped_product(a: torch.Tensor, b: torch.Tensor, a_s_dec: torch.Tensor,
                    b_s_dec: torch.Tensor, ends: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """The emulated NVFP4 grouped GEMM of block values: rows grouped (a [R, K], b [E, N, K] ->
    [R, N]) or reduction grouped (a [W1, R], b [W2, R] -> [E, W1, W2]); each group's fp32 sum
    times a_s_dec[g] * b_s_dec[g], one rounding to out_dtype: the FP8 experts' grouped GEMM
    ops, fast accumulation (exact products of exact values: nothing to split)."""
    gemm = grouped_rows_gemm if b.dim() == 3 else grouped_reduction_gemm
    return gemm(a, b, a_s_dec, b_s_dec, ends, out_dtype, False)


class GroupedOffsetsNVFP4(torch.autograd.Function):
    """y[rows of g] = x[rows of g] W_g^T for the 3-D weight [E, N, K] under NVFP4, the groups
    given by `ends` on the device (module docstring). Backward keeps x's columnwise copy and
    the weights' copy for dgrad as NVFP4 bytes; `rebuild` and `save_original`: keep the weight
    or x instead, and quantize them again in backward (as GroupedOffsetsBlocks does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor,
                plan: OffsetsNVFP4, need_dgrad: bool, need_wgrad: bool, rebuild: bool,
                save_original: bool) -> torch.Tensor:
        x_values, x_s_dec = rows_values(x, ends, plan.input)
        w_rows = weight_copy(weight, plan.weight, columnwise=False)
        w_values, w_s_dec = weight_values(w_rows, weight.shape, plan.weight, columnwise=False)
        y = grouped_product(x_values, w_values, x_s_dec, w_s_dec, ends, x.dtype)
        kept_x = kept_w = (None, None, None)
        if need_wgrad:
            kept_x = ((x.detach(), None, None) if save_original
                      else columns_quantized(x, ends, plan.input))
        if need_dgrad:
            if rebuild:
                kept_w = (weight.detach(), None, None)
            else:  # (2-D tiles: the rowwise copy is the columnwise one transposed)
                kept_w = (w_rows if plan.weight.two_dimensional
                          else weight_copy(weight, plan.weight, columnwise=True))
        ctx.save_for_backward(*kept_x, *kept_w, ends)
        ctx.plan, ctx.need_dgrad, ctx.need_wgrad = plan, need_dgrad, need_wgrad
        ctx.rebuild, ctx.save_original = rebuild, save_original
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return y

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        *saved, ends = ctx.saved_tensors
        kept_x, kept_w = saved[:3], saved[3:]
        plan = ctx.plan
        dy = grad_output.contiguous()
        grad_x = grad_weight = None
        if ctx.need_dgrad:
            w_copy = (weight_copy(kept_w[0], plan.weight, columnwise=True) if ctx.rebuild
                      else Quantized(*kept_w))
            # dy [R, N] x (W_e^T [K, N])^T: the weight's columnwise values [E, K, N] as b
            w_cols, w_s_dec = weight_values(w_copy, ctx.weight_shape, plan.weight,
                                            columnwise=True)
            dy_values, dy_s_dec = rows_values(dy, ends, plan.grad_output)
            grad_x = grouped_product(dy_values, w_cols, dy_s_dec, w_s_dec, ends,
                                     grad_output.dtype)
        if ctx.need_wgrad:
            x_copy = (columns_quantized(kept_x[0], ends, plan.input) if ctx.save_original
                      else Quantized(*kept_x))
            dy_cols, dy_cols_s_dec = columns_values(dy, ends, plan.grad_output)
            grad_weight = grouped_product(dy_cols, block_values(x_copy), dy_cols_s_dec,
                                          x_copy.s_dec, ends, ctx.weight_dtype)
        return grad_x, grad_weight, None, None, None, None, None, None
