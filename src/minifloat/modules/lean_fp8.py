"""The lean eager path of one per-tensor FP8 GEMM (current or delayed scaling): LinearGemms'
bytes, with nothing but kernel calls on the hot path.

Why: an eager FP8 step is host-bound. At the 1b preset on an H100 the general path
(LinearGemms: GemmCall, split_quantize, quantizer objects, storages, general_gemm's dispatch,
keep_for_backward) spent about 660 us of host time on a Linear forward and 840 us on its
backward, against 34 us and 114 us for nn.Linear, so the step took 1.5x its GPU time. This path
serves the most common case, per-tensor current scaling of one GEMM (Linear, LayerNormLinear,
each GEMM of LayerNormMLP), with the same kernels called with the same arguments as the
quantizers call them, and the same torch._scaled_mm call as gemm_paths.scaled_mm_gemm
(gemm_paths.scaled_mm_bytes): the bytes of every output and gradient are the general path's
(the GPU tests compare both bit for bit).

Eligibility is decided once per module, recipe and GEMM (LeanPlan.for_quantizers, kept in the
module's binding): the input, weight and grad_output quantizers are exactly
Float8CurrentScalingQuantizer with no amax reduction group (a TP layer's reduced amax takes the
general path) or Float8Quantizer (delayed scaling: the slot's scale and amax, recorded into as
the quantizer records; not inside activation recompute, whose replay of the scales is the
general path's), no subclass, and not E5M2 on both sides of a GEMM (cuBLAS has no such FP8
GEMM). Per call (`applies`): a CUDA input, contiguous, of a kernel dtype, with whole 16-element
multiples on M, K and N (scaled_mm's rule); a plain weight, or a QuantizedTensor weight of
per-tensor FP8 bytes with its rowwise copy (FSDP2's low-precision all-gather brings those each
step, quantized_model_init keeps them: the GEMMs read its bytes, as LinearGemms does), not a
DTensor or other subclass, without a `main_grad`; one split; is_first_microbatch None. Anything
else takes LinearGemms, which handles every case; MINIFLOAT_LEAN_PATH=0 sends everything there.
(Under FSDP2's FP8 all-gather the general path cost 60 ms of host time a step at the 1b preset
on an H200, BENCHMARKS.md 2026-11-26.)

What is kept for backward is what LinearGemms keeps: the input's columnwise copy through
save_for_backward (offload and recompute hooks see it), the weight's columnwise copy on ctx,
dropped once backward has read it unless the graph is retained; with the module's
rebuild_weight_copy_in_backward (FSDP2), the weight itself instead, cast again in backward; with
its save_original_input, the input itself instead of its copy, cast again in backward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .. import kernels, numerics
from ..gemm_paths import scaled_mm_bytes
from ..quantizers import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Storage,
    QuantizedTensor,
    Quantizer,
)
from ..quantizers.base import kernel_module
from . import weight_cast_batch
from .linear_function import as_output, graph_kept

ENABLED = os.environ.get("MINIFLOAT_LEAN_PATH", "1") != "0"
# where the lean path runs; tests widen it to the CPU (torch._scaled_mm exists there too) to
# check its bookkeeping without a GPU
DEVICES = ("cuda",)


@dataclass(frozen=True, eq=False)
class Cast:
    """One operand's per-tensor FP8 cast, as its quantizer would make it: current scaling
    (scale None: the amax of the tensor itself) or delayed scaling (the recipe state's slot:
    `scale` read, `amax` recorded into, both 1-element views owned by the state)."""

    fp8_dtype: torch.dtype
    amax_epsilon: float = 0.0
    power_2_scale: bool = False
    scale: torch.Tensor | None = None
    amax: torch.Tensor | None = None

    @staticmethod
    def of(quantizer: Quantizer) -> Cast | None:
        kind = type(quantizer)
        if kind is Float8CurrentScalingQuantizer and quantizer.amax_reduction_group is None:
            return Cast(quantizer.fp8_dtype, quantizer.amax_epsilon, quantizer.power_2_scale)
        if kind is Float8Quantizer:
            return Cast(quantizer.fp8_dtype, scale=quantizer.scale, amax=quantizer.amax)
        return None

    def again(self, forward_scale: torch.Tensor | None) -> Cast:
        """This cast as backward repeats it for a copy forward did not keep: with forward's
        scale under delayed scaling (the slot is updated before backward), recording the amax
        into a scratch tensor; current scaling as it is (same input, same amax)."""
        if forward_scale is None:
            return self
        return Cast(self.fp8_dtype, scale=forward_scale, amax=torch.zeros_like(self.amax))

    def __call__(self, x2d: torch.Tensor, *, rowwise: bool, columnwise: bool,
                 amax: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """(data [M, K] or None, data_t [K, M] or None, scale_inv): the quantizer's bytes.
        `amax`: max|x2d| as a 1-element fp32 tensor, computed already (the compiled ops take
        it from inductor, which fuses it into the kernel that produced x2d); current scaling's
        cast then skips its own amax pass. The same maximum gives the same bytes."""
        if kernels.available(x2d):
            per_tensor_fp8 = kernel_module("per_tensor_fp8")
            if self.scale is None:
                return per_tensor_fp8.quantize_current_scaling(
                    x2d, self.fp8_dtype, amax=amax, amax_epsilon=self.amax_epsilon,
                    power_2_scale=self.power_2_scale, rowwise=rowwise, columnwise=columnwise)
            if per_tensor_fp8.kernel_input(x2d, self.scale, self.amax):
                return per_tensor_fp8.quantize_delayed_scaling(
                    x2d, self.scale, self.amax, self.fp8_dtype, rowwise=rowwise,
                    columnwise=columnwise)
        # no kernels (the CPU tests), or state elsewhere: the reference's cast, as the
        # quantizers make it without kernels (current scaling: with `amax` where given)
        if self.scale is None:
            data, scale_inv = numerics.quantize_current_scaling(
                x2d, self.fp8_dtype, amax=None if amax is None else amax.reshape(()),
                amax_epsilon=self.amax_epsilon, power_2_scale=self.power_2_scale)
            return (data if rowwise else None, data.t().contiguous() if columnwise else None,
                    scale_inv.reshape(1))
        quantizer = Float8Quantizer(self.scale, self.amax, self.fp8_dtype, rowwise=rowwise,
                                    columnwise=columnwise)
        quantizer.internal = True
        storage = quantizer(x2d)
        return storage.data, storage.data_transpose, storage.scale_inv


@dataclass(frozen=True, eq=False)
class LeanPlan:
    """The casts of one GEMM's input, weight and grad_output."""

    input: Cast
    weight: Cast
    grad_output: Cast

    @staticmethod
    def for_quantizers(input_quantizer: Quantizer, weight_quantizer: Quantizer,
                       grad_output_quantizer: Quantizer) -> LeanPlan | None:
        """The plan, or None when these quantizers need the general path."""
        casts = [Cast.of(q) for q in (input_quantizer, weight_quantizer, grad_output_quantizer)]
        if any(cast is None for cast in casts):
            return None
        plan = LeanPlan(*casts)
        e5m2 = torch.float8_e5m2
        # fprop x.W, dgrad dy.W, wgrad dy.x: none may pair two E5M2 operands
        if plan.weight.fp8_dtype == e5m2 and e5m2 in (plan.input.fp8_dtype,
                                                      plan.grad_output.fp8_dtype):
            return None
        if plan.input.fp8_dtype == plan.grad_output.fp8_dtype == e5m2:
            return None
        return plan


def fp8_weight_storage(weight: torch.Tensor) -> Float8Storage | None:
    """The per-tensor FP8 storage of a QuantizedTensor weight holding its rowwise bytes."""
    if isinstance(weight, QuantizedTensor):
        storage = weight.quantized_storage
        if type(storage) is Float8Storage and storage.data is not None:
            return storage
    return None


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The per-call conditions (module docstring): cheap attribute tests only."""
    if not ENABLED or x.device.type not in DEVICES or not x.is_contiguous():
        return False
    if hasattr(weight, "main_grad") or (
            type(weight) not in (torch.nn.Parameter, torch.Tensor)
            and fp8_weight_storage(weight) is None):
        return False
    if x.dim() == 0:
        return False
    n, k = weight.shape
    if x.shape[-1] != k:
        return False  # the general path raises the error that names the shapes
    return shapes_apply(x.device.type, x.dtype, x.numel() // k if k else 0, k, n)


def shapes_apply(device_type: str, dtype: torch.dtype, m: int, k: int, n: int) -> bool:
    """The conditions on device, dtype and GEMM shape [M, K] x [N, K]^T (scaled_mm's rule)."""
    return (ENABLED and device_type in DEVICES
            and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and m > 0 and m % 16 == 0 and k % 16 == 0 and n % 16 == 0)


def forward_gemm(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 plan: LeanPlan, *, input_columnwise: bool, keep_weight: bool,
                 weight_copies: weight_cast_batch.Copies | None = None,
                 input_amax: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, tuple, tuple, bool]:
    """Fprop of one lean GEMM, shared by LeanFP8Gemm and the compiled ops (lean_ops.py):
    (y [M, N], (x_t, x_scale_inv), (w_t, w_scale_inv), whether the weight was already FP8).
    The input is cast (with its columnwise copy if asked), the weight's own bytes are read when
    it is FP8 already (the transpose derived onto it, as LinearGemms does, if kept), and cast
    otherwise, unless `weight_copies` (data, data_t, scale_inv) brings that cast made already
    (weight_cast_batch.py). `input_amax`: max|x2d|, computed already (Cast.__call__)."""
    x_data, x_t, x_scale_inv = plan.input(x2d, rowwise=True, columnwise=input_columnwise,
                                          amax=input_amax)
    stored = fp8_weight_storage(weight)
    if weight_copies is not None:
        w_data, w_t, w_scale_inv = weight_copies
        w_t = w_t if keep_weight else None
    elif stored is not None:
        stored.update_usage(rowwise=True, columnwise=True if keep_weight else None)
        w_data, w_t, w_scale_inv = stored.data, stored.data_transpose, stored.scale_inv
    else:
        w_data, w_t, w_scale_inv = plan.weight(weight.detach(), rowwise=True,
                                               columnwise=keep_weight)
    y = scaled_mm_bytes(x_data, w_data, x_scale_inv, w_scale_inv, out_dtype=x2d.dtype,
                        bias=bias, fast_accumulation=True)
    return y, (x_t, x_scale_inv), (w_t, w_scale_inv), stored is not None


def batched_weight_copies(module: torch.nn.Module, weight: torch.Tensor, plan: LeanPlan,
                          need_wgrad: bool, rebuild: bool) -> weight_cast_batch.Copies | None:
    """The weight's copies from the pass's batched cast (weight_cast_batch.py) for a training
    forward, or None (LeanFP8Gemm casts the weight itself)."""
    if not need_wgrad or rebuild:
        return None
    return weight_cast_batch.take(module, weight, plan.weight)


def weight_transpose(weight: torch.Tensor, cast: Cast) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_t, w_scale_inv) for dgrad, made in backward when forward kept no copy: an FP8 weight's
    own bytes transposed, on a view (FSDP2's unsharded weight would otherwise keep every layer's
    transpose until its next gather), a high-precision weight cast with `cast`."""
    if isinstance(weight, QuantizedTensor):
        stored = fp8_weight_storage(weight)
        if stored is None:
            raise ValueError("the FP8 weight came to backward without its rowwise bytes "
                             "(an FSDP2 re-gather of another format?); gather it in high "
                             "precision")
        stored = stored.detach()
        stored.update_usage(columnwise=True)
        return stored.data_transpose, stored.scale_inv
    _, w_t, w_scale_inv = cast(weight.detach(), rowwise=False, columnwise=True)
    return w_t, w_scale_inv


class LeanFP8Gemm(torch.autograd.Function):
    """y = x W^T + b in per-tensor FP8, current or delayed scaling (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                plan: LeanPlan, need_dgrad: bool, need_wgrad: bool,
                rebuild: bool = False, save_original: bool = False,
                weight_copies: weight_cast_batch.Copies | None = None) -> torch.Tensor:
        """weight_copies: the weight's cast made already (batched_weight_copies), or None."""
        n, k = weight.shape
        x2d = x.reshape(-1, k)
        rebuild = rebuild and need_dgrad
        save_original = save_original and need_wgrad
        y, (x_t, x_scale_inv), (w_t, w_scale_inv), quantized = forward_gemm(
            x2d, weight, bias, plan, input_columnwise=need_wgrad and not save_original,
            keep_weight=need_dgrad and not rebuild, weight_copies=weight_copies)
        # save_original_input: the input itself (backward casts it again, with forward's scale
        # under delayed scaling, the recipe state's slot being updated before backward runs)
        kept = (x,) if save_original else (x_t, x_scale_inv) if need_wgrad else ()
        ctx.save_original = save_original
        ctx.input_scale = (plan.input.scale.clone()
                           if save_original and plan.input.scale is not None else None)
        # rebuild (FSDP2): keep the weight itself, as F.linear does, and the scale a delayed
        # cast used (the recipe state's slot is updated before backward runs). A quantized
        # weight is kept by reference: FSDP2's re-gather refills that very object for backward,
        # which an offload hook's copy would not see (LinearGemms does the same)
        by_reference = rebuild and quantized
        ctx.save_for_backward(*kept, *((weight,) if rebuild and not by_reference else ()))
        ctx.weight_by_reference = weight if by_reference else None
        ctx.rebuild_scale = (plan.weight.scale.clone()
                             if rebuild and not quantized and plan.weight.scale is not None
                             else None)
        ctx.rebuild = rebuild
        ctx.weight_copy = (w_t, w_scale_inv) if need_dgrad and not rebuild else None
        ctx.plan, ctx.need_dgrad, ctx.need_wgrad = plan, need_dgrad, need_wgrad
        ctx.x_shape, ctx.out_dtype, ctx.weight_dtype = x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        return as_output(y, (*x.shape[:-1], n))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        dy2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_bias = dy2d.sum(dim=0) if ctx.has_bias else None  # as LinearGemms sums it
        if not dy2d.is_contiguous():
            dy2d = dy2d.contiguous()  # the kernels read it as is; the bytes do not change
        grad_x = grad_weight = None
        if not (ctx.need_dgrad or ctx.need_wgrad):  # only the bias needs a gradient
            return grad_x, grad_weight, grad_bias, None, None, None, None, None, None
        dy_data, dy_t, dy_scale_inv = ctx.plan.grad_output(
            dy2d, rowwise=ctx.need_dgrad, columnwise=ctx.need_wgrad)
        saved = ctx.saved_tensors
        if ctx.need_dgrad:
            if ctx.rebuild:  # the copy forward would have kept (the re-gathered FP8 bytes)
                weight = (ctx.weight_by_reference if ctx.weight_by_reference is not None
                          else saved[-1])
                w_t, w_scale_inv = weight_transpose(weight,
                                                    ctx.plan.weight.again(ctx.rebuild_scale))
                if not graph_kept():
                    ctx.weight_by_reference = None
            else:
                w_t, w_scale_inv = ctx.weight_copy
            grad_x2d = scaled_mm_bytes(dy_data, w_t, dy_scale_inv, w_scale_inv,
                                       out_dtype=ctx.out_dtype, bias=None,
                                       fast_accumulation=False)
            grad_x = as_output(grad_x2d, ctx.x_shape)
            if not graph_kept():
                ctx.weight_copy = None  # as LinearGemms: freed once read
        if ctx.need_wgrad and ctx.save_original:  # the copy forward would have kept, made now
            x = saved[0].detach()
            _, x_t, x_scale_inv = ctx.plan.input.again(ctx.input_scale)(
                x.reshape(-1, x.shape[-1]), rowwise=False, columnwise=True)
        elif ctx.need_wgrad:
            x_t, x_scale_inv = saved[:2]
        if ctx.need_wgrad:
            grad_weight = scaled_mm_bytes(dy_t, x_t, dy_scale_inv, x_scale_inv,
                                          out_dtype=ctx.weight_dtype, bias=None,
                                          fast_accumulation=False)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None
