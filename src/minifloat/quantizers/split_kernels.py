"""The multi-tensor fast path of split_quantize: every split of one tensor in one kernel call.

Why: a mixture-of-experts layer quantizes one small split per expert, several times a step;
one launch (or two) per split is dominated by launch latency. kernels.multi_tensor,
kernels.nvfp4_multi and kernels.mxfp8_multi quantize a whole group of tensors per launch and give
each tensor the bytes its own single-tensor quantization gives it. This module decides when they
can stand in for the per-split loop of split_quantize (`plan_multi`) and builds each split's
output exactly as that split's own `quantizer(piece)` call would (`run_plan`): the same storage
class, buffers, metadata, nominal dtype and shape, an owner copy of its quantizer with the
reduction group stripped, and a QuantizedTensor wrapper unless the quantizer is `internal`.

Dispatch rules (anything else returns None from `plan_multi`, and split_quantize loops):
- the kernels serve the input (`minifloat.kernels.available(x)`: CUDA with Triton, or CPU tensors
  under TRITON_INTERPRET=1) and x is a contiguous float32/bfloat16/float16 tensor;
- at least one split is non-empty and every non-empty split is itself non-empty in elements (the
  single-tensor quantizers send zero-element tensors to the reference path);
- the quantizers of the non-empty splits (empty splits are never quantized, so theirs do not
  count) are all of exactly one of these types, with equal format signatures (every setting
  that decides the bytes) and equal usages (at least one):
  Float8CurrentScalingQuantizer, Float8BlockQuantizer with block_scaling_dim=1,
  NVFP4Quantizer without 2D quantization (RHT and stochastic rounding allowed), MXFP8Quantizer
  (E4M3 or E5M2); exact types only, so a subclass that changes how it quantizes keeps its own
  path;
- every split passes its quantizer's shape check (NVFP4: M and K multiples of 16; MXFP8: of 32),
  so the loop keeps raising its own errors for shapes a format rejects;
- current scaling and NVFP4 reduce their amaxes over the quantizer's reduction group: all
  splits must carry the same group (the same object, or all None). The kernels then call that
  quantizer's `reduce_amax` once on the vector of all splits' amaxes (a MAX all-reduce is
  elementwise, so each split gets the value its own call would get) instead of once per split.
  Block FP8 1D and MXFP8 take no global amax (one launch, no reduction), so their groups do not
  matter.

Distributed note: with a reduction group, the loop runs one all-reduce per non-empty split and
this path one per amax kind for all of them; both depend only on the splits and quantizer
settings, so ranks that agree on those agree on the path and on the collectives.

Stochastic rounding: this path draws one seed pair per split from torch's generator in one call,
the loop draws per split, so same-seed bytes differ between the two (each is reproducible under
torch.manual_seed; scales and amaxes, which SR does not touch, are equal).

Triton is imported only inside `run_plan`, which runs only after `kernels.available` held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from .. import kernels
from .base import QuantizedStorage, Quantizer, kernel_module
from .blockwise import Float8BlockQuantizer, Float8BlockStorage
from .float8 import Float8CurrentScalingQuantizer, _per_tensor_storage
from .mxfp8 import MXFP8Quantizer, MXFP8Storage
from .nvfp4 import KERNEL_INPUT_DTYPES, NVFP4Quantizer, NVFP4Storage

MultiKind = Literal["current_scaling", "block_1d", "nvfp4_1d", "mxfp8"]

_KINDS: dict[type[Quantizer], MultiKind] = {
    Float8CurrentScalingQuantizer: "current_scaling",
    Float8BlockQuantizer: "block_1d",
    NVFP4Quantizer: "nvfp4_1d",
    MXFP8Quantizer: "mxfp8",
}
_USES_GLOBAL_AMAX = ("current_scaling", "nvfp4_1d")


@dataclass
class MultiPlan:
    """What run_plan needs: the kernel kind and the non-empty splits (their index, rows of x and
    quantizer); `settings` is the quantizer whose configuration all of them share."""

    kind: MultiKind
    indices: list[int]
    pieces: list[torch.Tensor]
    quantizers: list[Quantizer]

    @property
    def settings(self) -> Quantizer:
        return self.quantizers[0]


def _kernel_kind(quantizer: Quantizer) -> MultiKind | None:
    """The multi kernel that can serve this quantizer's configuration, if any (exact types)."""
    kind = _KINDS.get(type(quantizer))
    if kind == "block_1d" and quantizer.block_scaling_dim != 1:
        return None
    if kind == "nvfp4_1d" and quantizer.with_2d_quantization:
        return None
    return kind


def plan_multi(
    x: torch.Tensor, splits: Sequence[int], quantizers: Sequence[Quantizer]
) -> MultiPlan | None:
    """A plan for quantizing every non-empty split with one multi-tensor kernel call, or None
    when the per-split loop must run (see the module docstring for the rules). Cheap: shapes and
    quantizer attributes only; nothing is launched or synchronised."""
    if not kernels.available(x):
        return None
    if x.dtype not in KERNEL_INPUT_DTYPES or not x.is_contiguous() or x.dim() == 0:
        return None
    active = [i for i, rows in enumerate(splits) if rows]
    if not active:
        return None
    first = quantizers[active[0]]
    kind = _kernel_kind(first)
    if kind is None or not (first.rowwise_usage or first.columnwise_usage):
        return None
    signature = first.format_signature()
    group = first.amax_reduction_group
    chosen = [quantizers[i] for i in active]
    for quantizer in chosen[1:]:
        if (
            type(quantizer) is not type(first)
            or quantizer.rowwise_usage != first.rowwise_usage
            or quantizer.columnwise_usage != first.columnwise_usage
            or (kind in _USES_GLOBAL_AMAX and quantizer.amax_reduction_group is not group)
            or quantizer.format_signature() != signature
        ):
            return None
    pieces = torch.split(x.detach(), list(splits))
    chosen_pieces = [pieces[i] for i in active]
    for piece, quantizer in zip(chosen_pieces, chosen, strict=True):
        # zero-element splits (K = 0) take the reference path in the single-tensor quantizers
        if piece.numel() == 0 or not piece.is_contiguous() or not quantizer.is_quantizable(piece):
            return None
    return MultiPlan(kind, active, chosen_pieces, chosen)


def _launch(plan: MultiPlan) -> list[dict[str, torch.Tensor | None]]:
    """One multi-kernel call over the plan's pieces: per piece, the storage fields its own
    quantizer's kernel path would hand to the storage."""
    q = plan.settings
    rowwise, columnwise = q.rowwise_usage, q.columnwise_usage
    # the group is the same for every split (plan_multi checked): one vector reduction
    reduce_amax = q.reduce_amax if q.amax_reduction_group is not None else None
    if plan.kind == "current_scaling":
        results = kernel_module("multi_tensor").quantize_current_scaling_multi(
            plan.pieces, q.fp8_dtype, amax_epsilon=q.amax_epsilon,
            power_2_scale=q.power_2_scale, rowwise=rowwise, columnwise=columnwise,
            reduce_amax=reduce_amax,
        )
        return [{"data": data, "data_transpose": data_t, "scale_inv": scale_inv}
                for data, data_t, scale_inv in results]
    if plan.kind == "block_1d":
        results = kernel_module("multi_tensor").quantize_block_1d_multi(
            plan.pieces, rowwise=rowwise, columnwise=columnwise,
            power_2_scale=q.power_2_scale, amax_epsilon=q.amax_epsilon,
        )
        names = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
        return [dict(zip(names, result, strict=True)) for result in results]
    if plan.kind == "mxfp8":
        return kernel_module("mxfp8_multi").quantize_mxfp8_multi(
            plan.pieces, dtype=q.fp8_dtype, rowwise=rowwise, columnwise=columnwise
        )
    return kernel_module("nvfp4_multi").quantize_nvfp4_multi(
        plan.pieces, rowwise=rowwise, columnwise=columnwise, with_rht=q.with_rht,
        stochastic_rounding=q.stochastic_rounding, reduce_amax=reduce_amax,
    )


def _storage(
    kind: MultiKind, quantizer: Quantizer, piece: torch.Tensor,
    fields: dict[str, torch.Tensor | None],
) -> QuantizedStorage:
    """The storage quantizer._quantize_impl(piece, owner) builds from the same kernel bytes."""
    owner = quantizer._output_quantizer()
    if kind == "current_scaling":
        return _per_tensor_storage(quantizer, owner, piece, fields["data"], fields["scale_inv"],
                                   quantizer.fp8_dtype, fields["data_transpose"])
    if kind == "block_1d":
        return Float8BlockStorage(shape=tuple(piece.shape), dtype=piece.dtype, quantizer=owner,
                                  block_scaling_dim=1, **fields)
    if kind == "mxfp8":
        return MXFP8Storage(shape=tuple(piece.shape), dtype=piece.dtype, quantizer=owner,
                            fp8_dtype=quantizer.fp8_dtype, **fields)
    return NVFP4Storage(shape=tuple(piece.shape), dtype=piece.dtype, quantizer=owner,
                        two_dimensional=False, with_rht=quantizer.with_rht, **fields)


def run_plan(
    plan: MultiPlan, count: int
) -> list[QuantizedStorage | torch.Tensor | None]:
    """Execute a plan: `count` results in split order, None for the empty splits, each other one
    what its quantizer's own call returns (a QuantizedTensor, or the storage when internal)."""
    out: list[QuantizedStorage | torch.Tensor | None] = [None] * count
    for index, piece, quantizer, fields in zip(
        plan.indices, plan.pieces, plan.quantizers, _launch(plan), strict=True
    ):
        out[index] = quantizer._wrap(_storage(plan.kind, quantizer, piece, fields))
    return out
