"""Under torch.compile: a GEMM whose per-tensor FP8 input is cast in torch ops ahead of the
GEMM op, so that inductor fuses the cast with whatever made the input (experimental, opt-in:
MINIFLOAT_COMPILED_INPUT_CAST=1; issue 15's norm + quantize and activation + quantize fusions).

Why: the GEMM custom op (gemm_op.py) takes the high-precision input, and a custom op's input is
always materialized: the norm's or GELU's bf16 output is written, then read twice by the cast
kernel (amax pass and cast pass). Cast here in torch ops (input_recast.per_tensor_cast, the
kernels' bytes), the input is only read by fusible ops, so inductor may compute the norm or the
activation inside the amax and cast kernels and never write it. The GEMM op then receives the
FP8 bytes (`minifloat::gemms_forward_quantized`).

Why an autograd.Function around both: the op's input would otherwise be the FP8 data, and an FP8
tensor cannot carry the bf16 input gradient (autograd casts a gradient to its input's dtype).
The Function's input is the high-precision x; its backward calls the same backward op as
gemm_op with the buffers in the same layout (the input's transposed copy and scale_inv, made
here in forward, or with save_original_input in backward, as gemm_op does).

Scope: one GEMM per call, per-tensor current scaling without an amax reduction group, stateless
plans (no delayed scaling: its amax recording would be a graph-input mutation). Whether it pays
is for the GPU to say (benchmarks/model_step.py with the variable set); off by default.
"""

from __future__ import annotations

import math
import os

import torch

from ..quantizers import Float8CurrentScalingQuantizer, Float8Storage
from .gemm_op import (
    _PLANS,
    _gemm_call,
    _gemms_backward_op,
    _slot_quantizers,
    _unaliased,
    _with_biases,
    rebuild_applies,
)
from .input_recast import (
    columnwise_storage,
    input_copy_buffers,
    kept_buffers,
    per_tensor_cast,
)
from .linear_function import as_output, fprop_gemms, keep_for_backward

ENABLED = os.environ.get("MINIFLOAT_COMPILED_INPUT_CAST", "0") == "1"


def applies(plan: int, gemms: list[int]) -> bool:
    """Whether this call can take the cast-fused route (see the module docstring)."""
    if not ENABLED or len(gemms) != 1 or _PLANS[plan].stateless is None:
        return False
    quantizer = _slot_quantizers(plan, gemms, 0)[0]
    return (type(quantizer) is Float8CurrentScalingQuantizer
            and quantizer.amax_reduction_group is None)


def _forward_quantized_impl(
    x_data: torch.Tensor, x_scale_inv: torch.Tensor, weights: list[torch.Tensor],
    biases: list[torch.Tensor], has_bias: list[bool], plan: int, gemms: list[int],
    need_dgrad: bool, rebuild: bool, out_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """[y, the weights' kept buffers]: fprop of an input already cast (rowwise bytes)."""
    call = _gemm_call(plan, [], gemms, [x_data.shape[0]], need_dgrad, False, rebuild)
    quantizer = call.input_quantizers[0]
    x_q = Float8Storage(shape=x_data.shape, dtype=out_dtype, quantizer=quantizer, data=x_data,
                        data_transpose=None, scale_inv=x_scale_inv,
                        fp8_dtype=quantizer.fp8_dtype)
    keep_weights = call.need_dgrad and not call.rebuild_weights
    y, w_qs = fprop_gemms([x_q], weights, _with_biases(biases, has_bias),
                          call.weight_quantizers, None, need_dgrad=keep_weights,
                          out_dtype=out_dtype)
    kept = keep_for_backward([None], w_qs, need_dgrad=keep_weights, need_wgrad=False)
    buffers = [t.contiguous() for t in kept.tensors if t is not None]
    return [y.contiguous()] + _unaliased(buffers, [x_data, x_scale_inv, *weights, *biases])


_forward_quantized = torch.library.custom_op("minifloat::gemms_forward_quantized",
                                             mutates_args=())(_forward_quantized_impl)
# the op on fake tensors is its own fake implementation (the reference path lays out the same
# buffers as the kernels), as gemm_op's forward op
_forward_quantized.register_fake(_forward_quantized_impl)


class CastFusedGemm(torch.autograd.Function):
    """y = x W^T + b with x cast in torch ops and the GEMMs in minifloat's ops."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan, gemm, need_dgrad, need_wgrad, rebuild,
                save_original):
        n, k = weight.shape
        x2d = x.reshape(-1, k)
        quantizer = _slot_quantizers(plan, [gemm], 0)[0]
        data, scale_inv = per_tensor_cast(x2d, quantizer)
        biases = [bias] if bias is not None else []
        outputs = _forward_quantized(data, scale_inv, [weight], biases, [bias is not None],
                                     plan, [gemm], need_dgrad, rebuild, x.dtype)
        x_part = []
        if need_wgrad:
            x_part = [x] if save_original else kept_buffers(
                columnwise_storage(data, scale_inv, x.dtype, quantizer))
        ctx.save_for_backward(*x_part, *outputs[1:], *([weight] if rebuild and need_dgrad
                                                        else []))
        ctx.constants = (plan, gemm, need_dgrad, need_wgrad, rebuild, save_original,
                         list(x.shape), [n, k], bias is not None, len(outputs) - 1)
        return as_output(outputs[0], (*x.shape[:-1], n))

    @staticmethod
    def backward(ctx, grad_output):
        (plan, gemm, need_dgrad, need_wgrad, rebuild, save_original, x_shape, weight_shape,
         has_bias, kept_count) = ctx.constants
        tensors = list(ctx.saved_tensors)
        x_part = tensors[:(1 if save_original else 2)] if need_wgrad else []
        rest = tensors[len(x_part):]
        kept, rebuild_from = rest[:kept_count], rest[kept_count:]
        if save_original and need_wgrad:
            x_part = input_copy_buffers(x_part[0], _slot_quantizers(plan, [gemm], 0))
        rows = math.prod(x_shape[:-1])
        outputs = iter(_gemms_backward_op(
            grad_output.contiguous(), x_part + kept, [], plan, [gemm], [rows], x_shape,
            weight_shape, [has_bias], need_dgrad, need_wgrad, rebuild_from, []))
        grad_x = next(outputs) if need_dgrad else None
        grad_weight = next(outputs) if need_wgrad else None
        grad_bias = next(outputs) if has_bias else None
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None


def cast_fused_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    plan: int, gemm: int, *, need_dgrad: bool, need_wgrad: bool,
                    rebuild: bool, save_original_input: bool) -> torch.Tensor:
    """compiled_gemms' route for calls that `applies` (rebuild as rebuild_applies allows)."""
    return CastFusedGemm.apply(x, weight, bias, plan, gemm, need_dgrad, need_wgrad,
                               rebuild and rebuild_applies(plan, [gemm]), save_original_input)
