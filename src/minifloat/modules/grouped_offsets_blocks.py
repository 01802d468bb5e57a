"""The device-offsets experts under the block formats whose blocks fit the layout: MXFP8 and
FP8 block scaling (grouped_offsets.py has the layout and the per-tensor FP8 path).

Why: a converted MoE model under these recipes read its token counts on the host and ran its
experts as a torch.compile graph break (fullgraph=True refused it). Their blocks never cross
an expert's rows in the device-offsets layout: rowwise blocks run along K inside one row;
columnwise blocks (MXFP8's 32 rows, block FP8's 128-row runs) start at multiples of their size
and every expert's rows start at a multiple of 128; the stacked weights [E, N, K] cut at whole
blocks when N is a multiple of the block (32, or 128 for the 2-D tiles). So quantizing the
whole buffer gives each expert the bytes of quantizing its rows alone, as the general path
does (zero padding rows make zero blocks and raise no block's maximum).

The GEMMs are emulated as on Hopper (NUMERICS.md: MXFP8 dequantized values are exact in bf16,
and so are block FP8's with power-of-2 scales, the default): each operand's dequantized copy
(numerics' reference quantize and dequantize, torch ops that a compiled graph fuses) through
torch._grouped_mm with the groups' ends, accumulating in fp32, one rounding to the output
dtype. Block FP8 without power-of-2 scales, fp32 activations on CUDA (its grouped GEMM takes
bf16) and NVFP4 (its per-tensor scale would be per expert) keep the host-counts path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..numerics import block_fp8 as block_numerics
from ..numerics import mxfp8 as mx_numerics
from ..quantizers import Float8BlockQuantizer, MXFP8Quantizer, Quantizer
from .op_define import define_op

MX_BLOCK = 32
BLOCK_FP8 = 128


class BlockCast(NamedTuple):
    """One operand's block format as constants: kind "mxfp8" (element dtype) or "block"
    (1-D runs or 2-D tiles of 128; power-of-2 scales, amax epsilon)."""

    kind: str
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    block_dim: int = 1
    amax_epsilon: float = 0.0

    @staticmethod
    def of(quantizer: Quantizer) -> BlockCast | None:
        if type(quantizer) is MXFP8Quantizer:
            return BlockCast("mxfp8", quantizer.fp8_dtype)
        if type(quantizer) is Float8BlockQuantizer and quantizer.power_2_scale:
            return BlockCast("block", quantizer.fp8_dtype, quantizer.block_scaling_dim,
                             quantizer.amax_epsilon)
        return None

    def weight_rows_multiple(self) -> int:
        """N must be a multiple of this for the stacked weights to cut at whole blocks."""
        if self.kind == "mxfp8":
            return MX_BLOCK
        return BLOCK_FP8 if self.block_dim == 2 else 1

    def values(self, x2d: torch.Tensor, *, columnwise: bool) -> torch.Tensor:
        """The dequantized values (fp32, [M, K]) of x2d's rowwise or columnwise copy."""
        x2d = x2d.detach()
        if self.kind == "mxfp8":
            direction = "columnwise" if columnwise else "rowwise"
            out = mx_numerics.quantize_mxfp8(x2d, rowwise=not columnwise, columnwise=columnwise,
                                             dtype=self.fp8_dtype)
            return mx_numerics.dequantize_mxfp8(out[f"{direction}_data"],
                                                out[f"{direction}_scale"],
                                                columnwise=columnwise)
        options = dict(power_2_scale=True, amax_epsilon=self.amax_epsilon)
        if self.block_dim == 2:  # one tile grid for both copies
            return block_numerics.dequantize_block_2d(
                *block_numerics.quantize_block_2d(x2d, **options))
        if columnwise:
            data_t, scale_inv = block_numerics.quantize_block_1d_columnwise(x2d, **options)
            return block_numerics.dequantize_block_1d(data_t, scale_inv).t()
        return block_numerics.dequantize_block_1d(*block_numerics.quantize_block_1d(x2d,
                                                                                    **options))


class OffsetsBlocks(NamedTuple):
    """The block casts of the experts' input, weight and grad_output (every expert alike)."""

    input: BlockCast
    weight: BlockCast
    grad_output: BlockCast


def one_cast_per_operand(cast_of: Callable[[Quantizer], Any],
                         *quantizer_lists: list[Quantizer]) -> list | None:
    """For each operand's quantizers (every expert GEMM's), the one cast they all map to by
    `cast_of`, or None when an operand's map to several or to None."""
    slots = []
    for quantizers in quantizer_lists:
        casts = {cast_of(q) for q in quantizers}
        if len(casts) != 1 or None in casts:
            return None
        slots.append(casts.pop())
    return slots


def offsets_blocks(input_quantizers: list[Quantizer], weight_quantizers: list[Quantizer],
                   grad_quantizers: list[Quantizer]) -> OffsetsBlocks | None:
    """The blocks when every expert GEMM's three quantizers map to one BlockCast per operand."""
    slots = one_cast_per_operand(BlockCast.of, input_quantizers, weight_quantizers,
                                 grad_quantizers)
    return None if slots is None else OffsetsBlocks(*slots)


def _exact_grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """torch._grouped_mm of exact values: in fp32 where it takes fp32 (the CPU), else in bf16
    (exact for these values) with fp32 accumulation and one rounding. An op of its own: the
    traced _grouped_mm takes bf16 only, which on the CPU would round an fp32 model's output."""
    compute = torch.float32 if a.device.type == "cpu" else torch.bfloat16
    return torch._grouped_mm(a.to(compute), b.to(compute), offs=ends).to(out_dtype)


def _exact_grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor,
                           out_dtype: torch.dtype) -> torch.Tensor:
    if b.dim() == 3:  # rows grouped: [R, K] x [E, K, N] -> [R, N]
        return a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype)
    return a.new_empty(ends.shape[0], a.shape[0], b.shape[1], dtype=out_dtype)  # 2-D x 2-D


_grouped_mm = define_op("exact_grouped_mm", _exact_grouped_mm, _exact_grouped_mm_fake)


class GroupedOffsetsBlocks(torch.autograd.Function):
    """y[rows of g] = x[rows of g] W_g^T for the 3-D weight [E, N, K] under block formats,
    the groups given by `ends` on the device (module docstring). `rebuild` and
    `save_original`: keep the weight or x instead of backward's copy of it (as
    GroupedOffsetsFP8 does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor,
                blocks: OffsetsBlocks, need_dgrad: bool, need_wgrad: bool, rebuild: bool,
                save_original: bool) -> torch.Tensor:
        experts, n, k = weight.shape
        x_rows = blocks.input.values(x, columnwise=False)
        w_rows = blocks.weight.values(weight.reshape(experts * n, k),
                                      columnwise=False).reshape(experts, n, k)
        y = _grouped_mm(x_rows, w_rows.transpose(1, 2), ends, x.dtype)
        x_kept = w_kept = None
        if need_wgrad:
            x_kept = x.detach() if save_original else _columns(blocks.input, x)
        if need_dgrad:
            w_kept = weight.detach() if rebuild else _weight_columns(blocks.weight, weight)
        ctx.save_for_backward(x_kept, w_kept, ends)
        ctx.blocks, ctx.need_dgrad, ctx.need_wgrad = blocks, need_dgrad, need_wgrad
        ctx.rebuild, ctx.save_original = rebuild, save_original
        ctx.weight_dtype = weight.dtype
        return y

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x_kept, w_kept, ends = ctx.saved_tensors
        blocks = ctx.blocks
        dy = grad_output.contiguous()
        grad_x = grad_weight = None
        if ctx.need_dgrad:
            w_cols = _weight_columns(blocks.weight, w_kept) if ctx.rebuild else w_kept
            grad_x = _grouped_mm(blocks.grad_output.values(dy, columnwise=False), w_cols, ends,
                                 grad_output.dtype)
        if ctx.need_wgrad:
            x_cols = _columns(blocks.input, x_kept) if ctx.save_original else x_kept
            dy_cols = blocks.grad_output.values(dy, columnwise=True)
            product = _grouped_mm(dy_cols.t(), x_cols, ends, torch.float32)
            counts = torch.diff(ends, prepend=ends.new_zeros(1))
            # an empty group's gradient is zero, whatever the kernel leaves there
            grad_weight = torch.where(counts[:, None, None] > 0, product,
                                      0.0).to(ctx.weight_dtype)
        return grad_x, grad_weight, None, None, None, None, None, None


def _kept_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype backward's dequantized copies are kept in: the GEMM's (exact either way)."""
    return torch.float32 if x.device.type == "cpu" else torch.bfloat16


def _columns(cast: BlockCast, x: torch.Tensor) -> torch.Tensor:
    """x's columnwise copy's values [R, K], for wgrad."""
    return cast.values(x, columnwise=True).to(_kept_dtype(x))


def _weight_columns(cast: BlockCast, weight: torch.Tensor) -> torch.Tensor:
    """The stacked weights' columnwise copies' values [E, N, K], for dgrad."""
    experts, n, k = weight.shape
    return cast.values(weight.reshape(experts * n, k),
                       columnwise=True).reshape(experts, n, k).to(_kept_dtype(weight))
