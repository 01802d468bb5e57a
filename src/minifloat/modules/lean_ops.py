"""The lean path inside the compiled GEMM ops: one per-tensor FP8 current-scaling GEMM as
kernel calls, without quantizer objects or storages, as LeanFP8Gemm runs it eagerly.

Why: the compiled ops (gemm_op.py) run the general forward and backward (GemmCall, quantizers,
storages, keep_for_backward) on every call. With CUDA graphs (mode="reduce-overhead") that
Python runs once at capture, but FSDP2's hooks rule CUDA graphs out, and there the ops' Python
was most of the step's host time: at the 1b preset on an H200, 0.48 ms per forward and 0.74 ms
per backward op call, 97 ms of a step whose kernels take 87 ms (BENCHMARKS.md, seventh session).

The ops' outputs keep their layout: the forward returns the buffers the general path keeps, in
its order (the input's columnwise bytes and scale_inv, then the weight's, unless backward
rebuilds it), so the backward of either path reads what the forward of either path kept, and
the fake implementation (the reference path) lays out the same tensors. The bytes are the
general path's (the same kernels and the same torch._scaled_mm call, gemm_paths.scaled_mm_bytes;
the GPU tests compare the paths bit for bit).

Serves stateless plans only (current scaling: no recipe-state tensors to read or record into),
one GEMM, and the per-call conditions of lean_fp8.applies. Under save_original_input the
forward casts the input rowwise only; the autograd formula makes its columnwise copy in
backward (input_recast.py) from forward's amax.
"""

from __future__ import annotations

import math

import torch

from ..gemm_paths import scaled_mm_bytes
from .input_recast import tensor_maximum
from .lean_fp8 import LeanPlan, applies, forward_gemm, shapes_apply, weight_transpose
from .linear_function import BACKWARD_SLOTS, FORWARD_SLOTS

_LEAN_PLANS: dict[tuple[int, int], LeanPlan | None] = {}


def lean_plan(plan_id: int, gemms: list[int], stateless) -> LeanPlan | None:
    """The lean plan of GEMM gemms[0] under a stateless plan (None: the general path)."""
    if stateless is None or len(gemms) != 1:
        return None
    key = (plan_id, gemms[0])
    if key not in _LEAN_PLANS:
        forward, backward = stateless
        slot = len(FORWARD_SLOTS) * gemms[0]
        _LEAN_PLANS[key] = LeanPlan.for_quantizers(
            forward[slot], forward[slot + 1], backward[len(BACKWARD_SLOTS) * gemms[0]])
    return _LEAN_PLANS[key]


def lean_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 plan: LeanPlan, need_dgrad: bool, need_wgrad: bool, rebuild: bool,
                 input_amax: torch.Tensor | None = None) -> list[torch.Tensor]:
    """[y, x_t, x_scale_inv (if need_wgrad), w_t, w_scale_inv (if need_dgrad, not rebuild)];
    `input_amax`: max|x|, computed already (compiled_amax)."""
    n, k = weight.shape
    keep_weight = need_dgrad and not rebuild
    y, (x_t, x_scale_inv), (w_t, w_scale_inv), _ = forward_gemm(
        x.reshape(-1, k), weight, bias, plan, input_columnwise=need_wgrad,
        keep_weight=keep_weight, input_amax=input_amax)
    outputs = [y.reshape(*x.shape[:-1], n)]
    if need_wgrad:
        outputs += [x_t, x_scale_inv.reshape(1)]
    if keep_weight:
        outputs += [w_t, w_scale_inv.reshape(1)]
    return outputs


def lean_backward(grad_output: torch.Tensor, saved: list[torch.Tensor], plan: LeanPlan,
                  x_shape: list[int], has_bias: bool, need_dgrad: bool, need_wgrad: bool,
                  rebuild_from: list[torch.Tensor], grad_output_amax: torch.Tensor | None = None
                  ) -> list[torch.Tensor]:
    """[dx if need_dgrad] + [dW if need_wgrad] + [db if has_bias], from what lean_forward (or
    the general forward) kept; `rebuild_from`: [the weight] when forward kept no copy of it;
    `grad_output_amax`: max|grad_output|, computed already (compiled_amax)."""
    dy2d = grad_output.reshape(-1, grad_output.shape[-1])
    outputs = []
    grad_bias = dy2d.sum(dim=0) if has_bias else None  # as the general path sums it
    if need_dgrad or need_wgrad:
        dy2d = dy2d.contiguous()
        dy_data, dy_t, dy_scale_inv = plan.grad_output(dy2d, rowwise=need_dgrad,
                                                       columnwise=need_wgrad,
                                                       amax=grad_output_amax)
    kept = iter(saved)
    if need_wgrad:
        x_t, x_scale_inv = next(kept), next(kept)
    if need_dgrad:
        if rebuild_from:  # current scaling casts the same weight to the same bytes again
            w_t, w_scale_inv = weight_transpose(rebuild_from[0], plan.weight)
        else:
            w_t, w_scale_inv = next(kept), next(kept)
        grad_x = scaled_mm_bytes(dy_data, w_t, dy_scale_inv, w_scale_inv,
                                 out_dtype=grad_output.dtype, bias=None,
                                 fast_accumulation=False)
        outputs.append(grad_x.reshape(x_shape))
    if need_wgrad:
        outputs.append(scaled_mm_bytes(dy_t, x_t, dy_scale_inv, x_scale_inv,
                                       out_dtype=grad_output.dtype, bias=None,
                                       fast_accumulation=False))
    if grad_bias is not None:
        outputs.append(grad_bias)
    return outputs


def compiled_amax(x: torch.Tensor) -> list[torch.Tensor]:
    """[max|x| as fp32] in torch ops for a current-scaling cast of x inside the compiled ops
    ([] for an empty x).

    Why: the one-launch cast reads x twice, once for its amax and once to cast (about 1.5x the
    bytes of a delayed-scaling cast: 11.7 against 7.1 ms a step at the 1b preset on an H200,
    BENCHMARKS.md). Written as torch ops in the traced graph, the maximum is fused by inductor
    into the kernel that produces x (the norm, the GELU, their backward, the concatenation of
    attention's gradients), and the cast reads x once. Those kernels become split reductions
    and slow down by about what the second read cost; the step gained about 1 ms (GPU time
    72.8 -> 71.7 ms, KERNEL_NOTES.md, eighteenth session). A maximum is exact however it is
    computed, so the bytes do not change."""
    return [] if x.numel() == 0 else [tensor_maximum(x).reshape(1)]


def forward_applies(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    return len(weights) == 1 and applies(x, weights[0])


def backward_applies(grad_output: torch.Tensor, x_shape: list[int],
                     weight_shapes: list[int]) -> bool:
    """lean_fp8's conditions, from the shapes backward knows."""
    if len(weight_shapes) != 2:
        return False
    m = math.prod(x_shape[:-1])
    return shapes_apply(grad_output.device.type, grad_output.dtype, m, x_shape[-1],
                        weight_shapes[0])
