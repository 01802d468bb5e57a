"""The lean eager path of a mixture of experts' grouped GEMM under per-tensor FP8 scaling
(current or delayed): one grouped GEMM for every expert in forward, and under current scaling
each operand of every expert cast in one multi-tensor launch pair.

Why: FusedExperts runs 2 x E expert GEMMs a layer. Through the general path (run_gemms:
LinearGemms, a GemmCall, quantizer objects and storages per expert, one _scaled_mm per expert
and direction) a Mixtral-style MoE step at 4 x 2048 tokens on an H200 issued 2800 kernels and
spent 119 ms of host time for a 149 ms step, 0.65x the bf16 step that runs transformers'
grouped_mm (BENCHMARKS.md, 2026-11-26 fourth session). Here, per grouped GEMM:

- forward: the experts' row blocks of the input (rows sorted by expert, each block padded to a
  multiple of 16 with zero rows, as FusedExperts lays them out) in one multi-tensor cast (every
  block its own amax and scale, the bytes of that block's own current-scaling cast:
  kernels.multi_tensor), the experts' weights [E, N, K] likewise, then one
  `torch._scaled_grouped_mm` (sm90 CUTLASS, E4M3 x E4M3, bf16 out) with the per-tensor scales
  given as its rowwise scale vectors: row r of the input gets its expert's scale_inv, column n
  of expert e's weight gets e's. The bytes are those the general path quantizes; only the GEMM
  differs (its summation order, and the two scales applied one after the other in the
  epilogue: within one rounding of fp32 of the per-tensor alpha).
- backward: the gradient's blocks in one multi-tensor cast; dgrad one grouped GEMM when the
  gradient is E4M3 (the kernel takes E4M3 only), else (HYBRID's E5M2 gradients) one _scaled_mm
  per expert, the general path's call; wgrad one _scaled_mm per expert (the general path's call,
  same bytes) into the stacked [E, N, K] gradient of the 3-D weight.

Delayed scaling: each expert's operands cast with that expert's recipe-state slots (scale
read, amax recorded, as the general path records them; one launch per expert and operand, the
multi-tensor kernels being current scaling's), the module's states noted in autocast's round;
inside minifloat.checkpoint's recompute the general path replays the recorded scales.

Eligibility (GroupedPlan.for_lean_plans, `applies`): every expert GEMM has a lean plan, all
current or all delayed scaling, one FP8 dtype per operand (other formats, a CustomRecipe that
mixes them, TP amax reduction take the general path); a CUDA input, contiguous, of a kernel dtype,
K and N multiples of 16, every block a multiple of 16 rows; a plain 3-D weight (no
QuantizedTensor, DTensor or main_grad); eager only (FusedExperts reads its token counts on the
host, so a compiled graph takes the general ops); not inside quantize_weights_once.
MINIFLOAT_LEAN_PATH=0 turns this path off with the single-GEMM one.

Where torch._scaled_grouped_mm cannot serve (the CPU, not sm90, a non-bf16 output, an E5M2
operand), the grouped GEMM is the per-expert loop of _scaled_mm calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from .. import kernels
from ..autocast import active_token, get_autocast_state, note_delayed_use
from ..gemm_paths import scaled_mm_bytes
from ..kernels.stacked_cast import SCALE_SLOT, StackedCast
from ..quantizers.base import kernel_module
from . import lean_fp8
from .base import QuantizedModule
from .lean_fp8 import Cast, LeanPlan
from .linear_function import graph_kept
from .weights import weights_quantized_once

ROW_MULTIPLE = 16  # scaled_mm's rule on M, K and N; FusedExperts pads each expert's rows to it


@dataclass(frozen=True, eq=False)
class GroupedPlan:
    """Every expert's casts of its input, weight and grad_output (lean_fp8.Cast: current
    scaling, or delayed scaling with that expert's own recipe-state slots)."""

    inputs: tuple[Cast, ...]
    weights: tuple[Cast, ...]
    grad_outputs: tuple[Cast, ...]

    @staticmethod
    def for_lean_plans(plans: list[LeanPlan | None]) -> GroupedPlan | None:
        """The plan when every expert GEMM has a lean plan, all current scaling or all delayed
        scaling, with one FP8 dtype per operand (the grouped GEMM reads one dtype per side)."""
        if not plans or any(plan is None for plan in plans):
            return None
        first = plans[0]
        for plan in plans:
            for slot in ("input", "weight", "grad_output"):
                cast, want = getattr(plan, slot), getattr(first, slot)
                if (cast.scale is None) != (first.input.scale is None):
                    return None
                if cast.fp8_dtype != want.fp8_dtype:
                    return None
        return GroupedPlan(tuple(plan.input for plan in plans),
                           tuple(plan.weight for plan in plans),
                           tuple(plan.grad_output for plan in plans))


def module_plan(module: QuantizedModule, first_gemm: int, experts: int
                ) -> GroupedPlan | None:
    """The lean grouped plan of `module`'s GEMMs first_gemm .. first_gemm + experts - 1 for
    this call, or None (outside autocast, compiling, inside quantize_weights_once, or a recipe
    the path does not serve). Made once per binding and GEMM range, kept on the module."""
    token = active_token()
    if token == 0 or torch.compiler.is_compiling() or weights_quantized_once():
        return None
    binding = module._bindings.get(token) or module.binding(token)
    if binding.delayed_pair is not None:
        if get_autocast_state().recompute_record is not None:
            return None  # minifloat.checkpoint replays recorded scales: the general path's
        note_delayed_use(binding.delayed_pair)  # this round's update takes these amaxes
    # (a module unpickled from before this cache existed gets one here)
    plans = module.__dict__.setdefault("_grouped_plans", {})
    kept = plans.get((token, first_gemm))
    if kept is None or kept[0] is not binding:  # a new binding (set_consumer_roles) remakes it
        kept = (binding, GroupedPlan.for_lean_plans(
            binding.lean_plans[first_gemm:first_gemm + experts]))
        plans[(token, first_gemm)] = kept
    return kept[1]


def applies(x: torch.Tensor, weights: tuple[torch.Tensor, ...], counts: list[int]) -> bool:
    """The per-call conditions (module docstring): cheap attribute tests only. `weights`: one
    3-D tensor [E, N, K] (FusedExperts) or E tensors [N, K] (GroupedLinear)."""
    if not lean_fp8.ENABLED or x.device.type not in lean_fp8.DEVICES or not x.is_contiguous():
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.dim() != 2:
        return False
    matrices = 3 if len(weights) == 1 else 2
    first = weights[0]
    for weight in weights:
        if type(weight) not in (torch.nn.Parameter, torch.Tensor) or hasattr(weight,
                                                                            "main_grad"):
            return False
        if (weight.dim() != matrices or not weight.is_contiguous()
                or weight.shape != first.shape or weight.dtype != first.dtype):
            return False
    n, k = first.shape[-2:]
    experts = first.shape[0] if matrices == 3 else len(weights)
    return (x.shape[1] == k and len(counts) == experts and sum(counts) == x.shape[0] > 0
            and k % 16 == 0 and n % 16 == 0
            and all(count % ROW_MULTIPLE == 0 for count in counts))


def cast_stacked(casts: tuple[Cast, ...], pieces: list[torch.Tensor], *, rowwise: bool,
                 columnwise: bool) -> StackedCast:
    """Each piece cast as its own cast casts it alone, into flat buffers where each piece's
    bytes follow the previous piece's (every piece's size is a multiple of 16 bytes here, so
    the buffers are the pieces' concatenations). Current scaling with one setting for all:
    one multi-tensor launch pair with the kernels; otherwise (delayed scaling, each expert its
    own scale and amax slot; the CPU) one cast per piece, concatenated. Empty pieces are not
    cast (the general path never quantizes an empty split, so records no amax for it)."""
    first = casts[0]
    uniform = first.scale is None and all(
        cast.scale is None and (cast.amax_epsilon, cast.power_2_scale) == (
            first.amax_epsilon, first.power_2_scale) for cast in casts)
    if uniform and kernels.available(pieces[0]):
        return kernel_module("multi_tensor").quantize_current_scaling_stacked(
            pieces, first.fp8_dtype, amax_epsilon=first.amax_epsilon,
            power_2_scale=first.power_2_scale, rowwise=rowwise, columnwise=columnwise)
    shapes = [(piece.shape[0], piece.shape[1]) for piece in pieces]
    offsets, total = [], 0
    for m, k in shapes:
        offsets.append(total)
        total += m * k
    rows, columns, scales = [], [], []
    for cast, piece in zip(casts, pieces, strict=True):
        if piece.numel() == 0:
            scales.append(torch.ones(1, dtype=torch.float32, device=piece.device))
            continue
        data, data_t, scale_inv = cast(piece, rowwise=rowwise, columnwise=columnwise)
        rows.append(data.reshape(-1) if rowwise else None)
        columns.append(data_t.reshape(-1) if columnwise else None)
        scales.append(scale_inv.reshape(1))
    slots = torch.zeros(len(pieces), SCALE_SLOT, dtype=torch.float32, device=pieces[0].device)
    slots[:, 0] = torch.cat(scales)
    return StackedCast(torch.cat(rows) if rowwise else None,
                       torch.cat(columns) if columnwise else None,
                       slots.reshape(-1), offsets, shapes)


def upload(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on `device` without blocking the host: on CUDA through pinned memory and a
    non-blocking copy (torch.tensor(values, device=cuda) copies from pageable memory, which
    waits for the stream to reach the copy)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _grouped_kernel_serves(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    return (a.is_cuda and out_dtype == torch.bfloat16 and hasattr(torch, "_scaled_grouped_mm")
            and a.dtype == b.dtype == torch.float8_e4m3fn
            and torch.cuda.get_device_capability(a.device) == (9, 0))


def grouped_gemm(a: StackedCast, b: torch.Tensor, b_scales: StackedCast, counts: list[int],
                 out_dtype: torch.dtype, *, fast_accumulation: bool) -> torch.Tensor:
    """out[rows of group g] = A_g @ B_g^T, scaled by both operands' scale_inv.

    a: the groups' bytes stacked [R, D] (`a.data`, group g's rows A_g [counts[g], D]); b: E
    stacked [W, D] matrices B_g, flat: the weights' rowwise bytes [E, N, K] in forward
    (x W_g^T), their columnwise copies [E, K, N] in dgrad (dy W_g = dy (W_g^T)^T)."""
    rows, depth = sum(counts), a.shapes[0][1]
    groups = len(counts)
    b3d = b.view(groups, -1, depth)
    width = b3d.shape[1]
    if _grouped_kernel_serves(a.data, b, out_dtype):
        kept = [g for g, count in enumerate(counts) if count]
        a_scales, b_vector = a.scales(), b_scales.scales()
        if len(kept) < groups:  # the kernel is given no empty group
            index = torch.tensor(kept, device=b.device)
            b3d, a_scales, b_vector = b3d[index], a_scales[index], b_vector[index]
        sizes = [counts[g] for g in kept]
        # sizes and their running ends in one asynchronous copy
        on_device = upload(sizes + list(accumulate(sizes)), torch.int32, b.device)
        sizes_on_device, offs = on_device[:len(sizes)], on_device[len(sizes):]
        row_scales = torch.repeat_interleave(a_scales, sizes_on_device, output_size=rows)
        column_scales = b_vector[:, None].expand(len(kept), width).contiguous()
        return torch._scaled_grouped_mm(
            a.data.view(rows, depth), b3d.transpose(-2, -1), row_scales, column_scales,
            offs=offs, out_dtype=out_dtype, use_fast_accum=fast_accumulation)
    out = torch.empty(rows, width, dtype=out_dtype, device=b.device)
    start = 0
    for g, count in enumerate(counts):
        if count:
            scaled_mm_into(out[start:start + count], a.rowwise(g), b3d[g], a.scale(g),
                           b_scales.scale(g), fast_accumulation=fast_accumulation)
        start += count
    return out


def scaled_mm_into(out: torch.Tensor, mat_a: torch.Tensor, mat_b: torch.Tensor,
                   scale_inv_a: torch.Tensor, scale_inv_b: torch.Tensor, *,
                   fast_accumulation: bool) -> None:
    """gemm_paths.scaled_mm_bytes(mat_a, mat_b, ...) written into `out` (a contiguous slice of
    a larger result): the same torch._scaled_mm call with out=, so no copy of each expert's
    result (a profile of the MoE step showed 289 device copies a step, 3.5 ms on an H100)."""
    if out.dtype in (torch.bfloat16, torch.float16, torch.float32):
        torch._scaled_mm(mat_a, mat_b.t(), scale_a=scale_inv_a, scale_b=scale_inv_b,
                         out_dtype=out.dtype, use_fast_accum=fast_accumulation, out=out)
    else:
        out.copy_(scaled_mm_bytes(mat_a, mat_b, scale_inv_a, scale_inv_b, out_dtype=out.dtype,
                                  bias=None, fast_accumulation=fast_accumulation))


class LeanGroupedFP8(torch.autograd.Function):
    """y[rows of expert e] = x[rows of expert e] W_e^T, per-tensor FP8 current scaling per
    expert and operand (see the module docstring). x [R, K]; `weights` one 3-D tensor
    [E, N, K] (its gradient stacked alike) or E tensors [N, K] (one gradient each)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: tuple[int, ...], plan: GroupedPlan,
                need_dgrad: bool, need_wgrad: bool, *weights: torch.Tensor) -> torch.Tensor:
        counts = list(counts)
        x_pieces = list(torch.split(x, counts))
        x_q = cast_stacked(plan.inputs, x_pieces, rowwise=True, columnwise=need_wgrad)
        stacked = len(weights) == 1
        w_pieces = list(weights[0].detach().unbind(0)) if stacked else [w.detach()
                                                                       for w in weights]
        w_q = cast_stacked(plan.weights, w_pieces, rowwise=True, columnwise=need_dgrad)
        y = grouped_gemm(x_q, w_q.data, w_q, counts, x.dtype, fast_accumulation=True)
        if need_wgrad:
            ctx.save_for_backward(x_q.data_t, x_q.scale_inv)
            ctx.x_layout = (x_q.offsets, x_q.shapes)
        # the columnwise bytes and the scales only: holding w_q would keep the rowwise weight
        # bytes alive until backward too (1.4 GB a layer at Mixtral 8x7B's shapes)
        ctx.weight_copy = ((w_q.data_t, w_q._replace(data=None, data_t=None)) if need_dgrad
                           else None)
        ctx.plan, ctx.counts, ctx.stacked = plan, counts, stacked
        ctx.need_dgrad, ctx.need_wgrad = need_dgrad, need_wgrad
        ctx.out_dtype, ctx.weight_dtype = x.dtype, weights[0].dtype
        ctx.weight_shape = w_pieces[0].shape
        return y

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        experts = len(ctx.counts)
        nothing = (None,) * (1 if ctx.stacked else experts)
        if not (ctx.need_dgrad or ctx.need_wgrad):
            return None, None, None, None, None, *nothing
        grad_x, grad_weights = None, nothing
        dy = grad_output if grad_output.is_contiguous() else grad_output.contiguous()
        counts = ctx.counts
        dy_q = cast_stacked(ctx.plan.grad_outputs, list(torch.split(dy, counts)),
                            rowwise=ctx.need_dgrad, columnwise=ctx.need_wgrad)
        if ctx.need_dgrad:
            w_t, w_scales = ctx.weight_copy
            grad_x = grouped_gemm(dy_q, w_t, w_scales, counts, ctx.out_dtype,
                                  fast_accumulation=False)
            if not graph_kept():
                ctx.weight_copy = None  # freed once read, as the general path does
        if ctx.need_wgrad:
            x_t, x_scale_inv = ctx.saved_tensors
            offsets, shapes = ctx.x_layout
            x_q = StackedCast(None, x_t, x_scale_inv, offsets, shapes)
            n, k = ctx.weight_shape
            options = dict(dtype=ctx.weight_dtype, device=dy.device)
            # one [E, N, K] gradient for a 3-D weight, else one [N, K] tensor per weight
            stacked_grad = torch.empty(experts, n, k, **options) if ctx.stacked else None
            grads = (list(stacked_grad.unbind(0)) if ctx.stacked
                     else [torch.empty(n, k, **options) for _ in range(experts)])
            for e, count in enumerate(counts):
                if count:
                    scaled_mm_into(grads[e], dy_q.columnwise(e), x_q.columnwise(e),
                                   dy_q.scale(e), x_q.scale(e), fast_accumulation=False)
                else:
                    grads[e].zero_()
            grad_weights = (stacked_grad,) if ctx.stacked else tuple(grads)
        return grad_x, None, None, None, None, *grad_weights
