"""Multi-tensor per-tensor FP8 casts whose copies are allocations of their own: the eager
weight-cast batch's (modules/weight_cast_batch.py).

Why apart from multi_tensor.py's flat buffers: a view into a flat buffer keeps the whole buffer
alive, so copies that are dropped one by one (a weight's rowwise copy after its forward GEMM,
its columnwise copy after its dgrad) would free nothing until the last is dropped. Here every
copy is its own allocation, and the kernels address each by its byte offset from the first one
of its kind (the caching allocator's blocks are 512-byte aligned; a group that is not 16-byte
aligned raises). Same tables, tiles and device code as multi_tensor.py, so the same bytes as
the single-tensor casts:

- current scaling: multi_tensor's amax launch and cast launch;
- delayed scaling: one launch, each tensor cast with its own recipe state's scale and its
  max|x| folded into its own amax slot (the slots of several states addressed by pointer
  difference from the lowest, as the inputs are).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import per_tensor_fp8
from .fp8_common import is_e5m2, jit, reciprocal_rn, tl
from .launch import launch
from .multi_tensor import (
    ALIGN,
    FIELDS,
    SCALE_ALIGN,
    _cast_plan,
    _cast_program,
    _check_group,
    _current_scaling_launches,
    _input_offsets,
    _matrix_shape,
    _search_steps,
    _starts,
    _upload,
    tile_pointers,
)
from .per_tensor_tile import per_tensor_tile, scale_makes_nan
from .stacked_cast import SCALE_SLOT


@jit
def _multi_delayed_cast_kernel(x_base, data_base, data_t_base, table_ptr, starts_ptr,
                               state_base, state_bits_base, scale_inv_ptr, n,
                               E5M2: tl.constexpr, STEPS: tl.constexpr, FIELDS: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                               HALVES: tl.constexpr, ROW_WORDS: tl.constexpr,
                               COL_WORDS: tl.constexpr, MASK_M: tl.constexpr,
                               MASK_K: tl.constexpr, WIDE: tl.constexpr, HW_CAST: tl.constexpr,
                               PRODUCTS: tl.constexpr, MAX_U16X2: tl.constexpr,
                               X_DIVISOR: tl.constexpr, M_ALIGNED: tl.constexpr,
                               K_ALIGNED: tl.constexpr):
    """Delayed scaling: tensor i is cast with the fp32 scale at state_base + table[5] and folds
    its max|x| into the amax at state_bits_base + table[6] (the int32 view of the same base:
    each tensor's recipe-state slots, addressed by pointer difference). Both copies."""
    i, row, M, K, local, tile_m, tile_k = _cast_program(
        table_ptr, starts_ptr, n, STEPS, FIELDS, BLOCK_K, WIDE, M_ALIGNED, K_ALIGNED)
    scale = tl.load(state_base + tl.load(row + 5))
    x_ptr, data_ptr, data_t_ptr = tile_pointers(x_base, data_base, data_t_base, row, X_DIVISOR,
                                                HALVES, ROW_WORDS, COL_WORDS)
    # the tiles check their own NaN (their maxima are taken anyway); the scale's say is here
    per_tensor_tile(x_ptr, data_ptr, data_t_ptr, state_bits_base + tl.load(row + 6), scale,
                    scale_makes_nan(scale), M, K, tile_m, tile_k, E5M2,
                    True, True, True, True, BLOCK_M, BLOCK_K, HALVES, ROW_WORDS, COL_WORDS,
                    MASK_M, MASK_K, WIDE, HW_CAST, PRODUCTS, MAX_U16X2)
    if local == 0:
        tl.store(scale_inv_ptr + i * SCALE_ALIGN, reciprocal_rn(scale))  # 16-byte slots


def quantize_current_scaling_each(
    tensors: Sequence[torch.Tensor],
    fp8_dtype: torch.dtype,
    *,
    amax_epsilon: float = 0.0,
    power_2_scale: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """multi_tensor.quantize_current_scaling_multi with both copies, each in its own
    allocation (the module docstring says why)."""
    _check_group(tensors)
    shapes = [_matrix_shape(t) for t in tensors]
    data, data_t, data_offsets, data_t_offsets = _separate_outputs(shapes, tensors[0].device)
    scale_inv = _current_scaling_launches(
        tensors, shapes, fp8_dtype, amax_epsilon, power_2_scale, None,
        (data[0], data_offsets), (data_t[0], data_t_offsets))
    return _separate_results(data, data_t, scale_inv, fp8_dtype)


def quantize_delayed_scaling_each(
    tensors: Sequence[torch.Tensor],
    fp8_dtype: torch.dtype,
    scales: Sequence[torch.Tensor],
    amaxes: Sequence[torch.Tensor],
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per-tensor delayed scaling of many tensors in one launch, both copies, each in its own
    allocation (as quantize_current_scaling_each): tensor i is cast with scales[i] and its
    max|x| folded into amaxes[i] in place, each a 1-element fp32 tensor on the tensors' device
    (the recipe state's slots). The bytes, and the amaxes, of
    per_tensor_fp8.quantize_delayed_scaling called on each tensor."""
    _check_group(tensors)
    if len(scales) != len(tensors) or len(amaxes) != len(tensors):
        raise ValueError("quantize_delayed_scaling_each: one scale and one amax per tensor")
    device = tensors[0].device
    state_base, state_offsets = _state_offsets([*scales, *amaxes], device)
    n = len(tensors)
    shapes = [_matrix_shape(t) for t in tensors]
    data, data_t, data_offsets, data_t_offsets = _separate_outputs(shapes, device)
    base, x_offsets = _input_offsets(tensors)
    constexprs, tile_counts = _cast_plan(shapes, base, x_offsets)
    rows = [(x_offsets[i], m, k, data_offsets[i], data_t_offsets[i], state_offsets[i],
             state_offsets[n + i]) for i, (m, k) in enumerate(shapes)]
    table = _upload(rows, (_starts(tile_counts),), device)
    scale_inv = torch.empty(n * SCALE_SLOT, dtype=torch.float32, device=device)
    launch(_multi_delayed_cast_kernel, (sum(tile_counts),),
           *per_tensor_fp8.tile_views(base, data[0], data_t[0], constexprs),
           table[: n * FIELDS], table[n * FIELDS:], state_base, state_base.view(torch.int32),
           scale_inv, n, E5M2=is_e5m2(fp8_dtype), STEPS=_search_steps(n), FIELDS=FIELDS,
           **constexprs, num_warps=4)
    return _separate_results(data, data_t, scale_inv, fp8_dtype)


def _state_offsets(slots: Sequence[torch.Tensor], device: torch.device
                   ) -> tuple[torch.Tensor, list[int]]:
    """The lowest-addressed of `slots` (1-element fp32 tensors on `device`, e.g. scales and
    amaxes owned by several recipe states) and each slot's fp32-element offset from it."""
    for slot in slots:
        if slot.dtype != torch.float32 or slot.numel() != 1 or slot.device != device:
            raise ValueError("delayed-scaling slots must be 1-element float32 tensors on the "
                             f"tensors' device {device}; got {slot.dtype}, shape "
                             f"{tuple(slot.shape)} on {slot.device}")
    base = min(slots, key=lambda slot: slot.data_ptr())
    offsets = [(slot.data_ptr() - base.data_ptr()) // 4 for slot in slots]
    return base, offsets


def _separate_outputs(shapes: Sequence[tuple[int, int]], device: torch.device
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], list[int]]:
    """Both copies of each tensor as allocations of their own (uint8 [M, K] and [K, M]), and
    each one's byte offset from the first of its kind (multiples of ALIGN: the kernels' hint)."""
    data = [torch.empty((m, k), dtype=torch.uint8, device=device) for m, k in shapes]
    data_t = [torch.empty((k, m), dtype=torch.uint8, device=device) for m, k in shapes]
    offsets = [[b.data_ptr() - buffers[0].data_ptr() for b in buffers]
               for buffers in (data, data_t)]
    if any(offset % ALIGN for offset in offsets[0] + offsets[1]):
        raise ValueError(f"multi-tensor FP8 kernel: output buffers must be {ALIGN}-byte aligned")
    return data, data_t, offsets[0], offsets[1]


def _separate_results(data: list[torch.Tensor], data_t: list[torch.Tensor],
                      scale_inv: torch.Tensor, fp8_dtype: torch.dtype
                      ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per tensor (data, data_t, its 16-byte scale_inv slot), as the single casts return."""
    return [(d.view(fp8_dtype), d_t.view(fp8_dtype),
             scale_inv[i * SCALE_SLOT:i * SCALE_SLOT + 1])
            for i, (d, d_t) in enumerate(zip(data, data_t, strict=True))]
