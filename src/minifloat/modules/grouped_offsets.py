"""A mixture of experts' grouped FP8 GEMMs with the groups on the device: nothing read on the host.

Why: FusedExperts' lean path (lean_grouped_fp8.py) needs every expert's token count on the
host, to split the rows and to call one _scaled_mm per expert where no grouped kernel takes the
operands (E5M2 gradients). That read waits for the GPU once a layer, so the host cannot run
ahead, and under torch.compile the experts ran as a graph break (BENCHMARKS.md, twenty-third
session: hf-mixtral-moe FP8 at 0.65x bf16 eager, 0.75x compiled). Here the layout, the casts
and the GEMMs take the groups as a device tensor of row ends, so a compiled model traces the
experts in its graph (fullgraph) and an eager step does not synchronise.

The layout (`routing_layout`): the (token, slot) pairs sorted by expert, each expert's rows
padded with zero rows to a multiple of GROUP_ROWS (128), in a buffer whose row count depends on
the shapes only: pairs + experts * 127, rounded up to 128; the rows past the last expert's own
end join the last group (zero rows: exact, as every padding row is: a zero row raises no amax,
adds nothing to a weight gradient and its output is dropped). So a 128-row tile never straddles
two groups, every group's row count is a multiple of 128, and ends[-1] is the buffer's size.

The casts (`group_scales` with `cast_groups`, and `cast_stacked_weights`): per-tensor current
scaling, each expert's rows and each expert's weight a tensor of its own: the bytes and scales
of numerics' quantize_current_scaling on that expert's rows alone (what the general path
quantizes), in two ops (`grouped_rows_cast`, `stacked_weights_cast`): where the kernels run,
kernels/grouped_cast.py for the rows (both copies in one launch; the groups' maxima in torch
ops before it, their scales in the per_tensor_scales op) and the multi-tensor launch pair for the
experts' weights (the lean path's); elsewhere torch ops (a clamp and one conversion:
`saturating_encode`). The columnwise copies of per-tensor FP8 are the rowwise bytes transposed
(NUMERICS.md §2).

The GEMMs (`grouped_rows_gemm`, `grouped_reduction_gemm`: torch ops with fake
implementations) run kernels/grouped_gemm.py on CUDA (any E4M3/E5M2 pair) and, elsewhere, the
reference: the operands' FP8 values (exact in fp32) through torch._grouped_mm in fp32, then
each group's alpha = scale_inv(a) * scale_inv(b), then the output dtype (numerics.gemm's
order). Forward accumulates fast, backward with split accumulators, as the lean path's
_scaled_mm calls do.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import kernels
from ..numerics.formats import fp8_format
from ..numerics.per_tensor import scale_from_amax
from ..quantizers.base import kernel_module
from .expert_rows import pair_positions
from .input_recast import magnitude_bits, maximum_of_bits, per_tensor_scales
from .op_define import define_op

GROUP_ROWS = 128  # kernels.grouped_gemm.GROUP_ROWS: the kernels' layout contract


class OffsetsCasts(NamedTuple):
    """The current-scaling settings of the three operands, the same for every expert (plain
    constants: a compiled graph guards on their values, equal in every layer)."""

    input_dtype: torch.dtype
    weight_dtype: torch.dtype
    grad_dtype: torch.dtype
    amax_epsilon: float
    power_2_scale: bool


class RoutingLayout(NamedTuple):
    """Where each routed (token, slot) pair sits in the padded, expert-sorted rows (pair p is
    token p // top_k's slot p % top_k, so row r copies token pair_of_row[r] // top_k, the
    zero row T for padding; expert_rows.py moves the rows by these gathers)."""

    pair_row: torch.Tensor  # [pairs] the row of each pair
    pair_of_row: torch.Tensor  # [R] the pair each row holds (pairs: a padding row)
    ends: torch.Tensor  # [E] int32: group g is rows [ends[g-1], ends[g])


def uniform_dtypes(plans: list, delayed: bool) -> tuple[torch.dtype, ...] | None:
    """(input, weight, grad_output) FP8 dtypes when every expert GEMM has a lean plan
    (lean_fp8.LeanPlan), all of delayed scaling (`delayed`) or all of current scaling, with one
    dtype per operand (the grouped kernels read one per side), else None."""
    if not plans or any(plan is None for plan in plans):
        return None
    slots = ("input", "weight", "grad_output")
    dtypes = tuple(getattr(plans[0], slot).fp8_dtype for slot in slots)
    for plan in plans:
        for slot, dtype in zip(slots, dtypes, strict=True):
            cast = getattr(plan, slot)
            if (cast.scale is not None) != delayed or cast.fp8_dtype != dtype:
                return None
    return dtypes


def padded_rows(pairs: int, experts: int) -> int:
    """The layout's row count: room for every expert's padding, from the shapes alone."""
    return -(-(pairs + experts * (GROUP_ROWS - 1)) // GROUP_ROWS) * GROUP_ROWS


def routing_layout(top_k_index: torch.Tensor, experts: int) -> RoutingLayout:
    """The padded layout of `top_k_index`'s routing [tokens, top_k], on its device."""
    chosen = top_k_index.reshape(-1).long()  # (a router may give int32 indices)
    pairs = chosen.numel()
    order = torch.argsort(chosen, stable=True)
    counts = chosen.new_zeros(experts).scatter_add_(0, chosen, torch.ones_like(chosen))
    padded = (counts + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS
    padded_ends = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    # sorted pair i of expert e goes to row i + (e's padded start - e's start)
    shift = padded_ends - padded - starts
    real = torch.arange(pairs, device=chosen.device) + shift[chosen[order]]
    rows = padded_rows(pairs, experts)
    pair_row, pair_of_row = pair_positions(order, real, rows)
    ends = torch.cat([padded_ends[:-1], padded_ends.new_full((1,), rows)]).to(torch.int32)
    return RoutingLayout(pair_row, pair_of_row, ends)


def saturating_encode(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """numerics.cast_to_fp8's bytes for fp32 values in two fusible ops: clamp to +-max
    (saturation; NaN passes), then torch's conversion, which rounds to nearest even itself
    (input_recast.per_tensor_cast's argument). The reference's own grid arithmetic, fused by
    inductor, was the largest part of a compiled MoE step's cast time on an H200."""
    limit = fp8_format(dtype).max_value
    return torch.clamp(scaled, -limit, limit).to(dtype)


def tile_groups(ends: torch.Tensor, rows: int, tile_rows: int = GROUP_ROWS) -> torch.Tensor:
    """The group of each `tile_rows`-row tile [rows / tile_rows] (int64; 1: of each row)."""
    starts = torch.arange(0, rows, tile_rows, device=ends.device, dtype=torch.int32)
    return torch.searchsorted(ends, starts, right=True)


def cast_kernels_serve(x: torch.Tensor) -> bool:
    return kernels.available(x) and x.is_contiguous() and x.dtype in (
        torch.float32, torch.bfloat16, torch.float16)


def rows_cast(x: torch.Tensor, scale: torch.Tensor, ends: torch.Tensor,
               fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool) -> list[torch.Tensor]:
    """[bytes [R, D] if rowwise, their transpose [D, R] if columnwise]: the rows of group g
    cast with scale[g]; kernels/grouped_cast.py (one launch, both copies) where the kernels
    run."""
    if cast_kernels_serve(x):
        data, data_t = kernel_module("grouped_cast").grouped_cast(
            x, scale, ends, fp8_dtype, rowwise=rowwise, columnwise=columnwise)
    else:
        rows, depth = x.shape
        tiles = x.reshape(rows // GROUP_ROWS, GROUP_ROWS, depth).float()
        data = saturating_encode(tiles * scale[tile_groups(ends, rows)][:, None, None],
                                 fp8_dtype).reshape(rows, depth)
        data_t = data.t().contiguous() if columnwise else None
    return [t for t, wanted in ((data, rowwise), (data_t, columnwise)) if wanted]


def _rows_cast_fake(x: torch.Tensor, scale: torch.Tensor, ends: torch.Tensor,
                    fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
                    ) -> list[torch.Tensor]:
    rows, depth = x.shape
    return [x.new_empty(shape, dtype=fp8_dtype) for shape, wanted in
            (((rows, depth), rowwise), ((depth, rows), columnwise)) if wanted]


def rows_cast_weights(experts: int, n: int, k: int) -> bool:
    """Whether the experts' weights [E, N, K] are cast as the rows of one [E * N, K] matrix,
    each expert's N rows a group of the grouped cast (N in whole GROUP_ROWS, the cast's layout
    contract; the dgrad kernel's offsets into the transposed copy [K, E * N] within int32).
    Shapes alone decide, so the fake implementation lays out the same copies."""
    return n % GROUP_ROWS == 0 and experts * n * k < 2**31


def weight_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' weights [E, N, K] as rows [E * N, K] and each expert's row end [E] int32:
    the grouped cast's operands where rows_cast_weights holds."""
    experts, n, k = weight.shape
    ends = torch.arange(n, experts * n + 1, n, dtype=torch.int32, device=weight.device)
    return weight.reshape(experts * n, k), ends


def expert_copies(data: torch.Tensor | None, data_t: torch.Tensor | None,
                  shape: torch.Size) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The grouped cast's copies of weight_rows back as the experts': bytes [E, N, K], and
    each expert's transpose [E, K, N] over the one [K, E * N] matrix the cast wrote."""
    experts, n, k = shape
    return (None if data is None else data.view(experts, n, k),
            None if data_t is None else data_t.view(k, experts, n).permute(1, 0, 2))


def weights_transposed(data: torch.Tensor) -> torch.Tensor:
    """Each expert's transpose [E, K, N] of bytes [E, N, K], laid out as rows_cast_weights'
    cast writes it: one [K, E * N] matrix (expert e's columns e * N .. (e + 1) * N)."""
    experts, n, k = data.shape
    return data.reshape(experts * n, k).t().contiguous().view(k, experts, n).permute(1, 0, 2)


def _weights_cast(weight: torch.Tensor, fp8_dtype: torch.dtype, amax_epsilon: float,
                  power_2_scale: bool, rowwise: bool, columnwise: bool) -> list[torch.Tensor]:
    """[bytes [E, N, K] if rowwise, each expert's transpose [E, K, N] if columnwise,
    scale_inv [E]]: each expert's weight its own current-scaling cast. Where the kernels run:
    as rows (rows_cast_weights: one reduction for the experts' maxima, the scales' kernel and
    one grouped cast launch; the multi-tensor launch pair it replaced spent ~0.5 ms of host
    time a call in a compiled Mixtral step on an H200), else the multi-tensor pair."""
    experts, n, k = weight.shape
    as_rows = rows_cast_weights(experts, n, k)
    if cast_kernels_serve(weight) and as_rows:
        # the inf-norm is max|w| in one reduction (no |w| temporary); NaN propagates
        amax = torch.linalg.vector_norm(weight, float("inf"), dim=(1, 2), dtype=torch.float32)
        scale, scale_inv = per_tensor_scales(amax, fp8_dtype == torch.float8_e5m2,
                                             amax_epsilon, power_2_scale)
        rows, ends = weight_rows(weight)
        data, data_t = expert_copies(*kernel_module("grouped_cast").grouped_cast(
            rows, scale, ends, fp8_dtype, rowwise=rowwise, columnwise=columnwise), weight.shape)
    elif cast_kernels_serve(weight):
        stacked = kernel_module("multi_tensor").quantize_current_scaling_stacked(
            list(weight.unbind(0)), fp8_dtype, amax_epsilon=amax_epsilon,
            power_2_scale=power_2_scale, rowwise=rowwise, columnwise=columnwise)
        size = experts * n * k  # whole 16-byte pieces (N, K multiples of 16): no gaps
        data = stacked.data[:size].view(experts, n, k) if rowwise else None
        data_t = stacked.data_t[:size].view(experts, k, n) if columnwise else None
        scale_inv = stacked.scales().contiguous()
    else:
        amax = weight.abs().amax(dim=(1, 2)).float()
        scale = scale_from_amax(amax, fp8_format(fp8_dtype).max_value,
                                amax_epsilon=amax_epsilon, power_2_scale=power_2_scale)
        data = saturating_encode(weight.float() * scale[:, None, None], fp8_dtype)
        data_t = ((weights_transposed(data) if as_rows else data.transpose(1, 2).contiguous())
                  if columnwise else None)
        scale_inv = torch.reciprocal(scale)
    return [t for t, wanted in ((data, rowwise), (data_t, columnwise)) if wanted] + [scale_inv]


def _weights_cast_fake(weight: torch.Tensor, fp8_dtype: torch.dtype, amax_epsilon: float,
                       power_2_scale: bool, rowwise: bool, columnwise: bool
                       ) -> list[torch.Tensor]:
    experts, n, k = weight.shape
    outputs = [weight.new_empty(experts, n, k, dtype=fp8_dtype)] if rowwise else []
    if columnwise:
        strides = ((n, experts * n, 1) if rows_cast_weights(experts, n, k)
                   else (k * n, n, 1))
        outputs.append(weight.new_empty_strided((experts, k, n), strides, dtype=fp8_dtype))
    return outputs + [weight.new_empty(experts, dtype=torch.float32)]


# Ops: a compiled graph runs the kernels too (its own fused code would make the transposed
# copies in a second pass, as graph_casts.py found for the per-tensor casts)
grouped_rows_cast = define_op("grouped_rows_cast", rows_cast, _rows_cast_fake)
stacked_weights_cast = define_op("stacked_weights_cast", _weights_cast, _weights_cast_fake)


def groups_of_tiles(tile_amax: torch.Tensor, ends: torch.Tensor, rows: int,
                    tile_rows: int = GROUP_ROWS) -> torch.Tensor:
    """Each group's maximum [E] fp32 of its `tile_rows`-row tiles' maxima (0 when empty)."""
    groups = ends.shape[0]
    member = (tile_groups(ends, rows, tile_rows)[None, :]
              == torch.arange(groups, device=ends.device)[:, None])
    return torch.where(member, tile_amax.float()[None, :], 0.0).amax(dim=1)


def group_maxima(x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """max|rows| of each group [E] fp32 (NaN propagating; 0 for an empty group), in torch ops:
    a compiled graph fuses them into x's producer."""
    rows, depth = x.shape
    x = x.detach()
    bits = magnitude_bits(x)  # (x's own values where the maxima fuse into its producer)
    if bits is None:
        tile_amax = x.reshape(rows // GROUP_ROWS, GROUP_ROWS, depth).abs().amax(dim=(1, 2))
    else:
        tile_amax = bits.reshape(rows // GROUP_ROWS, GROUP_ROWS, depth).amax(dim=(1, 2))
        tile_amax = maximum_of_bits(tile_amax, x.dtype)
    return groups_of_tiles(tile_amax, ends, rows)


def stored_group_maxima(x: torch.Tensor, ends: torch.Tensor,
                        tile_rows: int = GROUP_ROWS) -> torch.Tensor:
    """group_maxima's values inside an op, where nothing fuses: one reduction over the stored
    x (the inf-norm of each tile, NaN propagating), no |x| or bit-view temporary. x may have
    any strides; groups of whole `tile_rows` (NVFP4's experts: 16)."""
    rows, depth = x.shape
    tile_amax = torch.linalg.vector_norm(x.reshape(rows // tile_rows, tile_rows, depth),
                                         float("inf"), dim=(1, 2), dtype=torch.float32)
    return groups_of_tiles(tile_amax, ends, rows, tile_rows)


def group_scales(x: torch.Tensor, ends: torch.Tensor, dtype: torch.dtype, amax_epsilon: float,
                 power_2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) [E] fp32: each group's current-scaling scale from the maximum of its
    rows (group_maxima; NaN in a group gives that group NaN's scale, as the per-tensor cast
    does), and its reciprocal, in the per_tensor_scales op: inductor's division and
    reciprocal need not be correctly rounded (H200: compiled group scales an ulp off
    eager's)."""
    return per_tensor_scales(group_maxima(x, ends), dtype == torch.float8_e5m2, amax_epsilon,
                             power_2_scale)


def cast_groups(x: torch.Tensor, ends: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor,
                *, rowwise: bool = True, columnwise: bool = False
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(bytes [R, D] if `rowwise`, their transpose [D, R] if `columnwise`): group g's rows
    cast with scale[g] (group_scales), by the grouped_rows_cast op."""
    copies = iter(grouped_rows_cast(x.detach(), scale, ends, dtype, rowwise, columnwise))
    return next(copies) if rowwise else None, next(copies) if columnwise else None


def cast_stacked_weights(weight: torch.Tensor, dtype: torch.dtype, amax_epsilon: float,
                         power_2_scale: bool, *, rowwise: bool = True,
                         columnwise: bool = False
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(bytes [E, N, K] if `rowwise`, each expert's transpose [E, K, N] if `columnwise`,
    scale_inv [E]): each expert's weight its own current-scaling cast, by the
    stacked_weights_cast op."""
    copies = iter(stacked_weights_cast(weight.detach(), dtype, amax_epsilon, power_2_scale,
                                       rowwise, columnwise))
    data = next(copies) if rowwise else None
    data_t = next(copies) if columnwise else None
    return data, data_t, next(copies)


# ---- the two grouped GEMMs as torch ops ----

def _kernel_serves(a: torch.Tensor) -> bool:
    return kernels.available(a)


def _group_alpha(a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor) -> torch.Tensor:
    return a_scale_inv.float() * b_scale_inv.float()


def _rows_gemm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
               b_scale_inv: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype,
               precise: bool) -> torch.Tensor:
    """out[rows of g] = (a[rows of g] @ b[g]^T) * a_scale_inv[g] * b_scale_inv[g]."""
    if _kernel_serves(a):
        return kernel_module("grouped_gemm").grouped_rows_gemm(
            a, b, a_scale_inv, b_scale_inv, ends, out_dtype, precise=precise)
    product = torch._grouped_mm(a.float(), b.float().transpose(-2, -1), offs=ends)
    alpha = _group_alpha(a_scale_inv, b_scale_inv)
    row_alpha = alpha[tile_groups(ends, a.shape[0])].repeat_interleave(GROUP_ROWS)
    return (product * row_alpha[:, None]).to(out_dtype)


def _rows_gemm_fake(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                    b_scale_inv: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype,
                    precise: bool) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


def _reduction_gemm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                    b_scale_inv: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype,
                    precise: bool) -> torch.Tensor:
    """out[g] = (a[:, rows of g] @ b[:, rows of g]^T) * a_scale_inv[g] * b_scale_inv[g]."""
    if _kernel_serves(a):
        return kernel_module("grouped_gemm").grouped_reduction_gemm(
            a, b, a_scale_inv, b_scale_inv, ends, out_dtype, precise=precise)
    product = torch._grouped_mm(a.float(), b.float().t(), offs=ends)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    alpha = _group_alpha(a_scale_inv, b_scale_inv)
    return torch.where(counts[:, None, None] > 0, product * alpha[:, None, None],
                       0.0).to(out_dtype)


def _reduction_gemm_fake(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                         b_scale_inv: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype,
                         precise: bool) -> torch.Tensor:
    return a.new_empty(ends.shape[0], a.shape[0], b.shape[0], dtype=out_dtype)


grouped_rows_gemm = define_op("grouped_rows_gemm", _rows_gemm, _rows_gemm_fake)
grouped_reduction_gemm = define_op("grouped_reduction_gemm", _reduction_gemm,
                                   _reduction_gemm_fake)


class GroupedOffsetsFP8(torch.autograd.Function):
    """y[rows of g] = x[rows of g] W_g^T for the 3-D weight [E, N, K], the groups given by
    `ends` on the device; per-tensor FP8 current scaling per expert and operand.

    `rebuild` (the module's rebuild_weight_copy_in_backward): keep the weight, not its FP8
    copy, and cast it again in backward; `save_original` (save_original_input): keep x, not
    its columnwise copy, and cast it again (current scaling: the same bytes either way)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor,
                casts: OffsetsCasts, need_dgrad: bool, need_wgrad: bool, rebuild: bool,
                save_original: bool) -> torch.Tensor:
        eps, power_2 = casts.amax_epsilon, casts.power_2_scale
        # backward reads x^T's bytes for wgrad, each W_g^T's for dgrad (or what makes them
        # again: x with forward's scales, the weights, which the cast takes its maxima from)
        x_scale, x_scale_inv = group_scales(x, ends, casts.input_dtype, eps, power_2)
        x_bytes, x_t = cast_groups(x, ends, casts.input_dtype, x_scale,
                                   columnwise=need_wgrad and not save_original)
        w_bytes, w_t, w_scale_inv = cast_stacked_weights(
            weight, casts.weight_dtype, eps, power_2, columnwise=need_dgrad and not rebuild)
        y = grouped_rows_gemm(x_bytes, w_bytes, x_scale_inv, w_scale_inv, ends, x.dtype, False)
        x_kept = (x.detach() if save_original else x_t) if need_wgrad else None
        w_kept = (weight.detach() if rebuild else w_t) if need_dgrad else None
        ctx.save_for_backward(x_kept, x_scale if save_original else None, x_scale_inv, w_kept,
                              w_scale_inv, ends)
        ctx.casts, ctx.need_dgrad, ctx.need_wgrad = casts, need_dgrad, need_wgrad
        ctx.rebuild, ctx.save_original = rebuild, save_original
        ctx.weight_dtype = weight.dtype
        return y

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x_kept, x_scale, x_scale_inv, w_kept, w_scale_inv, ends = ctx.saved_tensors
        casts = ctx.casts
        eps, power_2 = casts.amax_epsilon, casts.power_2_scale
        dy = grad_output.contiguous()
        dy_scale, dy_scale_inv = group_scales(dy, ends, casts.grad_dtype, eps, power_2)
        dy_bytes, dy_t = cast_groups(dy, ends, casts.grad_dtype, dy_scale,
                                     rowwise=ctx.need_dgrad, columnwise=ctx.need_wgrad)
        grad_x = grad_weight = None
        if ctx.need_dgrad:
            w_t = w_kept
            if ctx.rebuild:
                _, w_t, _ = cast_stacked_weights(w_kept, casts.weight_dtype, eps, power_2,
                                                 rowwise=False, columnwise=True)
            grad_x = grouped_rows_gemm(dy_bytes, w_t, dy_scale_inv, w_scale_inv, ends,
                                       grad_output.dtype, True)
        if ctx.need_wgrad:
            x_t = x_kept
            if ctx.save_original:
                _, x_t = cast_groups(x_kept, ends, casts.input_dtype, x_scale, rowwise=False,
                                     columnwise=True)
            grad_weight = grouped_reduction_gemm(dy_t, x_t, dy_scale_inv, x_scale_inv, ends,
                                                 ctx.weight_dtype, True)
        return grad_x, grad_weight, None, None, None, None, None, None
